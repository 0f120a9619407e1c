"""SIGTERM outside the training steps: one line saying how the command ended, not a silent
exit 143 (the training loop itself saves a checkpoint on SIGTERM, :mod:`hybridtrain.stopping`).

:func:`raise_on_sigterm` turns the signal into :class:`Terminated` (a ``BaseException``,
so no ``except Exception`` swallows it) from the first moment of a command, the seconds
spent importing torch included.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Terminated(BaseException):
    """The process got SIGTERM outside a section that handles it."""


def _raise(_signum: int, _frame: FrameType | None) -> None:
    raise Terminated


@contextmanager
def raise_on_sigterm() -> Iterator[None]:
    """Within the ``with`` body SIGTERM raises :class:`Terminated` (main thread only;
    elsewhere signals cannot be set and nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
