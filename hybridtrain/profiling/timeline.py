"""A measured timeline of one training step: seconds per part, each measured where it runs.

Two recorders run around one ``train_batch`` and nothing else:

- a :class:`~hybridtrain.runtime.step_parts.PartClock` on the calling thread: the engine's
  phases (forward, backward, interleaved, device optimizer step; on CUDA each phase
  synchronises the device at both ends, so a phase's seconds are its device work), the
  time that thread waited for the host optimizer, and the host optimizer's own work
  (``host_step``, on whichever thread ran it);
- :class:`~hybridtrain.runtime.stream_marks.StreamMarks`: the copies on each side stream
  (uploads, downloads) and the recomputation of checkpointed blocks, by CUDA timing events on
  the stream that ran them; on a CPU device by the wall clock (the same code path, where
  copies and recomputation are synchronous).

Parts overlap by design (copies run beside compute, the host step beside both), so they do
not add up to ``total``; ``waiting_for_host`` is the share the step could not hide.
The step is timed from settled to settled: updates still running in the background from
the step before are waited for first, and this step's before the clock stops.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridtrain.runtime.step_parts import PartClock
from hybridtrain.runtime.stream_marks import StreamMarks

TIMELINE_PARTS = ("compute", "recomputation", "uploads", "downloads", "host_step", "waiting_for_host",
                  "transfer_waits", "total")
"""The keys of :func:`measure_timeline`'s answer (besides ``source``)."""


def wait_for_host_updates(engine: Any) -> None:
    """Wait for host updates an overlapped step left running (not the exact-weights upload
    :meth:`~hybridtrain.engine.Engine.wait_for_updates` adds, which a training loop does not do)."""
    wait = getattr(engine, "_wait_for_host_updates", None) or getattr(engine, "wait_for_updates", None)
    if wait is not None:
        wait()


def _synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure_timeline(engine: Any, batch: Any) -> dict[str, Any]:
    """Train one step of ``batch`` on ``engine`` and say where its time went.

    Returns:
        Seconds for each of :data:`TIMELINE_PARTS`: ``compute`` (the phases' device work less
        recomputation), ``recomputation``, ``uploads`` and ``downloads`` (side-stream copy
        time), ``host_step`` (the offloaded optimizer's update), ``waiting_for_host`` (the
        step's thread blocked on the host optimizer: no device work was queued meanwhile),
        ``transfer_waits`` (the step's thread issuing and waiting for copies), ``total``;
        and ``source``: ``cuda events`` or ``wall clock``.
    """
    device = engine.device
    wait_for_host_updates(engine)
    _synchronize(device)
    clock, marks = PartClock(), StreamMarks()
    start = time.perf_counter()
    with clock.running(), marks.recording():
        engine.train_batch(batch)
        wait_for_host_updates(engine)  # this step's background update belongs to it
        _synchronize(device)
    total = time.perf_counter() - start
    marked = marks.seconds()
    phases = sum(clock.seconds.get(part, 0.0) for part in ("forward", "backward", "interleaved", "step"))
    recomputation = marked.get("recomputation", 0.0)
    return {"compute": max(phases - recomputation, 0.0), "recomputation": recomputation,
            "uploads": marked.get("uploads", 0.0), "downloads": marked.get("downloads", 0.0),
            "host_step": clock.work.get("host_step", 0.0), "waiting_for_host": clock.seconds.get("host_optimizer", 0.0),
            "transfer_waits": clock.seconds.get("transfer", 0.0), "total": total,
            "source": "cuda events" if torch.device(device).type == "cuda" else "wall clock"}
