"""Readings a step record needs beyond the loss: device memory, FLOPs and the device's peak.

Nothing here synchronises the device: CUDA memory figures are the caching allocator's
host-side counters (one ``torch.cuda.memory_stats`` call per step), and peak RSS on CPU is
one ``getrusage``.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
from torch import nn

from hybridtrain.hardware.peaks import device_peak_flops


def device_peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """Peak dense bf16 TFLOP/s of one ``device``: ``override`` when given, else from the GPU
    table of :mod:`hybridtrain.hardware.peaks`; ``None`` when unknown (CPU, unlisted GPUs).
    MFU is measured against the bf16 peak whatever the run's precision, as torchtitan and
    PaLM do."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    peak = device_peak_flops(torch.cuda.get_device_name(device), torch.bfloat16)
    return None if peak is None else peak / 1e12


def flops_per_token(model: nn.Module) -> float:
    """Training FLOPs per token: 6 × parameters (2 for the forward matmuls, 4 for backward).

    The usual approximation for decoder transformers (Kaplan et al.); it leaves out the
    attention score FLOPs (12 × layers × width × sequence), a few percent at short sequences.
    Tied weights count once.
    """
    return 6.0 * sum(p.numel() for p in model.parameters())


def memory_readings(device: torch.device) -> dict[str, int]:
    """This process's memory figures, as step-record fields.

    CUDA: ``memory_allocated_bytes``, ``memory_reserved_bytes``, ``peak_memory_bytes``
    (peak allocated since the last reset), ``peak_memory_reserved_bytes``, ``alloc_retries``, ``ooms`` and
    ``pinned_host_bytes`` (torch's caching pinned allocator). CPU: ``peak_memory_bytes``
    (peak resident set size), the figure ``metrics.jsonl`` always had.
    """
    if device.type != "cuda":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"peak_memory_bytes": int(peak if sys.platform == "darwin" else peak * 1024)}
    stats = torch.cuda.memory_stats(device)
    out = {
        "memory_allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
        "memory_reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
        "peak_memory_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
        # What set_per_process_memory_fraction caps and an OOM is measured against.
        "peak_memory_reserved_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "ooms": int(stats.get("num_ooms", 0)),
    }
    pinned = _pinned_host_bytes()
    if pinned is not None:
        out["pinned_host_bytes"] = pinned
    return out


def _pinned_host_bytes() -> int | None:
    try:
        host: dict[str, Any] = torch.cuda.host_memory_stats()
    except (RuntimeError, AttributeError):
        return None
    value = host.get("allocated_bytes.current", host.get("allocated_bytes.all.current"))
    return int(value) if value is not None else None
