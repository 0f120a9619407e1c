"""Activation memory as autograd sees it: the bytes of every tensor saved for backward.

This is the memory that activation checkpointing and swapping change, and it can be
counted on any device (CPU included), unlike allocator peaks.
"""

from __future__ import annotations

from types import TracebackType

import torch


class SavedTensorMeter:
    """Context manager counting bytes that autograd saves for backward inside it.

    >>> with SavedTensorMeter() as meter:
    ...     loss = model(x).sum()
    >>> meter.bytes
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.tensors = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes += tensor.numel() * tensor.element_size()
        self.tensors += 1
        return tensor

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._hooks.__exit__(kind, value, traceback)
