"""FLOPs per module counted in every thread that does a step's work.

torch's ``FlopCounterMode`` counts the ops of the thread that entered it (a dispatch mode
is per thread; autograd's backward threads inherit it) and attributes them to the modules
its ``ModuleTracker`` says are running — one set for the whole process, filled by global
module hooks that fire in every thread. Layer-major streaming runs each micro-batch's
forward in a worker thread, the workers taking turns at every streamed block, so both
break: the workers' ops are not counted, and the running modules of one micro-batch mix
with another's (micro-batch 1 computes block 0 while micro-batch 0 has entered block 1).

Here one tracker keeps the running modules per thread, and one ``FlopCounterMode`` per
thread counts into the same totals: the entering thread's, and one more for each worker
that joins the count (:mod:`hybridtrain.runtime.thread_counters`)::

    caller:  ThreadFlopCounter ── FlopCounterMode ─┐
    worker 0: joined() ────────── FlopCounterMode ─┼─► get_flop_counts(): per module and op
    worker 1: joined() ────────── FlopCounterMode ─┘
             one ThreadModuleTracker: running modules per thread
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

from hybridtrain.runtime.thread_counters import register, unregister


def tracked_name(key: str, wanted: set[str]) -> str:
    """A module tracker's name (``GPT.transformer.h.0``: the root's class name first; under
    DDP ``DistributedDataParallel.module.transformer.h.0``) as a name in the user's model."""
    parts = key.split(".")[1:]
    if parts[:1] == ["module"] and ".".join(parts) not in wanted:
        parts = parts[1:]
    return ".".join(parts)


class _Running(set[str]):
    """One thread's running modules: the names the tracker added, and — while none of them
    is a *unit* (a block) — the units they lie in.

    In backward torch's tracker enters a module when the gradient of its output arrives; a
    block whose output layer-major streaming cut from the graph, and backwards from there,
    never receives one: its submodules run, it does not. Implying it from them only while
    no unit is named keeps torch's own answer everywhere else (in a whole graph's backward
    its tracker leaves stale names behind, such as an identity dropout's, which would
    otherwise imply the wrong block).
    """

    def __init__(self, names: Iterable[str], unit: Callable[[str], bool],
                 on_change: Callable[[set[str]], None] | None = None) -> None:
        super().__init__()
        self._named: set[str] = set()
        self._unit = unit
        self._on_change = None
        for name in names:
            self.add(name)
        self._on_change = on_change
        if on_change is not None:
            on_change(self)

    def add(self, name: str) -> None:
        self._named.add(name)
        self._refill()

    def remove(self, name: str) -> None:
        # The tracker removes what ``in`` finds, an implied unit included: a no-op then.
        self.discard(name)

    def discard(self, name: object) -> None:
        if isinstance(name, str):
            self._named.discard(name)
        self._refill()

    def _refill(self) -> None:
        self.clear()
        self.update(self._named)
        if not any(self._unit(name) for name in self._named):
            for name in self._named:
                parts = name.split(".")
                self.update(a for a in (".".join(parts[:i]) for i in range(1, len(parts))) if self._unit(a))
        if self._on_change is not None:
            self._on_change(self)


class ThreadModuleTracker(ModuleTracker):
    """torch's ``ModuleTracker`` whose ``parents`` (the modules running now) are the
    calling thread's, and which may be entered by several counters at once (its global
    hooks are added at the first entry and removed at the last exit).

    Args:
        unit: whether a tracker name (``GPT.blocks.0``) is a block, implied by its
            submodules where a cut graph leaves it out (see :class:`_Running`).
        on_change: called in a thread with its running modules each time they change.
    """

    def __init__(self, unit: Callable[[str], bool] = lambda _name: False,
                 on_change: Callable[[set[str]], None] | None = None) -> None:
        self._by_thread: dict[int, _Running] = {}
        self._unit = unit
        self._on_change = on_change
        self._entries = 0
        self._entry_lock = threading.Lock()
        super().__init__()

    @property
    def parents(self) -> set[str]:
        """The modules the calling thread is running (always ``Global``)."""
        thread = threading.get_ident()
        parents = self._by_thread.get(thread)
        if parents is None:
            parents = self._by_thread[thread] = _Running({"Global"}, self._unit, self._on_change)
        return parents

    @parents.setter
    def parents(self, value: set[str]) -> None:
        # torch sets it when a backward ends (from an autograd callback, in whichever thread
        # finishes the graph): nothing runs in any thread then, the backward's threads
        # included (on CUDA, autograd's device threads), as torch's one set says.
        self._by_thread = {threading.get_ident(): _Running(value, self._unit, self._on_change)}

    def __enter__(self) -> ThreadModuleTracker:
        with self._entry_lock:
            self._entries += 1
            if self._entries == 1:
                super().__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        with self._entry_lock:
            self._entries -= 1
            if self._entries == 0:
                super().__exit__(*args)


class ThreadFlopCounter:
    """``FlopCounterMode`` over the entering thread and the worker threads that join it
    (see the module docstring); read it after exit.

    Args:
        tracker: the running modules, per thread (several counters may share one).
        custom_mapping: FLOP formulas beside torch's, as for ``FlopCounterMode``.
    """

    def __init__(self, tracker: ThreadModuleTracker, custom_mapping: dict[Any, Any]) -> None:
        self.mod_tracker = tracker
        self._mapping = custom_mapping
        self._counters: list[FlopCounterMode] = []
        self._lock = threading.Lock()
        self._own: FlopCounterMode | None = None

    def _counter(self) -> FlopCounterMode:
        counter = FlopCounterMode(display=False, custom_mapping=self._mapping)
        counter.mod_tracker = self.mod_tracker  # attributed to the running modules of its own thread
        with self._lock:
            self._counters.append(counter)
        return counter

    def __enter__(self) -> ThreadFlopCounter:
        self._counters.clear()
        self._own = self._counter()
        self._own.__enter__()
        register(self)
        return self

    def __exit__(self, *args: object) -> None:
        unregister(self)
        assert self._own is not None
        self._own.__exit__(*args)
        self._own = None

    @contextmanager
    def joined(self) -> Iterator[None]:
        """Count the calling worker thread's ops too, until exit."""
        with self._counter():
            yield

    def get_flop_counts(self) -> dict[str, dict[Any, int]]:
        """FLOPs per module name (the tracker's, ``Global`` for all) and op, every thread's."""
        total: dict[str, dict[Any, int]] = defaultdict(lambda: defaultdict(int))
        with self._lock:
            counters = list(self._counters)
        for counter in counters:
            for module, ops in counter.get_flop_counts().items():
                for op, flops in ops.items():
                    total[module][op] += flops
        return {module: dict(ops) for module, ops in total.items()}

    def get_total_flops(self) -> int:
        """FLOPs of every op counted, in every thread."""
        return sum(self.get_flop_counts().get("Global", {}).values())
