"""Marks around the work each stream does, for a measured step timeline.

The offload code issues its copies inside :class:`~hybridtrain.runtime.transfer.SideStream`
blocks (one side stream per direction) and recomputes checkpointed blocks inside backward.
While a :class:`StreamMarks` records, each such block is marked: on CUDA by a pair of timing
events on the stream that runs it (so the figure is the stream's own time, not the host's
time to enqueue), elsewhere by the wall clock around the block (a CPU "device" copies and
recomputes synchronously, so the block's wall time is the work's time). Nothing is recorded
while no :class:`StreamMarks` runs: a mark is then one list check.

Only the outermost mark of a part on a thread counts (a copy block nested in another of the
same direction would count twice otherwise).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

_recording: list[StreamMarks] = []
_depth = threading.local()
_NOTHING = nullcontext()

Span = tuple[torch.cuda.Event, torch.cuda.Event] | tuple[float, float]


class StreamMarks:
    """Seconds per marked part (``uploads``, ``downloads``, ``recomputation``) while recording."""

    def __init__(self) -> None:
        self._spans: dict[str, list[Span]] = defaultdict(list)
        self._lock = threading.Lock()  # the host optimizer's worker issues uploads too

    @contextmanager
    def recording(self) -> Iterator[StreamMarks]:
        """Receive every :func:`mark` inside this block, from any thread."""
        _recording.append(self)
        try:
            yield self
        finally:
            _recording.remove(self)

    def _add(self, part: str, span: Span) -> None:
        with self._lock:
            self._spans[part].append(span)

    def seconds(self) -> dict[str, float]:
        """Seconds per part: CUDA spans summed from their events (waiting for them first),
        wall-clock spans as measured."""
        out: dict[str, float] = {}
        with self._lock:
            spans = {part: list(found) for part, found in self._spans.items()}
        for part, found in spans.items():
            total = 0.0
            for start, end in found:
                if isinstance(start, torch.cuda.Event):
                    end.synchronize()  # type: ignore[union-attr]
                    total += start.elapsed_time(end) / 1e3  # type: ignore[arg-type]
                else:
                    total += float(end) - float(start)  # type: ignore[arg-type]
            out[part] = total
        return out


def mark(part: str, stream: torch.cuda.Stream | None) -> AbstractContextManager[None]:
    """Mark the block as ``part`` on every recording :class:`StreamMarks`: CUDA timing events
    on ``stream`` (None: wall clock)."""
    if not _recording:
        return _NOTHING
    return _marked(part, stream, list(_recording))


def mark_compute(part: str, device: torch.device | None) -> AbstractContextManager[None]:
    """:func:`mark` on ``device``'s current (compute) stream; wall clock off CUDA."""
    if not _recording:
        return _NOTHING
    cuda = device is not None and device.type == "cuda"
    return mark(part, torch.cuda.current_stream(device) if cuda else None)


@contextmanager
def _marked(part: str, stream: torch.cuda.Stream | None, marks: list[StreamMarks]) -> Iterator[None]:
    depths = _depth.__dict__.setdefault("parts", defaultdict(int))
    depths[part] += 1
    outermost = depths[part] == 1
    try:
        if not outermost:
            yield
            return
        # Recorded however the block ends: torch's checkpoint stops a recomputation early by
        # raising once it has every tensor backward needs, and that work was done all the same.
        first = time.perf_counter() if stream is None else torch.cuda.Event(enable_timing=True)
        if stream is not None:
            first.record(stream)  # type: ignore[union-attr]
        try:
            yield
        finally:
            if stream is None:
                span: Span = (first, time.perf_counter())  # type: ignore[assignment]
            else:
                last = torch.cuda.Event(enable_timing=True)
                last.record(stream)
                span = (first, last)  # type: ignore[assignment]
            for recorder in marks:
                recorder._add(part, span)
    finally:
        depths[part] -= 1
