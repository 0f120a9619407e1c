"""Run a tensor's pending writer to completion before the first op that reads it.

A background host update (:mod:`~hybridtrain.runtime.offload.optimizer`) still writes
device weights while the next forward starts. :class:`WaitBeforeReads` is a torch function
mode: on the thread that enters it, every torch function and tensor method whose
arguments include a pending tensor first calls that tensor's waiter — whichever module,
loss function or hook reads it, not only the module that owns it. Once nothing is
pending, an op costs one dictionary check. C++ extensions called outside torch's Python
API are not seen; nor are other threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch.overrides import TorchFunctionMode


class WaitBeforeReads(TorchFunctionMode):
    """Calls ``pending[id(t)]()`` before the first op reading tensor ``t``.

    Args:
        pending: tensor id → waiter. A waiter makes its tensors usable and removes their
            ids from ``pending`` (the caller's mapping, read live).
    """

    def __init__(self, pending: Mapping[int, Callable[[], None]]) -> None:
        super().__init__()
        self.pending = pending

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.pending:
            for arg in _arguments(args, kwargs):
                waiter = self.pending.get(id(arg))
                if waiter is not None:
                    waiter()
        return func(*args, **kwargs)


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    # One level of lists and tuples: torch.cat, foreach ops and the like take tensors so.
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value
