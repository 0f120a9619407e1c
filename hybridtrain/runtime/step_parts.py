"""The parts of a training step, timed where they happen.

The engine's phases (``forward``, ``backward``, ``interleaved``, ``step``) and what runs
inside them (host↔device ``transfer``, ``communication`` between processes) all report
through one hook::

    with step_part("transfer"):
        host.copy_(grad, non_blocking=True)

Nothing is measured unless a :class:`PartClock` runs (the engine starts one for
``wall_clock_breakdown``, the profiler for the steps it profiles): then ``step_part`` is
one list check. Parts nest, and every second counts once, in the innermost part (a copy
inside a backward is ``transfer``, not ``backward``), so the parts of a step add up to the
time spent inside them. A running clock also labels each part for ``torch.profiler``
(``hybridtrain::transfer`` …), so Chrome traces show them.

A clock hears the thread that started it: the step's timeline. Work that other threads
do meanwhile (the offload optimizer's host worker, layer-major workers) counts where that
thread waits for it (``host_optimizer`` around the offload optimizer's waits). What such
work costs, whichever thread does it, is counted apart by :func:`work_part` into
:attr:`PartClock.work` (the host optimizer step: ``host_step``): beside the waits, it says
how much of that work was hidden behind the step's other work.

Only the phases synchronise the device (``device`` argument): a transfer or collective
part measures the host's time in it, waiting included, not an asynchronous copy's device
time, which overlaps compute by design.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

_running: list[PartClock] = []


class PartClock:
    """Seconds per step part while running (see the module docstring).

    Args:
        on_switch: called each time the innermost part changes, with the part that was
            innermost until then (None: outside every part); :attr:`current` is the new one.

    Attributes:
        seconds: exclusive seconds per part name.
    """

    def __init__(self, on_switch: Callable[[str | None], None] | None = None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.work: dict[str, float] = defaultdict(float)
        """Seconds of :func:`work_part` blocks by name, on any thread (they may overlap the
        step's parts and one another)."""
        self._work_lock = threading.Lock()
        self.on_switch = on_switch
        self.thread = threading.get_ident()
        self._stack: list[str] = []
        self._since = time.perf_counter()

    @property
    def current(self) -> str | None:
        """The innermost part now (None outside every part)."""
        return self._stack[-1] if self._stack else None

    def _switch(self, enter: str | None) -> None:
        now = time.perf_counter()
        left = self.current
        if left is not None:
            self.seconds[left] += now - self._since
        if enter is None:
            self._stack.pop()
        else:
            self._stack.append(enter)
        self._since = now
        if self.on_switch is not None:
            self.on_switch(left)

    @contextmanager
    def running(self) -> Iterator[PartClock]:
        """Receive every :func:`step_part` inside this block."""
        _running.append(self)
        try:
            yield self
        finally:
            _running.remove(self)


_NOTHING = nullcontext()


def work_part(name: str, clocks: Sequence[PartClock] | None = None) -> AbstractContextManager[None]:
    """Count the block's seconds as work ``name`` (``host_step``: the offloaded optimizer's
    update) on every running :class:`PartClock`, whichever thread runs it — or on
    ``clocks`` (:func:`running_clocks` when the work was asked for: work that runs after
    its step returned still counts as that step's)."""
    chosen = list(_running) if clocks is None else list(clocks)
    return _worked(name, chosen) if chosen else _NOTHING


def running_clocks() -> list[PartClock]:
    """The clocks running now (see :func:`work_part`)."""
    return list(_running)


@contextmanager
def _worked(name: str, clocks: list[PartClock]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - start
        for clock in clocks:
            with clock._work_lock:
                clock.work[name] += seconds


def step_part(name: str, device: torch.device | None = None) -> AbstractContextManager[None]:
    """Count the block's seconds as part ``name`` on every running :class:`PartClock`.

    Args:
        name: a field of :class:`~hybridtrain.runtime.step_runner.StepTimings`:
            ``forward``, ``backward``, ``interleaved``, ``step``, ``transfer``,
            ``communication`` or ``host_optimizer``.
        device: synchronise it at both ends, so queued kernels count in this part (the
            engine's phases); None for parts inside them.
    """
    if not _running:  # the common case: one check, no generator
        return _NOTHING
    clocks = [clock for clock in _running if clock.thread == threading.get_ident()]
    return _timed(name, device, clocks) if clocks else _NOTHING


@contextmanager
def _timed(name: str, device: torch.device | None, clocks: list[PartClock]) -> Iterator[None]:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    for clock in clocks:
        clock._switch(name)
    try:
        with torch.profiler.record_function(f"hybridtrain::{name}"):
            yield
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
    finally:
        for clock in clocks:
            clock._switch(None)
