"""A counter of the calls that read a tensor's value into Python (each one waits for the
device on CUDA): what a CPU test can check of "no sync on this path"."""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode

_READS = frozenset({"__bool__", "item", "tolist", "__float__", "__int__", "__index__"})


class HostReads(TorchFunctionMode):
    """Counts ``bool(t)``, ``t.item()``, ``t.tolist()``, ``float(t)`` … while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in _READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))
