"""Live tensor bytes on one device, counted per storage, with an optional hard limit.

CUDA has an allocator that reports its peak and can be capped; the CPU has neither. This
module counts what a training step really holds on any device, CPU included, so memory
plans and out-of-memory recovery can be tested on a machine without a GPU:

* a *storage* is one allocation; every view of it (``x.t()``, ``x[1:]``, a parameter's
  ``.data``) shares it, so storages are counted, never tensors, and each one once;
* storages alive when counting starts (parameters, gradients, optimizer state, a batch)
  are found once with ``gc.get_objects()`` and count from the start;
* storages created inside are seen as the outputs of every aten op, forward and backward
  (autograd runs backward ops with the caller's dispatch modes), through a
  ``TorchDispatchMode`` - the documented way to see every op (torch's
  ``FlopCounterMode`` and FSDP's memory tracker use the same one);
* a storage's death is seen with a ``weakref.finalize`` on its Python object, which torch
  keeps alive exactly as long as the storage itself;
* dispatch modes are per thread: a worker thread doing the entering thread's work (the
  layer-major runner's micro-batch forwards) joins the count with
  :func:`~hybridtrain.runtime.thread_counters.counting_with`
  (:func:`~hybridtrain.runtime.thread_counters.counters_here` read in the entering thread);
* a storage resized in place through ``UntypedStorage.resize_`` (not an aten op: layer
  streaming frees and refills its blocks' device buffers so) is reported by the code that
  resizes it with :func:`storage_resized`, which counts, and limits, like an op's output.

What is not seen: tensors made in other threads that did not join, other in-place storage
resizes (the new size is read when the storage next comes out of an op), sparse tensors, and
saved tensors of a graph that was built before counting started and whose tensors have no
Python object.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch

from hybridtrain.compat import TorchDispatchMode, is_traceable_wrapper_subclass
from hybridtrain.runtime.device import normalize_device
from hybridtrain.runtime.thread_counters import counters_here, register, unregister
from hybridtrain.units import format_bytes


class DeviceMemoryLimitError(torch.OutOfMemoryError):
    """An allocation that would take live tensor bytes past :class:`LiveTensorBytes`'s limit.

    A ``torch.OutOfMemoryError``, so code that handles CUDA's handles this one. Carries the
    numbers: ``needed_bytes`` (live bytes the allocation would have made) and ``limit_bytes``.
    """

    def __init__(self, message: str, needed_bytes: int, limit_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.limit_bytes = limit_bytes


class _OpOutputs(TorchDispatchMode):
    """Hands every aten op's output tensors to a callback, after the op ran."""

    def __init__(self, observe: Any) -> None:
        super().__init__()
        self._observe = observe

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._observe(out, func)
        return out


