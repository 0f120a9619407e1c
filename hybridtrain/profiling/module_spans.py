"""Per-module seconds where torch.profiler cannot attribute them: layer-major streaming.

torch.profiler records the thread that started it (and autograd's). Layer-major streaming
runs each micro-batch's forward in a worker thread, so the modules' forward events are
missing, and the backward events on the calling thread cannot be traced to the forward
ops (and modules) that made them. Its timed steps measure modules this way instead::

    forward   worker thread: wall-clock span of each module's forward, from the hooks that
              label forwards for the profiler (added after the runner's turn-taking hooks:
              a worker waiting for its turn is in no module); workers take turns, so the
              spans never overlap
    backward  thread running backward: the span during which a module runs as
              :class:`~hybridtrain.profiling.thread_flops.ThreadModuleTracker` sees it
              (its gradients arriving; a block backwarded from its cut output implied by
              its submodules), as wall clock
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from types import TracebackType

from hybridtrain.profiling.thread_flops import ThreadModuleTracker, tracked_name


class ModuleSpans:
    """Seconds per module of one step, forward in worker threads and backward (see the
    module docstring); enter it around the step.

    Args:
        names: the modules measured (names in the user's model).
        blocks: those of them that are blocks.

    Attributes:
        forward / backward: seconds per module name.
        worker_busy: seconds in which some worker thread ran a measured module's forward
            (the outermost one: nested modules count once).
    """

    def __init__(self, names: set[str], blocks: set[str]) -> None:
        self.forward: dict[str, float] = defaultdict(float)
        self.backward: dict[str, float] = defaultdict(float)
        self.worker_busy = 0.0
        self._running_backward: set[str] = set()
        self._since = 0.0
        self._names = names
        self._local = threading.local()
        self._lock = threading.Lock()
        self._caller = threading.get_ident()
        self._tracker = ThreadModuleTracker(unit=lambda key: tracked_name(key, names) in blocks,
                                            on_change=self._changed)

    def __enter__(self) -> ModuleSpans:
        self._caller = threading.get_ident()
        self._tracker.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._tracker.__exit__(kind, value, traceback)

    def forward_began(self, name: str) -> None:
        """Module ``name``'s forward starts (its forward pre-hook); counted in worker threads."""
        if threading.get_ident() != self._caller:
            self._started().append((name, time.perf_counter()))

    def forward_ended(self, name: str) -> None:
        """Module ``name``'s forward ends (its forward hook)."""
        started = self._started()
        if threading.get_ident() != self._caller and started and started[-1][0] == name:
            _, since = started.pop()
            seconds = time.perf_counter() - since
            with self._lock:
                self.forward[name] += seconds
                if not started:
                    self.worker_busy += seconds

    def _started(self) -> list[tuple[str, float]]:
        started: list[tuple[str, float]] | None = getattr(self._local, "started", None)
        if started is None:
            started = self._local.started = []
        return started

    def _changed(self, running: set[str]) -> None:
        """Running modules changed in some thread: the ones running in backward until now
        get the time since the last change. One backward runs at a time, so one state:
        whichever autograd thread changes it (a change outside backward, or the tracker's
        reset when a backward ends, closes it)."""
        now = time.perf_counter()
        tracker = getattr(self, "_tracker", None)  # None: the tracker is being built
        in_backward = tracker is not None and tracker.is_bw
        with self._lock:
            if not in_backward and not self._running_backward:
                return  # a forward's change: nothing to close
            for name in self._running_backward:
                self.backward[name] += now - self._since
            names = {tracked_name(key, self._names) for key in running} if in_backward else set()
            self._running_backward = names & self._names
            self._since = now
