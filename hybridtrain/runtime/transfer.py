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
import ctypes
import logging
import mmap
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Iterator

import torch

from hybridtrain.runtime import stream_marks

log = logging.getLogger("hybridtrain")

GIB = 1024**3


TRANSFER_KINDS = ("activations_out", "activations_in", "weights_up", "gradients_down", "device_map")
"""The kinds of host⇄device traffic every step report lists (zero when nothing of that kind
moved): saved activations swapped to the host and back, weights uploaded (streamed blocks,
weights the host optimizer updated), gradients copied to the host optimizer, and tensors
crossing between the host and a device under ``device_map``."""

_counts: dict[str, int] = {}
_counts_lock = threading.Lock()  # the host optimizer's worker thread counts too


def count_bytes(kind: str, nbytes: int) -> None:
    """Record ``nbytes`` copied between the device and host memory, by ``kind``. Called by the
    code that issues the copy (at issue time: on CUDA the copy may still be running)."""
    with _counts_lock:
        _counts[kind] = _counts.get(kind, 0) + nbytes


def take_counts() -> dict[str, int]:
    """The bytes counted since the last call, every kind of :data:`TRANSFER_KINDS` included,
    and start counting anew (the engine calls it around each step)."""
    with _counts_lock:
        out = {kind: 0 for kind in TRANSFER_KINDS}
        out.update(_counts)
        _counts.clear()
    return out


class HostMemoryError(MemoryError):
    """The offloaded state does not fit in the host memory that is available."""


class SideStream:
    """A CUDA stream for copies next to the compute stream (no-op on other devices).

    Args:
        device: the compute device.
        direction: ``uploads`` or ``downloads``: the part of a measured step timeline its
            copies count in (:mod:`hybridtrain.runtime.stream_marks`); None: not marked.
    """

    def __init__(self, device: torch.device, direction: str | None = None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.direction = direction

    def _marked(self) -> contextlib.AbstractContextManager[None]:
        return stream_marks.mark(self.direction, self.stream) if self.direction else contextlib.nullcontext()

    @contextlib.contextmanager
    def after_compute(self) -> Iterator[None]:
        """Run the enclosed copies on this stream, after all work queued so far on the
        current (compute) stream — so a copy never reads a tensor still being produced."""
        if self.stream is None:
            with self._marked():
                yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), self._marked():
            yield

    @contextlib.contextmanager
    def after(self, event: torch.cuda.Event | None) -> Iterator[None]:
        """Run the enclosed copies on this stream after ``event`` (e.g. an earlier copy)."""
        if self.stream is None:
            with self._marked():
                yield
            return
        if event is not None:
            self.stream.wait_event(event)
        with torch.cuda.stream(self.stream), self._marked():
            yield

    def record(self) -> torch.cuda.Event | None:
        """An event marking everything queued on this stream so far (None on CPU).

        A blocking-sync event: a host thread waiting for it (the host optimizer's worker,
        the swapper's copies-in-flight bound) sleeps instead of spinning a core that the
        host Adam step needs; streams waiting for it are unaffected."""
        if self.stream is None:
            return None
        event = torch.cuda.Event(blocking=True)
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


def _warn_pageable(exc: BaseException) -> None:
    global _pin_warned
    if not _pin_warned:
        warnings.warn(f"pinned host memory unavailable ({exc}); using pageable memory, "
                      "host⇄device copies will be slower", stacklevel=3)
        _pin_warned = True


def host_empty(numel: int, dtype: torch.dtype, pin: bool, device: torch.device) -> torch.Tensor:
    """A short-lived flat host buffer, page-locked when ``pin`` and the device is CUDA.

    Page-locked memory is what makes a ``non_blocking`` copy asynchronous. These come from
    torch's caching pinned allocator (cheap to get again, but sizes round up to a power of
    two), which suits buffers that are allocated every step. When pinned memory cannot be
    had (locked-memory limits, no driver) the buffer is pageable, with one warning: the math
    is the same, the copies are slower.
    """
    if pin and device.type == "cuda":
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:
            _warn_pageable(exc)
    return torch.empty(numel, dtype=dtype)