class LiveTensorBytes:
    """Context manager: live tensor bytes on ``device`` (CPU too), counted per distinct storage.

    Storages already alive at ``__enter__`` (parameters, gradients, optimizer state ...)
    count too. Counting covers the thread that entered (and autograd's backward, which runs
    with its modes) and the threads that join it (:mod:`hybridtrain.runtime.thread_counters`);
    it is thread-safe.
    Values stay readable after exit.

    >>> with LiveTensorBytes("cpu", limit_bytes=parse_bytes("2GiB")) as live:
    ...     engine.train_batch(batch)
    >>> live.peak_bytes

    Args:
        device: the device whose storages count (``"cuda"`` means the current CUDA device).
        limit_bytes: when set, an op whose new or grown storages would take the live bytes
            past it raises :class:`DeviceMemoryLimitError` (a ``torch.OutOfMemoryError``)
            naming the bytes needed and the limit; its outputs are released as the error
            unwinds, and the count is left as before the op.
        record_timeline: append ``(seconds since enter, live bytes)`` at every change.
        ignore: tensors whose storages never count (a data set or a snapshot that would be
            host memory on a GPU).
        held: the tensors already alive that count at enter (say, an engine's parameters,
            gradients and optimizer state); None: every tensor alive on ``device``, which in a
            larger program also counts tensors the work under the limit never touches.

    Attributes:
        current_bytes: live now.
        peak_bytes: the most live at once since enter or :meth:`reset_peak`.
        timeline: the recorded changes (empty unless ``record_timeline``).
        refused_bytes: the live bytes the last refused allocation would have made, or None.
        counting: set it False around host-side work (saving a checkpoint): storages made
            meanwhile are not counted (nor limited); those freed still are.
    """

    def __init__(self, device: str | torch.device = "cpu", limit_bytes: int | None = None,
                 record_timeline: bool = False, *, ignore: Iterable[torch.Tensor] = (),
                 held: Callable[[], Iterable[torch.Tensor]] | None = None) -> None:
        device = normalize_device(device)
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"limit_bytes = {limit_bytes} is negative; use a byte count >= 0 or None")
        self.device = device
        self.limit_bytes = limit_bytes
        self.record_timeline = record_timeline
        self.current_bytes = 0
        self.peak_bytes = 0
        self.timeline: list[tuple[float, int]] = []
        self.refused_bytes: int | None = None
        self.counting = True
        # Storages never counted, held weakly: a finalizer drops each id as its storage dies.
        self._ignored: dict[int, weakref.finalize[Any, Any]] = {}
        for tensor in ignore:
            storage = tensor.untyped_storage()
            if id(storage) not in self._ignored:
                self._ignored[id(storage)] = weakref.finalize(storage, self._ignored.pop, id(storage), None)
        # id(storage) -> (bytes counted, its finalizer). A storage's Python object lives as
        # long as the storage, and the finalizer drops the entry before the id can be reused.
        self._storages: dict[int, tuple[int, weakref.finalize[Any, Any]]] = {}
        self._mode = _OpOutputs(self._observe)
        self._start = 0.0
        self._held = held
        # Joined threads observe concurrently with finalizers, which run in whichever thread
        # drops a storage (re-entrantly, when an allocation inside _observe collects garbage).
        self._lock = threading.RLock()

    def __enter__(self) -> LiveTensorBytes:
        self._start = time.perf_counter()
        self.current_bytes = self.peak_bytes = 0
        self.timeline.clear()
        for tensor in tensors_alive() if self._held is None else self._held():
            storage = self._storage_of(tensor)
            if storage is not None and id(storage) not in self._storages and self._counts(storage):
                self._track(storage, storage.nbytes())
        self._changed()
        self._mode.__enter__()
        register(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        unregister(self)
        self._mode.__exit__(kind, value, traceback)
        for _, finalizer in [*self._storages.values(), *((0, f) for f in self._ignored.values())]:
            finalizer.detach()
        self._storages.clear()
        self._ignored.clear()

    def joined(self) -> _OpOutputs:
        """This count in a worker thread (:func:`~hybridtrain.runtime.thread_counters.counting_with`):
        a dispatch mode of that thread's own (a mode object keeps per-entry state, so one is
        never entered by two threads)."""
        return _OpOutputs(self._observe)

    def reset_peak(self) -> None:
        """Start a new peak window at the bytes live now."""
        self.peak_bytes = self.current_bytes

    def _storage_of(self, tensor: torch.Tensor) -> torch.UntypedStorage | None:
        if is_traceable_wrapper_subclass(tensor):
            # A DTensor (or another wrapper) owns no memory: its inner tensors do, and this
            # mode sees them as the subclass's own ops run; its nominal storage has the full,
            # unsharded size, and would count a shard as the whole tensor.
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, some wrapper subclasses
            return None
        return storage if storage.device == self.device else None

    def _counts(self, storage: torch.UntypedStorage) -> bool:
        return id(storage) not in self._ignored

    def _observe(self, out: Any, func: Any) -> None:
        if not self.counting:
            return
        with self._lock:
            self._observe_locked(out, func)

    def _observe_locked(self, out: Any, func: Any) -> None:
        grown: list[tuple[torch.UntypedStorage, int]] = []
        for leaf in _tensors_in(out):
            storage = self._storage_of(leaf)
            if storage is None or not self._counts(storage):
                continue
            size = storage.nbytes()
            known = self._storages.get(id(storage))
            # an op may return one storage twice (split, unbind)
            if (known is None or known[0] != size) and all(s is not storage for s, _ in grown):
                grown.append((storage, size))
        if not grown:
            return
        delta = sum(size - self._counted(storage) for storage, size in grown)
        if self.limit_bytes is not None and delta > 0 and self.current_bytes + delta > self.limit_bytes:
            needed = self.current_bytes + delta
            self.refused_bytes = needed
            raise DeviceMemoryLimitError(
                f"{func} on {self.device} needs {format_bytes(delta)} more with "
                f"{format_bytes(self.current_bytes)} live, {needed} bytes against the limit of "
                f"{self.limit_bytes} bytes ({format_bytes(self.limit_bytes)})", needed, self.limit_bytes)
        for storage, size in grown:
            known = self._storages.get(id(storage))
            if known is None:
                self._track(storage, size)
            else:  # resized in place (resize_, set_, an out= op): keep its finalizer
                self._storages[id(storage)] = (size, known[1])
                self.current_bytes += size - known[0]
        self._changed()

    def _counted(self, storage: torch.UntypedStorage) -> int:
        known = self._storages.get(id(storage))
        return 0 if known is None else known[0]

    def _track(self, storage: torch.UntypedStorage, size: int) -> None:
        key = id(storage)
        self._storages[key] = (size, weakref.finalize(storage, self._freed, key))
        self.current_bytes += size

    def _freed(self, key: int) -> None:
        with self._lock:
            size, _ = self._storages.pop(key)
            self.current_bytes -= size
            if self.record_timeline:
                self.timeline.append((time.perf_counter() - self._start, self.current_bytes))

    def _changed(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if self.record_timeline:
            self.timeline.append((time.perf_counter() - self._start, self.current_bytes))


def storage_resized(tensor: torch.Tensor, what: str) -> None:
    """Tell the counters of the calling thread that ``tensor``'s storage was just resized in
    place (``UntypedStorage.resize_``, which no dispatch mode sees): they count its new size
    as if an op had returned it, limit included.

    Args:
        tensor: a tensor viewing the resized storage.
        what: the allocation's name in a refusal (``"the upload of streamed block 3"``).

    Raises:
        DeviceMemoryLimitError: the storage grew past a counter's limit; that counter's
            count stays as before, and the caller should shrink the storage back.
    """
    for counter in counters_here():
        if isinstance(counter, LiveTensorBytes):
            counter._observe(tensor, what)


def _tensors_in(out: Any) -> list[torch.Tensor]:
    """The tensors an aten op returned: one, or a tuple/list of them (and of other values)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple | list):
        return [t for item in out for t in _tensors_in(item)]
    return []


def tensors_alive() -> list[torch.Tensor]:
    """Every tensor with a Python object, and the gradients of leaves.

    A leaf's ``.grad`` may be held by autograd alone, with no Python object for
    ``gc.get_objects()`` to find, so it is asked for.
    """
    tensors: list[torch.Tensor] = []
    for obj in gc.get_objects():
        # type() rather than isinstance(): the latter triggers lazy attribute lookups on modules
        if not issubclass(type(obj), torch.Tensor):
            continue
        tensors.append(obj)
        if obj.is_leaf and obj.requires_grad and obj.grad is not None:
            tensors.append(obj.grad)
    return tensors


def cap_cuda_memory(limit_bytes: int, device: torch.device) -> None:
    """Cap this process's share of a CUDA device at ``limit_bytes`` (the caching allocator
    then raises ``torch.OutOfMemoryError`` past it, as if the device were that small).

    Raises:
        ValueError: one line when the limit is more than the device has.
    """
    total = torch.cuda.get_device_properties(device).total_memory
    if limit_bytes > total:
        raise ValueError(f"device_memory_limit = {limit_bytes} bytes ({format_bytes(limit_bytes)}) is more than "
                         f"{device} has ({total} bytes, {format_bytes(total)}); lower it or leave it out")
    torch.cuda.set_per_process_memory_fraction(limit_bytes / total, device)
