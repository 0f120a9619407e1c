"""``deepspeed.utils``: the data helper scripts import from it, DeepSpeed's logger, and the
ZeRO-3 leaf-module marker the frameworks call."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from hybridtrain.deepspeed.utils import groups, logging, zero_to_fp32
from hybridtrain.deepspeed.utils.logging import log_dist, logger

__all__ = ["RepeatingLoader", "groups", "log_dist", "logger", "logging", "set_z3_leaf_modules", "zero_to_fp32"]


class RepeatingLoader:
    """An endless iterator over ``loader``: at its end a new pass starts (a new
    ``iter(loader)``, so a shuffling sampler reshuffles), as DeepSpeed's ``RepeatingLoader``.

    Args:
        loader: any iterable (a ``DataLoader``).
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[Any]) -> list[nn.Module]:
    """Mark the modules of these classes (classes or class names) as ZeRO-3 leaves, as
    DeepSpeed does (``_z3_leaf``): their parameters are gathered together. hybridtrain's
    ZeRO-3 gathers per block anyway; the mark is kept for code that reads it.

    Returns:
        The marked modules.

    Raises:
        ValueError: no module of the model is of these classes (DeepSpeed's check).
    """
    names = {c if isinstance(c, str) else c.__name__ for c in leaf_module_classes}
    marked = [m for m in model.modules() if type(m).__name__ in names]
    if not marked:
        raise ValueError(f"No modules of type {sorted(names)} found in model {type(model).__name__}")
    for module in marked:
        module._z3_leaf = True  # type: ignore[assignment]
    return marked
