"""Device⇄host transfers: side streams, events, pinned host buffers, host-memory checks.

Every offload technique moves tensors between the compute device and host memory while
the device keeps computing. On CUDA that needs three things, all here:

- a *side stream* per direction, so a copy runs concurrently with the compute stream;
- *events* that order the streams (a copy starts after the kernel that produced its
  source; compute starts after the copy that produced its input);
- *keep-alive*: a tensor read by a copy on a side stream is marked with
  ``record_stream`` so the caching allocator does not hand its memory to another tensor
  before the copy finished, even if Python drops the last reference.

On a CPU device the same calls are no-ops or plain synchronous copies, so the offload
code paths run (and are tested for exact math) on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

import torch

log = logging.getLogger("hybridtrain")

GIB = 1024**3


class HostMemoryError(MemoryError):
    """The offloaded state does not fit in the host memory that is available."""


class SideStream:
    """A CUDA stream for copies next to the compute stream (no-op on other devices).

    Args:
        device: the compute device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def after_compute(self) -> Iterator[None]:
        """Run the enclosed copies on this stream, after all work queued so far on the
        current (compute) stream — so a copy never reads a tensor still being produced."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def after(self, event: torch.cuda.Event | None) -> Iterator[None]:
        """Run the enclosed copies on this stream after ``event`` (e.g. an earlier copy)."""
        if self.stream is None:
            yield
            return
        if event is not None:
            self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> torch.cuda.Event | None:
        """An event marking everything queued on this stream so far (None on CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s memory from reuse until this stream's queued work is done."""
        if self.stream is not None and tensor.is_cuda:
            tensor.record_stream(self.stream)


def compute_waits(event: torch.cuda.Event | None, device: torch.device) -> None:
    """Make the current (compute) stream wait for ``event`` without blocking the host."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def host_waits(event: torch.cuda.Event | None) -> None:
    """Block the calling host thread until ``event`` completed (no-op for None)."""
    if event is not None:
        event.synchronize()


def compute_event(device: torch.device) -> torch.cuda.Event | None:
    """An event marking the work queued so far on the compute stream (None on CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


_pin_warned = False


def host_empty(numel: int, dtype: torch.dtype, pin: bool, device: torch.device) -> torch.Tensor:
    """A flat host buffer, page-locked when ``pin`` and the device is CUDA.

    Page-locked memory is what makes a ``non_blocking`` copy asynchronous. When it cannot
    be had (locked-memory limits, no driver) the buffer falls back to pageable memory with
    one warning: the math is the same, the copies are slower.
    """
    global _pin_warned
    if pin and device.type == "cuda":
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:
            if not _pin_warned:
                warnings.warn(f"pinned host memory unavailable ({exc}); using pageable memory, "
                              "host⇄device copies will be slower", stacklevel=2)
                _pin_warned = True
    return torch.empty(numel, dtype=dtype)


def available_host_bytes() -> int:
    """Host memory available to new allocations (``MemAvailable``; physical pages elsewhere)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def check_host_memory(needed: int, what: str, available: int | None = None) -> None:
    """Refuse before training when ``needed`` bytes of host memory are not available.

    Raises:
        HostMemoryError: with both numbers and what needs them.
    """
    have = available_host_bytes() if available is None else available
    if needed > have:
        raise HostMemoryError(
            f"{what} needs {needed / GIB:.2f} GiB of host memory but {have / GIB:.2f} GiB is "
            "available; free host memory, use a smaller model, or turn the offload off"
        )


def note_cpu_offload(device: torch.device, technique: str) -> None:
    """Tell the user (once per call site) that offloading on a CPU device saves nothing."""
    if device.type == "cpu":
        log.info("%s on a CPU device: host and device memory are the same, so it runs with the "
                 "same math but saves no memory", technique)
