"""Devices, memory readings and RNG state (the "resource abstraction" of our design)."""

from __future__ import annotations

import random
import resource
import sys
from typing import Any

import torch


def normalize_device(device: str | torch.device) -> torch.device:
    """The one spelling of a device that tensors report as their ``.device``.

    ``torch.device("cuda") != torch.device("cuda:0")`` and ``torch.device("cpu:0") !=
    torch.device("cpu")``, while a tensor on them reports ``cuda:0`` and ``cpu``: code that
    compares a tensor's device with a configured one must compare normalized devices, or an
    offload that moves tensors "not yet on the device" moves nothing (or everything). So a
    device is normalized once, where it is resolved: CUDA (and other accelerators) get
    their current index, CPU (and meta) lose theirs.
    """
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return torch.device(device.type)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` → the current CUDA device when present, else CPU; otherwise ``spec``, both
    normalized (:func:`normalize_device`).

    Raises:
        ValueError: a CUDA device was asked for on a machine without one.
    """
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"device = {spec!r} is not a device; allowed: auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device = {spec!r} but CUDA is not available on this machine; use auto or cpu")
    return normalize_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so host timers measure device work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window on CUDA (host peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of the training device: allocated CUDA memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_reserved_bytes(device: torch.device) -> int | None:
    """Peak memory the CUDA caching allocator reserved (what the device's memory limit and
    an OOM count), or None on other devices."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None


def get_rng_state() -> dict[str, Any]:
    """Every RNG that training consumes (Python, torch CPU, all CUDA devices)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
