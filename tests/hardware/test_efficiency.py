"""Kernel efficiency per device (hybridtrain/hardware/efficiency.py): every entry names a GPU
the peak table knows, lies in (0, 1] and carries its source; devices without a figure say so."""

from __future__ import annotations

from hybridtrain.hardware.efficiency import (
    CPU_EFFICIENCY,
    EFFICIENCIES,
    H100_MEASURED,
    MEGATRON_A100,
    kernel_efficiency,
)
from hybridtrain.hardware.peaks import known_devices


def test_every_entry_is_a_known_gpu_with_a_share_and_its_source() -> None:
    assert set(EFFICIENCIES) <= set(known_devices())
    for name, efficiency in EFFICIENCIES.items():
        assert 0 < efficiency.share <= 1, name
        assert efficiency.source.startswith(("measured", "published", "the H100 SXM's measured share")), name


def test_the_h100_figure_is_the_measured_row_and_hopper_parts_say_they_borrow_it() -> None:
    assert kernel_efficiency("H100 SXM") is H100_MEASURED
    assert "benchmarks/results/h100-2026-11-26/" in H100_MEASURED.source
    for name in ("H100 PCIe", "H100 NVL", "H200", "GH200"):
        assert kernel_efficiency(name).share == H100_MEASURED.share
        assert "not measured on this device" in kernel_efficiency(name).source


def test_a100_cpu_and_unknown_gpus() -> None:
    assert kernel_efficiency("A100 80GB") is MEGATRON_A100 and kernel_efficiency("A100 40GB") is MEGATRON_A100
    assert "Narayanan" in MEGATRON_A100.source
    assert kernel_efficiency("cpu") is CPU_EFFICIENCY and CPU_EFFICIENCY.share == 1.0
    other = kernel_efficiency("L4")
    assert other.share == MEGATRON_A100.share and other.source.startswith("no figure for this device")
