"""The device table: names match loosely, dense peaks per dtype, a measured fallback."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.hardware.peaks import (
    device_memory_bytes,
    device_peak_flops,
    find_device,
    known_devices,
    measured_matmul_flops,
    peak_flops,
)


@pytest.mark.parametrize(("name", "model"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("h100-sxm", "H100 SXM"), ("H100", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"), ("NVIDIA A100 80GB PCIe", "A100 80GB"),
    ("Tesla V100-SXM2-32GB", "V100 32GB"), ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA GH200 480GB", "GH200"),
])
def test_cuda_device_names_find_their_model(name: str, model: str) -> None:
    spec = find_device(name)
    assert spec is not None and spec.name == model
    assert model in known_devices()


def test_peaks_are_dense_and_per_dtype() -> None:
    assert device_peak_flops("H100", torch.bfloat16) == pytest.approx(989.4e12)  # 1,979 sparse / 2
    assert device_peak_flops("H100", torch.float32) == pytest.approx(67e12)
    assert device_peak_flops("H100", torch.float32, tf32=True) == pytest.approx(494.7e12)
    assert device_peak_flops("A100", torch.float16) == pytest.approx(312e12)
    assert device_peak_flops("V100", torch.bfloat16) is None  # no bf16 unit
    assert device_peak_flops("TPU v9", torch.bfloat16) is None
    assert device_memory_bytes("H100") == 80 * 2**30
    assert device_memory_bytes("A100-40GB") == 40 * 2**30
    assert device_memory_bytes("no such gpu") is None


def test_cpu_peak_is_a_measured_matmul() -> None:
    rate = measured_matmul_flops(torch.device("cpu"))
    assert 1e8 < rate < 1e14
    assert measured_matmul_flops(torch.device("cpu")) == rate  # measured once per process
    assert peak_flops(torch.device("cpu"), torch.float32) == (rate, "measured matmul")
