"""Profile real training steps of an engine: what each module costs, where the step's time
goes, how close to the device's peak it runs, and what to change.

A profile takes at least two steps of ``engine.train_batch`` (they train the model)::

    step 1  counted  FlopCounterMode ×2 (forward / backward FLOPs per module), saved
                     activation bytes per module, live tensor bytes over time
    step 2… timed    torch.profiler: the step split into parts, per-module times, the
                     Chrome trace (counting would distort these, so they are separate steps;
                     on CUDA the engine's phases synchronise, as with wall_clock_breakdown)

:func:`profile_engine` runs them; :class:`ProfileSession` lets a training loop run them as
its own steps (DeepSpeed's ``flops_profiler.profile_step``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridtrain.hardware.peaks import peak_flops
from hybridtrain.profiling.breakdown import (
    MODULE_LABEL,
    PARTS,
    STEP_LABEL,
    Event,
    busy_fraction,
    collective_seconds,
    device_split,
    module_times,
    profiler_events,
    split_step,
)
from hybridtrain.profiling.counting import StepCount, count_step, profiled_modules
from hybridtrain.profiling.diagnosis import diagnose
from hybridtrain.profiling.module_spans import ModuleSpans
from hybridtrain.profiling.report import ModuleProfile, Profile, hidden_share
from hybridtrain.runtime.device import peak_reserved_bytes
from hybridtrain.runtime.offload import OffloadOptimizer
from hybridtrain.runtime.step_parts import PartClock
from hybridtrain.runtime.stream_marks import StreamMarks
from hybridtrain.runtime.streaming import LayerMajorRunner, LayerStreamer

_KINETO_MARKER = re.compile(rb"^USDT:.*\] profiler_(start|stop)\s*$")
"""The line libkineto's logger writes to stderr as a trace starts and as it stops."""


