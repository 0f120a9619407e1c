"""What a device can do at best: dense peak FLOP/s and memory per GPU model, and a measured
matmul rate where no table applies (CPU, unknown GPUs).

Peaks are the vendor's *dense* tensor-core figures (datasheets quote "with sparsity", twice
the dense value; we halve those). ``float32`` means IEEE fp32 on the CUDA cores, torch's
default (``torch.backends.cuda.matmul.allow_tf32`` is off); ask with ``tf32=True`` for
the TF32 tensor-core rate. Names match loosely: ``"H100"``, ``"h100-sxm"``,
``"NVIDIA H100 80GB HBM3"`` (what ``torch.cuda.get_device_name`` says) are the same device.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSpec:
    """One GPU model's dense peaks (TFLOP/s) and nominal memory.

    Attributes:
        name: the canonical name (what :func:`known_devices` lists).
        tokens: every one must appear in a device name for it to be this model.
        bf16 / fp16 / tf32 / fp32: dense peak TFLOP/s; ``None`` where the device has no
            such unit (bf16 on V100/T4).
        memory_gib: the nominal memory per GPU ("80 GB" is 80 GiB of HBM; the driver
            reserves 1-2 % of it, so ``total_memory`` reads a little less).
    """

    name: str
    tokens: frozenset[str]
    bf16: float | None
    fp16: float
    tf32: float | None
    fp32: float
    memory_gib: float


def _spec(name: str, tokens: str, bf16: float | None, fp16: float, tf32: float | None, fp32: float,
          memory_gib: float) -> DeviceSpec:
    return DeviceSpec(name, frozenset(tokens.split()), bf16, fp16, tf32, fp32, memory_gib)


# First match wins, so the more specific entries (more tokens) of a family come first.
DEVICES: tuple[DeviceSpec, ...] = (
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): SXM BF16/FP16 1,979 TFLOPS
    # and TF32 989 with sparsity, FP32 67; PCIe 1,513 / 756 / 51; NVL 1,671 / 835 / 60, 94 GB.
    _spec("H100 NVL", "h100 nvl", 835.5, 835.5, 417.5, 60.0, 94),
    _spec("H100 PCIe", "h100 pcie", 756.5, 756.5, 378.0, 51.2, 80),
    # GH200 datasheet: the Hopper GPU of the superchip has H100 SXM's compute, 96 GB HBM3.
    _spec("GH200", "gh200", 989.4, 989.4, 494.7, 67.0, 96),
    _spec("H100 SXM", "h100", 989.4, 989.4, 494.7, 67.0, 80),
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): SXM same compute as H100 SXM,
    # 141 GB; NVL 1,671 / 835 sparse BF16 / TF32, FP32 60.
    _spec("H200 NVL", "h200 nvl", 835.5, 835.5, 417.5, 60.0, 141),
    _spec("H200", "h200", 989.4, 989.4, 494.7, 67.0, 141),
    # NVIDIA HGX B200 datasheet, 8 GPUs: FP16/BF16 36 PFLOPS and TF32 18 PFLOPS with
    # sparsity, FP32 600 TFLOPS, 1.4 TB → per GPU 2,250 / 1,125 dense, 75, 180 GB.
    _spec("B200", "b200", 2250.0, 2250.0, 1125.0, 75.0, 180),
    # NVIDIA A100 datasheet: BF16/FP16 312, TF32 156 (dense), FP32 19.5; 40 or 80 GB (SXM/PCIe alike).
    _spec("A100 40GB", "a100 40gb", 312.0, 312.0, 156.0, 19.5, 40),
    _spec("A100 80GB", "a100", 312.0, 312.0, 156.0, 19.5, 80),
    # NVIDIA L40S datasheet: BF16 733 / TF32 366 with sparsity, FP32 91.6, 48 GB.
    _spec("L40S", "l40s", 362.05, 362.05, 183.0, 91.6, 48),
    # NVIDIA L40 datasheet: BF16 362 / TF32 181 with sparsity, FP32 90.5, 48 GB.
    _spec("L40", "l40", 181.0, 181.0, 90.5, 90.5, 48),
    # NVIDIA L4 datasheet: BF16 242 / TF32 120 with sparsity, FP32 30.3, 24 GB.
    _spec("L4", "l4", 121.0, 121.0, 60.0, 30.3, 24),
    # NVIDIA A10 datasheet: BF16 250 / TF32 125 with sparsity, FP32 31.2, 24 GB. (AWS's A10G
    # is a different part without a public datasheet: left out, so it is measured.)
    _spec("A10", "a10", 125.0, 125.0, 62.5, 31.2, 24),
    # NVIDIA V100 datasheet: tensor (FP16) 125 SXM2 / 112 PCIe, FP32 15.7 / 14; no BF16 or TF32 units.
    _spec("V100 PCIe 32GB", "v100 pcie 32gb", None, 112.0, None, 14.0, 32),
    _spec("V100 PCIe", "v100 pcie", None, 112.0, None, 14.0, 16),
    _spec("V100 32GB", "v100 32gb", None, 125.0, None, 15.7, 32),
    _spec("V100", "v100", None, 125.0, None, 15.7, 16),
    # NVIDIA T4 datasheet: FP16 65, FP32 8.1, 16 GB; no BF16.
    _spec("T4", "t4", None, 65.0, None, 8.1, 16),
    # RTX A6000 datasheet: tensor 309.7 sparse → 154.8 dense, FP32 38.7, 48 GB.
    _spec("RTX A6000", "a6000", 154.8, 154.8, 77.4, 38.7, 48),
    # Ada Lovelace whitepaper (RTX 4090): FP16/BF16 with FP32 accumulate 165.2 dense,
    # TF32 82.6, FP32 82.6, 24 GB.
    _spec("RTX 4090", "4090", 165.2, 165.2, 82.6, 82.6, 24),
    # Ampere GA102 whitepaper (RTX 3090): FP16/BF16 with FP32 accumulate 71, TF32 35.6, FP32 35.6, 24 GB.
    _spec("RTX 3090", "3090", 71.0, 71.0, 35.6, 35.6, 24),
)
"""The GPU models we know, with each number's source in a comment above its entry."""

