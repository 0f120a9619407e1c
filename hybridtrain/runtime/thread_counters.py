"""Counters that worker threads doing another thread's work join.

Dispatch modes, saved-tensor hooks and the like are per thread: a count entered in one
thread (live tensor bytes under a memory limit, the profiler's FLOPs and saved
activations) sees nothing of the ops a worker thread runs on its behalf — the layer-major
runner's micro-batch forwards. So a count registers itself here while it is entered
(:func:`register` / :func:`unregister`); the thread that starts the workers reads
:func:`counters_here`, and each worker runs inside :func:`counting_with`, which enters
every counter's :meth:`ThreadCounter.joined` in that worker::

    caller thread                        worker thread
    with LiveTensorBytes(...) as live:   # registered here
        counters = counters_here()  ───► with counting_with(counters):   # live.joined() entered
        start workers, join them             model forward  (counted in ``live`` too)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol


class ThreadCounter(Protocol):
    """A count that a worker thread can join (thread safety of the count is its own)."""

    def joined(self) -> AbstractContextManager[object]:
        """Count the calling (worker) thread's work too, until exit; called once per
        worker, so what it enters (a dispatch mode, saved-tensor hooks) is that thread's own."""
        ...


_threads = threading.local()
_live: set[int] = set()  # ids of registered counters not yet unregistered, in any thread
_lock = threading.Lock()


def _here() -> list[ThreadCounter]:
    """The calling thread's counters; one unregistered in another thread is dropped."""
    counters: list[ThreadCounter] | None = getattr(_threads, "counters", None)
    if counters is None:
        counters = _threads.counters = []
    with _lock:
        counters[:] = [c for c in counters if id(c) in _live]
    return counters


def register(counter: ThreadCounter) -> None:
    """``counter`` counts in the calling thread from now on (call it from its ``__enter__``)."""
    with _lock:
        _live.add(id(counter))
    _here().append(counter)


def unregister(counter: ThreadCounter) -> None:
    """``counter`` stopped counting (call it from its ``__exit__``, in any thread)."""
    with _lock:
        _live.discard(id(counter))
    _here()  # drops it here; other threads drop it when they next look


def counters_here() -> tuple[ThreadCounter, ...]:
    """The counters counting in the calling thread (registered here or joined), outermost
    first; hand them to :func:`counting_with` in a worker thread."""
    return tuple(_here())


@contextlib.contextmanager
def counting_with(counters: Sequence[ThreadCounter]) -> Iterator[None]:
    """In a worker thread doing another thread's work: count this thread's work in
    ``counters`` too, until exit (each counter's :meth:`ThreadCounter.joined`).

    Args:
        counters: from :func:`counters_here` in the thread that entered them; they must
            stay entered while this thread works (the caller joins the worker first).
    """
    with contextlib.ExitStack() as stack:
        for counter in counters:
            stack.enter_context(counter.joined())
            _here().append(counter)
            stack.callback(_leave, counter)
        yield


def _leave(counter: ThreadCounter) -> None:
    counters = _here()
    if counter in counters:
        counters.remove(counter)
