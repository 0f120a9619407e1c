"""Where a step's time went, read from ``torch.profiler`` events.

The step is the host thread's timeline from the start to the end of ``train_batch``. Every
moment of it belongs to the innermost labelled range covering it::

    hybridtrain::forward / ::backward          forward, backward (engine phases)
    hybridtrain::interleaved                   forward, except autograd's backward
                                               functions in it (layer-major, pipelines)
    autograd::engine::evaluate_function: …     backward
    hybridtrain::step                          device_optimizer (unscale, clip, step, schedule)
    hybridtrain::host_optimizer                host_optimizer (offloaded optimizer step, waits)
    hybridtrain::transfer                      transfer (host↔device copies, waits for them)
    hybridtrain::communication, c10d::…,
    gloo:…, nccl:…, *all_reduce* …             communication (collectives)
    nothing                                    idle (the engine's bookkeeping between parts)

so the parts add up to the step exactly. The ``hybridtrain::`` labels come from
:mod:`hybridtrain.runtime.step_parts`, which the engine and the offload, swap, streaming
and collective code report through.

Per-module times come from labels the profiler puts around each module's forward
(``hybridtrain.module::NAME``) and from autograd's backward functions, which carry the
sequence number of the forward op that made them.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PARTS: tuple[str, ...] = ("forward", "backward", "device_optimizer", "host_optimizer", "transfer",
                          "communication", "idle")
"""The parts of a step, in the order tables show them."""

MODULE_LABEL = "hybridtrain.module::"
STEP_LABEL = "hybridtrain::train_batch"
_BACKWARD_FUNCTION = "autograd::engine::evaluate_function"
_LABELS = {
    "hybridtrain::forward": "forward",
    "hybridtrain::backward": "backward",
    "hybridtrain::interleaved": "forward",
    "hybridtrain::step": "device_optimizer",
    "hybridtrain::host_optimizer": "host_optimizer",
    "hybridtrain::transfer": "transfer",
    "hybridtrain::communication": "communication",
}
_COLLECTIVE_WORDS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast",
                     "all_to_all", "alltoall")


@dataclass(frozen=True)
class Event:
    """One profiler event, in seconds.

    Attributes:
        name: the op or label name.
        start / end: seconds on the profiler's clock.
        thread: the thread it ran on.
        seq: autograd sequence number (-1: none); a backward function carries its
            forward op's number.
        fwd_thread: the thread of that forward op (backward functions).
        on_device: a device-side event (CUDA kernel, memcpy) rather than a host one.
    """

    name: str
    start: float
    end: float
    thread: int = 0
    seq: int = -1
    fwd_thread: int = 0
    on_device: bool = False


@dataclass
class _Open:
    end: float
    part: str
    exclusive: float


def category(name: str) -> str | None:
    """The step part a host event's time belongs to (None: its enclosing range's part)."""
    if name in _LABELS:
        return _LABELS[name]
    if name.startswith(_BACKWARD_FUNCTION):
        return "backward"
    lowered = name.lower()
    if name.startswith(("c10d::", "gloo:", "nccl:", "record_param_comms")) or any(
            word in lowered for word in _COLLECTIVE_WORDS):
        return "communication"
    return None


def split_step(events: Iterable[Event], start: float, end: float, thread: int) -> dict[str, float]:
    """Seconds of each of :data:`PARTS` in the step ``[start, end]`` on ``thread``.

    Ranges on one thread nest, so each moment goes to the innermost categorised range;
    ``idle`` is what no range covers. The values add up to ``end - start``.
    """
    spans = sorted(((max(e.start, start), min(e.end, end), part) for e in events
                    if e.thread == thread and not e.on_device and e.end > start and e.start < end
                    and (part := category(e.name)) is not None), key=lambda s: (s[0], -s[1]))
    seconds: dict[str, float] = dict.fromkeys(PARTS, 0.0)
    stack: list[_Open] = []
    for s_start, s_end, part in spans:
        while stack and stack[-1].end <= s_start:
            closed = stack.pop()
            seconds[closed.part] += closed.exclusive
        if stack:  # time in a nested range is not its parent's
            s_end = min(s_end, stack[-1].end)
            stack[-1].exclusive -= s_end - s_start
        stack.append(_Open(s_end, part, s_end - s_start))
    for closed in stack:
        seconds[closed.part] += closed.exclusive
    seconds["idle"] = max(0.0, (end - start) - sum(v for k, v in seconds.items() if k != "idle"))
    return seconds


def _union(intervals: Iterable[tuple[float, float]]) -> float:
    busy, reach = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > reach:
            busy += e - max(s, reach)
            reach = e
    return busy


def device_split(events: Iterable[Event], start: float, end: float) -> dict[str, float]:
    """Seconds the device spent in ``[start, end]`` on ``compute`` kernels, ``memcpy``
    (host↔device copies) and ``communication`` (NCCL kernels), each a union of its events
    (they may overlap one another: copies and collectives run beside compute)."""
    kinds: dict[str, list[tuple[float, float]]] = {"compute": [], "memcpy": [], "communication": []}
    for e in events:
        if e.on_device and e.end > start and e.start < end:
            lowered = e.name.lower()
            kind = "memcpy" if "memcpy" in lowered else "communication" if "nccl" in lowered else "compute"
            kinds[kind].append((max(e.start, start), min(e.end, end)))
    return {kind: _union(spans) for kind, spans in kinds.items()}


def busy_fraction(events: Iterable[Event], start: float, end: float, on_device: bool) -> float:
    """Share of ``[start, end]`` in which some device event (``on_device``) or some host
    op (``aten::…`` on any thread) was running: the device's utilisation."""
    busy = _union((max(e.start, start), min(e.end, end)) for e in events
                  if e.end > start and e.start < end
                  and (e.on_device if on_device else (not e.on_device and e.name.startswith("aten::"))))
    return busy / (end - start) if end > start else 0.0