@contextmanager
def _without_kineto_markers() -> Iterator[None]:
    """Drop libkineto's ``USDT: … profiler_start``/``profiler_stop`` lines, which it writes
    to stderr (file descriptor 2, from C++) on every trace: its USDT level ranks above
    ERROR, so ``KINETO_LOG_LEVEL`` cannot hide them without hiding errors. Everything else
    written to stderr meanwhile (milliseconds: the profiler starting or stopping) follows
    once it is done."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no stderr to filter
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = b"".join(line for line in caught.read().splitlines(keepends=True)
                            if not _KINETO_MARKER.match(line))
            while kept:
                kept = kept[os.write(2, kept):]


@contextmanager
def _module_labels(modules: list[tuple[str, str, nn.Module]], spans: ModuleSpans | None = None) -> Iterator[None]:
    """Label every module's forward for the profiler (``hybridtrain.module::NAME``), and
    time it in ``spans`` where the profiler does not see it (worker threads)."""
    handles = []
    for name, _, module in modules:
        opened: list[Any] = []

        def enter(_m: nn.Module, _args: Any, name: str = name, stack: list[Any] = opened) -> None:
            scope = torch.profiler.record_function(MODULE_LABEL + name)
            scope.__enter__()
            stack.append(scope)
            if spans is not None:
                spans.forward_began(name)

        def leave(_m: nn.Module, _args: Any, _out: Any, name: str = name, stack: list[Any] = opened) -> None:
            if spans is not None:
                spans.forward_ended(name)
            if stack:
                stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class ProfileSession:
    """The steps of one profile, run one at a time (see the module docstring).

    Args:
        engine: the engine whose steps are profiled.
        model: whose modules the table shows (default ``engine.module``).
    """

    def __init__(self, engine: Any, model: nn.Module | None = None) -> None:
        self.engine = engine
        self.model = model if model is not None else engine.module
        self.count: StepCount | None = None
        # One list per timed step: each profiler run has its own time origin.
        self._events: list[list[Event]] = []
        self._traces: list[Any] = []
        self._walls: list[float] = []
        # Each timed step's clock: its host optimizer work (any thread) is read at the end,
        # as a background update may finish after its step returned.
        self._clocks: list[PartClock] = []
        # Layer-major: each timed step's module seconds, measured beside the profiler.
        self._spans: list[ModuleSpans] = []
        # Each timed step's side-stream copies and recomputation (the benchmark's timeline parts).
        self._marks: list[StreamMarks] = []

    def count_step(self, batch: Any) -> float:
        """The counted step (the first): returns its loss."""
        if self.engine.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.engine.device)
        self.count = count_step(self.engine, batch, self.model)
        return self.count.loss

    def timed_step(self, batch: Any) -> float:
        """A timed step: returns its loss."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.engine.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        modules = profiled_modules(self.model)
        spans = ModuleSpans({name for name, _, _ in modules}, {name for name, kind, _ in modules if kind == "block"}) \
            if isinstance(self.engine.runner, LayerMajorRunner) else None
        prof = torch.profiler.profile(activities=activities)
        with _without_kineto_markers():
            prof.start()
        try:
            marks = StreamMarks()
            with _module_labels(modules, spans), spans or nullcontext(), PartClock().running() as clock, \
                    marks.recording():
                start = time.perf_counter()
                with torch.profiler.record_function(STEP_LABEL):
                    loss = self.engine.train_batch(batch)
                self._walls.append(time.perf_counter() - start)
            self._clocks.append(clock)
            self._marks.append(marks)
            if spans is not None:
                self._spans.append(spans)
        finally:
            with _without_kineto_markers():
                prof.stop()
        self._events.append(profiler_events(prof))
        self._traces.append(prof)
        return float(loss)

    def finish(self, output_dir: str | Path | None = None) -> Profile:
        """The profile of the steps run so far (one counted, at least one timed); with
        ``output_dir``, also write ``profile.json``, ``trace.json`` and ``memory.png``.

        Raises:
            RuntimeError: no counted or no timed step ran.
        """
        if self.count is None or not self._walls:
            raise RuntimeError("a profile needs one counted step and at least one timed step")
        self.engine.wait_for_updates()
        host_step = [clock.work.get("host_step", 0.0) for clock in self._clocks]
        profile = _summarise(self.engine, self.count, self._events, len(self._walls), sum(host_step) / len(host_step),
                             self._spans)
        marked = [marks.seconds() for marks in self._marks]
        kinds = sorted({kind for seconds in marked for kind in seconds})
        profile.stream_parts = {kind: sum(s.get(kind, 0.0) for s in marked) / len(marked) for kind in kinds} or None
        if output_dir is not None:
            out = Path(output_dir)
            out.mkdir(parents=True, exist_ok=True)
            self._traces[-1].export_chrome_trace(str(out / "trace.json"))
            profile.files["trace"] = str(out / "trace.json")
            from hybridtrain.profiling.plot import plot_memory

            picture = plot_memory(self.count, str(self.engine.device), out / "memory.png")
            if picture is None:
                profile.notes.append("memory.png not drawn: matplotlib is missing (pip install 'hybridtrain[monitor]')")
            else:
                profile.files["memory"] = str(picture)
            profile.files["profile"] = str(out / "profile.json")
            (out / "profile.json").write_text(json.dumps(profile.to_dict(), indent=1))
        return profile


def profile_engine(engine: Any, batch: Any, steps: int = 2, output_dir: str | Path | None = None,
                   model: nn.Module | None = None) -> Profile:
    """Profile ``steps`` training steps of ``engine`` on ``batch`` (they train the model).

    Args:
        engine: a :class:`hybridtrain.engine.Engine`.
        batch: the batch every profiled step trains on.
        steps: at least 2: the first is counted, the rest are timed.
        output_dir: where to write ``profile.json``, ``trace.json`` and ``memory.png``.
        model: whose modules the table shows (default ``engine.module``).

    Raises:
        ValueError: ``steps`` below 2.
    """
    if steps < 2:
        raise ValueError(f"steps = {steps}; a profile needs at least 2 (one counted, the rest timed)")
    session = ProfileSession(engine, model)
    session.count_step(batch)
    for _ in range(steps - 1):
        session.timed_step(batch)
    return session.finish(output_dir)


