"""How much of a GPU's dense peak a transformer training step's kernels reach, per device,
each figure with its source.

The planner's compute time is the step's traced FLOPs ÷ (dense table peak × this share)
plus a launch cost per kernel (:mod:`hybridtrain.planner.timing`). The share covers the
whole step's kernels — matmuls, attention, norms, elementwise — at the sizes the planner
models (reference GPTs, 1.3B-13B, micro-batches of a few thousand tokens), not one large
GEMM's. Where the project measured a device its row is the source; otherwise a published
figure for a model of that size; a CPU has no table peak and is planned at its measured
matmul rate (:func:`hybridtrain.hardware.peaks.measured_matmul_flops`), so its share is 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelEfficiency:
    """Share of the dense peak a training step's kernels reach on one device.

    Attributes:
        share: achieved FLOP/s ÷ the dense table peak of the compute dtype.
        source: where the share comes from (a measured row, a paper's table).
    """

    share: float
    source: str


H100_MEASURED = KernelEfficiency(
    0.474,
    "measured: GPT-1.3B plain, bf16, 16,384 tokens per step, 0.310 s on one H100 80GB HBM3 "
    "(benchmarks/results/h100-2026-11-26/call1_gpu_check_e79b57d.jsonl): traced FLOPs ÷ (step − device AdamW − "
    "kernel launches) ÷ 989.4 TFLOP/s")
"""The H100 SXM's share, from the project's own row (``tests/planner/test_measured_rows.py``
derives it again from the raw row)."""

MEGATRON_A100 = KernelEfficiency(
    0.44,
    "published: Megatron-LM on A100, GPT 1.7B, 137 TFLOP/s per GPU = 44 % of 312 (Narayanan et al., "
    "'Efficient Large-Scale Language Model Training on GPU Clusters', SC21, Table 1)")
"""A100's share at the planner's sizes, from the Megatron-LM paper (the 1.7B row; 44-46 % for 1.7-7.5B)."""

_HOPPER_LIKE_H100 = ("the H100 SXM's measured share (the same Hopper SMs; the table peak already carries this "
                     "part's clocks and SM count); not measured on this device")

EFFICIENCIES: dict[str, KernelEfficiency] = {
    "H100 SXM": H100_MEASURED,
    "GH200": KernelEfficiency(H100_MEASURED.share, _HOPPER_LIKE_H100),
    "H200": KernelEfficiency(H100_MEASURED.share, _HOPPER_LIKE_H100),
    "H200 NVL": KernelEfficiency(H100_MEASURED.share, _HOPPER_LIKE_H100),
    "H100 PCIe": KernelEfficiency(H100_MEASURED.share, _HOPPER_LIKE_H100),
    "H100 NVL": KernelEfficiency(H100_MEASURED.share, _HOPPER_LIKE_H100),
    "A100 80GB": MEGATRON_A100,
    "A100 40GB": MEGATRON_A100,
}
"""Per GPU model (the canonical names of :mod:`hybridtrain.hardware.peaks`)."""

CPU_EFFICIENCY = KernelEfficiency(
    1.0, "measured here: a CPU is planned at this machine's measured matmul rate (hardware.peaks), not a table peak")

_OTHER_GPU = KernelEfficiency(
    MEGATRON_A100.share, f"no figure for this device; {MEGATRON_A100.source.removeprefix('published: ')}")


def kernel_efficiency(device_name: str) -> KernelEfficiency:
    """The share of ``device_name``'s dense peak the planner assumes, with its source.

    Args:
        device_name: ``cpu`` or a canonical GPU name (``H100 SXM``, ``A100 80GB`` …).

    Returns:
        The table entry; for ``cpu`` a share of 1 of the measured matmul rate; for a GPU
        without an entry the A100's published share, saying so.
    """
    if device_name == "cpu":
        return CPU_EFFICIENCY
    return EFFICIENCIES.get(device_name, _OTHER_GPU)
