"""Batches in the three shapes users bring — ``(inputs, targets)``, a dict, a tensor —
split into micro-batches, moved to a device, fed to the model and turned into a loss."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

Batch = Any
LossFn = Callable[[Any, Batch], torch.Tensor]


def batch_size(batch: Batch) -> int:
    """Number of samples: the leading dimension of the first tensor found.

    Raises:
        TypeError: the batch holds no tensor.
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, list | tuple) else []
    for value in values:
        try:
            return batch_size(value)
        except TypeError:
            continue
    raise TypeError(f"batch of type {type(batch).__name__} holds no tensor; pass a tensor, "
                    "a tuple (inputs, targets) or a dict of tensors")


def split_batch(batch: Batch, chunks: int) -> list[Batch]:
    """Split along dim 0 into ``chunks`` equal micro-batches (non-tensors are shared).

    Raises:
        ValueError: the batch size is not divisible by ``chunks``.
    """
    size = batch_size(batch)
    if size % chunks:
        raise ValueError(
            f"batch of {size} samples does not split into gradient_accumulation_steps={chunks} "
            f"equal micro-batches; use a batch size that is a multiple of {chunks}"
        )
    if chunks == 1:
        return [batch]
    micro = size // chunks
    return [_slice(batch, i * micro, (i + 1) * micro, size) for i in range(chunks)]


def chunk_batch(batch: Batch, max_size: int) -> list[tuple[Batch, int]]:
    """Split along dim 0 into chunks of at most ``max_size`` samples (the last may be
    smaller); returns ``(chunk, samples)`` pairs. For evaluation, where no gradient
    depends on equal sizes."""
    size = batch_size(batch)
    return [(_slice(batch, start, min(start + max_size, size), size), min(max_size, size - start))
            for start in range(0, size, max_size)]


def _slice(batch: Batch, start: int, stop: int, size: int) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() and batch.shape[0] == size else batch
    if isinstance(batch, Mapping):
        return {k: _slice(v, start, stop, size) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_slice(v, start, stop, size) for v in batch)
    return batch


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Move every tensor in the batch to ``device`` (non-blocking where possible)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def run_model(model: torch.nn.Module, batch: Batch) -> Any:
    """Call the model the way the batch shape implies: ``model(**dict)``, ``model(inputs)``
    for ``(inputs, targets)`` (``model(**inputs)`` when inputs is a dict), ``model(tensor)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, list | tuple):
        inputs = batch[0]
        return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
    return model(batch)


def compute_loss(outputs: Any, batch: Batch, loss_fn: LossFn | None) -> torch.Tensor:
    """``loss_fn(outputs, batch)``, else ``outputs.loss``, else a scalar output.

    Raises:
        TypeError: no loss_fn and the output carries no loss.
    """
    if loss_fn is not None:
        return loss_fn(outputs, batch)
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    if loss is None and isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        loss = outputs
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"the model returned {type(outputs).__name__} without a .loss and no loss_fn was given; "
            "pass loss_fn=lambda outputs, batch: ... to initialize()"
        )
    return loss
