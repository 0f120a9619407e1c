"""``deepspeed.utils``: the data helper DeepSpeed scripts import from it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["RepeatingLoader"]


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