_PORTABLE = 1
"""``cudaHostRegisterPortable``: page-locked for every CUDA context of the process (as torch's own pinning)."""


def _unregister(ptr: int) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit CUDA may already be gone
        torch.cuda.cudart().cudaHostUnregister(ptr)


_REGISTER_MIN_BYTES = 1 << 20
"""Smaller lasting buffers come from the caching allocator: page-locking in place costs a
driver call per buffer, and their rounding wastes little."""


def host_buffer(numel: int, dtype: torch.dtype, pin: bool, device: torch.device) -> torch.Tensor:
    """A long-lived flat host buffer (master weights, gradients): page-locked at its exact size.

    The caching pinned allocator rounds every allocation up to a power of two — up to twice
    the host memory for the offloaded state, which is what limits the model size. So large
    lasting buffers are ordinary allocations page-locked in place with ``cudaHostRegister``
    (and unregistered when their storage dies). The locked range is whole pages inside this
    allocation, so no other buffer shares a locked page (locking a page twice fails). If
    locking fails anyway, :func:`host_empty` decides.
    """
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not (pin and device.type == "cuda") or nbytes < _REGISTER_MIN_BYTES:
        return host_empty(numel, dtype, pin, device)
    page = mmap.PAGESIZE
    raw = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
    offset = -raw.data_ptr() % page
    start, length = raw.data_ptr() + offset, -(-nbytes // page) * page
    try:
        status = int(torch.cuda.cudart().cudaHostRegister(start, length, _PORTABLE))
    except (RuntimeError, AttributeError) as exc:
        status, reason = -1, str(exc)
    else:
        reason = f"cudaError {status}"
    if status != 0:
        _clear_cuda_error()
        log.debug("page-locking %d bytes in place failed (%s); using the caching pinned allocator", length, reason)
        return host_empty(numel, dtype, pin, device)
    weakref.finalize(raw.untyped_storage(), _unregister, start)
    return raw[offset:offset + nbytes].view(dtype)


def _clear_cuda_error() -> None:
    # A failed runtime call stays the thread's "last error", which the next kernel launch
    # check would report as its own failure; reading it resets it. Best effort: the CUDA
    # runtime torch loaded is found by its soname.
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


class HostBufferPool:
    """A few reusable host buffers for data that only passes through the host on its way
    somewhere else (a gradient copied down and then summed or stepped with at once).

    One pool instead of one buffer per bucket keeps that traffic's host memory at
    ``count`` buffers, independent of the model size. :meth:`acquire` blocks while every
    buffer is in use: the producer (backward) then waits for the consumer (the host step),
    which bounds the memory without changing any result.

    Args:
        numel: elements of the largest request.
        dtype: element type.
        pin: page-locked buffers (on CUDA).
        device: the compute device.
        count: buffers at most.
    """

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool, device: torch.device, count: int = 3) -> None:
        self.numel = numel
        self._make = lambda: host_buffer(numel, dtype, pin, device)
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        # Each pool buffer by its storage's address: what acquire hands out shares it, also
        # when empty or reinterpreted by the caller (``.view(dtype)``).
        self._owned: dict[int, torch.Tensor] = {}
        self._left = count
        self._lock = threading.Lock()
        self.allocated = 0

    def acquire(self, numel: int) -> torch.Tensor:
        """A buffer of at least ``numel`` elements (its first ``numel``), to :meth:`release` later."""
        if numel > self.numel:
            raise ValueError(f"pool buffers hold {self.numel} elements, {numel} were asked for")
        with self._lock:
            grow = self._free.empty() and self._left > 0
            if grow:
                self._left -= 1
                self.allocated += 1
        if grow:
            made = self._make()
            self._owned[made.untyped_storage().data_ptr()] = made
            self._free.put(made)
        return self._free.get()[:numel]

    def release(self, buffer: torch.Tensor) -> None:
        """Give back what :meth:`acquire` returned, or a view of it from its first element
        (once its contents have been used)."""
        self._free.put(self._owned[buffer.untyped_storage().data_ptr()])


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