_NOISE = {"nvidia", "tesla", "geforce", "sxm", "sxm2", "sxm4", "sxm5", "hbm3", "hbm3e"}


def _tokens(device_name: str) -> set[str]:
    return {t for t in re.split(r"[^a-z0-9]+", device_name.lower()) if t and t not in _NOISE}


def find_device(device_name: str) -> DeviceSpec | None:
    """The table entry for ``device_name`` (a short name or a CUDA device name), or None."""
    tokens = _tokens(device_name)
    return next((spec for spec in DEVICES if spec.tokens <= tokens), None)


def known_devices() -> list[str]:
    """The canonical names of every GPU model in the table (for one-line errors)."""
    return [spec.name for spec in DEVICES]


def device_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of one GPU of model ``device_name`` computing in ``dtype``.

    Args:
        device_name: e.g. ``"H100"``, ``"A100-80GB"``, ``torch.cuda.get_device_name()``.
        dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
        tf32: float32 matmuls run on TF32 tensor cores (``allow_tf32``).

    Returns:
        FLOP/s, or None when the device or its unit for ``dtype`` is unknown.
    """
    spec = find_device(device_name)
    if spec is None:
        return None
    tflops: float | None
    if dtype == torch.bfloat16:
        tflops = spec.bf16
    elif dtype == torch.float16:
        tflops = spec.fp16
    elif dtype == torch.float32:
        tflops = spec.tf32 if tf32 else spec.fp32
    else:
        tflops = None
    return None if tflops is None else tflops * 1e12


def device_memory_bytes(device_name: str) -> int | None:
    """Memory of one GPU of model ``device_name`` in bytes (None when unknown)."""
    spec = find_device(device_name)
    return None if spec is None else int(spec.memory_gib * 2**30)


_MEASURED: dict[tuple[str, torch.dtype], float] = {}


def measured_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """Achieved FLOP/s of a large square matmul on ``device`` (best of a few runs).

    The peak we compare against where no table entry applies (CPU, unknown GPUs). Measured
    once per process and device/dtype (a fraction of a second on CPU).
    """
    key = (str(device), dtype)
    if key in _MEASURED:
        return _MEASURED[key]
    # Big enough to leave the caches and amortise the call, small enough for a loaded CPU.
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - start) / 4)
    _MEASURED[key] = 2.0 * n**3 / best
    return _MEASURED[key]


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The peak to measure utilisation against on ``device``, and where it came from.

    A CUDA device in the table: its dense peak (TF32 when torch allows it for float32).
    Otherwise: :func:`measured_matmul_flops`.

    Returns:
        ``(flop_per_second, source)`` with source ``"table: NAME"`` or ``"measured matmul"``.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        peak = device_peak_flops(name, dtype, tf32=tf32)
        spec = find_device(name)
        if peak is not None and spec is not None:
            return peak, f"table: {spec.name}"
    return measured_matmul_flops(device, dtype), "measured matmul"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
