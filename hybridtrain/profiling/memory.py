"""Activation memory as autograd sees it: the bytes of every tensor saved for backward.

This is the memory that activation checkpointing and swapping change, and it can be
counted on any device (CPU included), unlike allocator peaks.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from types import TracebackType

import torch

from hybridtrain.parallel.gradient_sync import local
from hybridtrain.runtime.thread_counters import register, unregister


class SavedTensorMeter:
    """Context manager counting bytes that autograd saves for backward inside it, in the
    entering thread and in worker threads that join it
    (:mod:`hybridtrain.runtime.thread_counters`: saved-tensor hooks are per thread).

    >>> with SavedTensorMeter() as meter:
    ...     loss = model(x).sum()
    >>> meter.bytes

    Args:
        owners: when given, called at every save; the bytes also count for each name it
            returns (``by_owner``), each storage once per owner (the profiler passes the
            modules running at that moment).
        skip_storages: ``data_ptr`` of storages that never count (parameters: a matmul
            saves its weight, which is not an activation).

    Attributes:
        bytes / tensors: everything saved (``bytes`` once per tensor, as autograd keeps it).
        by_owner: bytes per owner name, each storage once per owner.
    """

    def __init__(self, owners: Callable[[], Iterable[str]] | None = None,
                 skip_storages: frozenset[int] = frozenset()) -> None:
        self.bytes = 0
        self.tensors = 0
        self.by_owner: dict[str, int] = defaultdict(int)
        self._owners = owners
        self._skip = skip_storages
        # (owner, storage, thread): a joined worker thread runs one micro-batch (layer-major),
        # so a storage counts once per owner in each, as in each micro-batch's window.
        self._seen: set[tuple[str, int, int]] = set()
        self._hooks = self.joined()
        self._lock = threading.Lock()

    def joined(self) -> torch.autograd.graph.saved_tensors_hooks:
        """This meter's hooks for one thread (entered by the meter itself, and by each
        worker thread that joins it)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage, whole = _storage(tensor)
        if storage in self._skip:
            return tensor
        with self._lock:
            self._count(tensor, storage, whole)
        return tensor

    def _count(self, tensor: torch.Tensor, storage: int, whole: int) -> None:
        size = tensor.numel() * tensor.element_size()
        self.bytes += size
        self.tensors += 1
        if self._owners is not None:
            for owner in self._owners():
                key = (owner, storage, threading.get_ident())
                if key not in self._seen:
                    self._seen.add(key)
                    self.by_owner[owner] += whole

    def new_window(self) -> None:
        """Count storages again from here on (call when the saved tensors were freed, e.g. at
        each backward: a later tensor may reuse a freed storage's address)."""
        self._seen.clear()

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        register(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        unregister(self)
        self._hooks.__exit__(kind, value, traceback)


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """``(address, bytes)`` of the storage behind ``tensor`` (a DTensor's local shard; a
    tensor without one, such as a sparse tensor, stands for itself)."""
    tensor = local(tensor)
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(tensor), tensor.numel() * tensor.element_size()