def _techniques(engine: Any) -> list[str]:
    used = []
    if isinstance(engine.runner, LayerMajorRunner):
        used.append("layer_major")
    if isinstance(engine.optimizer, OffloadOptimizer):
        used.append("optimizer_offload")
    if any(isinstance(o, LayerStreamer) for o in engine.options.observers):
        used.append("layer_streaming")
    if isinstance(engine.optimizer, OffloadOptimizer) and engine.overlap_updates:
        used.append("overlapped_updates")
    if engine.parallel.distributed:
        used.append("distributed")
    return used


def _summarise(engine: Any, count: StepCount, per_step: list[list[Event]], steps: int,
               host_step: float = 0.0, spans: list[ModuleSpans] | None = None) -> Profile:
    """Means over the timed steps (each step's events on its own profiler clock);
    ``host_step``: mean seconds of host optimizer work per step, on any thread; ``spans``:
    each timed step's module seconds where the profiler cannot attribute them (layer-major)."""
    parts = dict.fromkeys(PARTS, 0.0)
    busy = collectives = step_seconds = 0.0
    on_cuda = engine.device.type == "cuda"
    names = [m.name for m in count.modules]
    times = dict.fromkeys(names, (0.0, 0.0))
    on_device: dict[str, float] = {}
    for index, events in enumerate(per_step):
        step = next((e for e in events if e.name == STEP_LABEL), None)
        if step is None:
            raise RuntimeError("the profiler recorded no training step (was another torch.profiler running?)")
        for name, seconds in split_step(events, step.start, step.end, step.thread).items():
            parts[name] += seconds / steps
        busy += busy_fraction(events, step.start, step.end, on_device=on_cuda) / steps
        if spans and not on_cuda and step.end > step.start:
            # The CPU computing the workers' forwards, unseen by the profiler (the calling
            # thread waits meanwhile; on CUDA the profiler sees every kernel, whoever launched it).
            busy += spans[index].worker_busy / (step.end - step.start) / steps
        collectives += collective_seconds(events, step.start, step.end) / steps
        step_seconds += (step.end - step.start) / steps
        if on_cuda:
            for kind, seconds in device_split(events, step.start, step.end).items():
                on_device[kind] = on_device.get(kind, 0.0) + seconds / steps
        if not spans:
            for name, (forward, backward) in module_times(events, names).items():
                times[name] = (times[name][0] + forward / steps, times[name][1] + backward / steps)
    for measured in spans or ():
        for name in names:
            times[name] = (times[name][0] + measured.forward.get(name, 0.0) / steps,
                           times[name][1] + measured.backward.get(name, 0.0) / steps)
    rows = [ModuleProfile(m.name, m.kind, m.params, m.forward_flops, m.backward_flops, m.saved_bytes,
                          *times[m.name]) for m in count.modules]
    dtype = engine.options.compute_dtype or torch.float32
    peak, source = peak_flops(engine.device, dtype)
    total = count.forward_flops + count.backward_flops
    achieved = total / step_seconds if step_seconds > 0 else 0.0
    notes: list[str] = []
    profile = Profile(
        device=str(engine.device), dtype=str(dtype).removeprefix("torch."), timed_steps=steps,
        step_seconds=step_seconds, parts=parts, collective_seconds=collectives, device_utilisation=busy,
        host_step_seconds=host_step, host_step_hidden=hidden_share(host_step, parts["host_optimizer"]),
        flops={"forward": count.forward_flops, "backward": count.backward_flops, "total": total},
        achieved_tflops=achieved / 1e12, peak_tflops=peak / 1e12, peak_source=source, mfu=achieved / peak,
        modules=rows, peak_live_bytes=count.peak_live_bytes,
        allocator_peak_bytes=int(torch.cuda.max_memory_allocated(engine.device)) if on_cuda else None,
        allocator_reserved_peak_bytes=peak_reserved_bytes(engine.device),
        device_parts=on_device or None, techniques=_techniques(engine), notes=notes,
    )
    profile.diagnosis = [finding.message for finding in diagnose(profile.to_dict())]
    return profile