def module_times(events: Sequence[Event], names: Iterable[str]) -> dict[str, tuple[float, float]]:
    """``name → (forward seconds, backward seconds)`` over all events given.

    Forward: the module's labelled forwards outside a backward phase. Backward: autograd's
    backward functions made by ops inside the module's forwards (recomputed forwards
    inside a backward phase count there too, as backward).
    """
    wanted = set(names)
    labels: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    backward_phases: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.name.startswith(MODULE_LABEL) and e.name[len(MODULE_LABEL):] in wanted:
            labels[e.thread].append((e.start, e.end, e.name[len(MODULE_LABEL):]))
        elif e.name == "hybridtrain::backward":
            backward_phases[e.thread].append((e.start, e.end))
    forward: dict[str, float] = defaultdict(float)
    backward: dict[str, float] = defaultdict(float)
    for thread, spans in labels.items():
        spans.sort()
        for begin, finish, name in spans:
            in_backward = any(b_s <= begin < b_e for b_s, b_e in backward_phases.get(thread, ()))
            (backward if in_backward else forward)[name] += finish - begin
    starts = {thread: [s for s, _, _ in spans] for thread, spans in labels.items()}
    owner: dict[tuple[int, int], str] = {}
    for e in events:
        if e.seq < 0 or e.on_device or e.name.startswith(_BACKWARD_FUNCTION) or e.thread not in labels:
            continue
        spans = labels[e.thread]
        k = bisect.bisect_right(starts[e.thread], e.start) - 1
        if k >= 0 and spans[k][0] <= e.start and e.end <= spans[k][1]:
            owner[(e.thread, e.seq)] = spans[k][2]
    for e in events:
        if e.name.startswith(_BACKWARD_FUNCTION) and (e.fwd_thread, e.seq) in owner:
            backward[owner[(e.fwd_thread, e.seq)]] += e.end - e.start
    return {name: (forward.get(name, 0.0), backward.get(name, 0.0)) for name in wanted}


def collective_seconds(events: Iterable[Event], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` in which a collective ran on some thread (gloo's worker
    threads included): communication whether or not the step waited for it."""
    return _union((max(e.start, start), min(e.end, end)) for e in events
                  if not e.on_device and e.start < end and e.end > start and e.name.startswith(("gloo:", "nccl:")))


def profiler_events(prof: object) -> list[Event]:
    """The :class:`Event` list of a finished ``torch.profiler.profile``."""
    from torch.autograd import DeviceType

    out: list[Event] = []
    for e in prof.events():  # type: ignore[attr-defined]
        out.append(Event(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6, int(e.thread),
                         int(e.sequence_nr), int(e.fwd_thread or 0), e.device_type != DeviceType.CPU))
    return out
