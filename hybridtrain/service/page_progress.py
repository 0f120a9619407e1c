"""What the jobs page shows of a job beyond its stored row: progress (step N of total,
tokens/s, ETA, eval loss, the eval-loss curve) read from the job's metrics file, queue position
and wait, and the attempt running now (the stored history holds only the attempts that ended).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from hybridtrain.service.states import WAITING
from hybridtrain.service.store import JobRecord

#: Bytes from the end of a metrics file read for the newest records.
METRICS_TAIL = 64 * 1024
#: Newest step records averaged for the ETA.
ETA_WINDOW = 20
#: Points of the eval-loss curve the page draws (more evaluations are thinned evenly, the last kept).
EVAL_CURVE_POINTS = 200
#: Metrics files whose evaluations are remembered between refreshes (the least recent is dropped).
EVAL_FILES_KEPT = 64


def metrics_path(job: JobRecord) -> Path:
    """``run/metrics.jsonl`` (a training job) or ``metrics.jsonl`` (an HPO trial)."""
    directory = Path(job.job_dir)
    path = directory / "run" / "metrics.jsonl"
    return path if path.is_file() else directory / "metrics.jsonl"


def tail_records(path: Path, limit: int = METRICS_TAIL) -> list[dict[str, Any]]:
    """The JSON objects of the last ``limit`` bytes of ``path`` (a cut first line and any
    line that is no JSON object are skipped); ``[]`` when it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    if size > limit:
        lines = lines[1:]
    records = []
    for line in lines:
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python parses
            continue
        if isinstance(value, dict):
            records.append(value)
    return records


def total_steps(job: JobRecord) -> int | None:
    """``train.steps`` of a training job's config with its overrides; ``None`` for a job that
    runs a command, or a config not readable on this machine."""
    if job.spec.config is None:
        return None
    try:
        from hybridtrain.config.loading import explain_config

        config, _ = explain_config(Path(job.spec.workdir, job.spec.config), job.spec.overrides)
    except (ValueError, OSError):
        return None
    steps = config.train.steps
    return steps if isinstance(steps, int) else None


def _number(value: Any) -> float | None:
    """``value`` as a finite float; ``None`` for anything else (a bool, a string, an integer
    too large for a float, NaN: any program may write the metrics file)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


class EvalPoints:
    """The ``(step, eval_loss)`` of every evaluation record in metrics files, read incrementally:
    a refresh parses only the complete lines appended since the last one (the page asks every
    3 s, and a long run's file is far larger than its evaluations). A file replaced or shrunk
    since (a resumed run rewrites it without the records it will redo) is read again from its
    start. Thread-safe."""

    def __init__(self, kept: int = EVAL_FILES_KEPT) -> None:
        self.kept = kept
        # path -> (inode, bytes parsed, points)
        self._files: OrderedDict[Path, tuple[int, int, list[tuple[float, float]]]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, path: Path) -> list[tuple[float, float]]:
        """The evaluations in ``path`` so far; ``[]`` when it cannot be read."""
        with self._lock:
            inode, offset, points = self._files.pop(path, (-1, 0, []))
            try:
                with path.open("rb") as f:
                    now = os.fstat(f.fileno())
                    if now.st_ino != inode or now.st_size < offset:
                        offset, points = 0, []
                    f.seek(offset)
                    data = f.read()
            except OSError:
                return []
            complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next call
            points = points + [p for p in map(_eval_point, complete.splitlines()) if p is not None]
            self._files[path] = (now.st_ino, offset + len(complete), points)
            while len(self._files) > self.kept:
                self._files.popitem(last=False)
            return list(points)


def _eval_point(line: bytes) -> tuple[float, float] | None:
    """``(step, eval_loss)`` of an evaluation record; ``None`` for any other line."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    step, loss = _number(value.get("step")), _number(value.get("eval_loss"))
    return None if step is None or loss is None else (step, loss)


def thinned(points: list[tuple[float, float]], limit: int = EVAL_CURVE_POINTS) -> list[tuple[float, float]]:
    """At most ``limit`` of ``points``, evenly spaced, the last one always kept."""
    if len(points) <= limit:
        return points
    every = -(-len(points) // limit)
    kept = points[::every]
    return kept if kept[-1] == points[-1] else kept[:limit - 1] + [points[-1]]


#: The evaluations of the jobs' metrics files (one reader for the whole page).
eval_points = EvalPoints()


def progress(job: JobRecord) -> dict[str, Any]:
    """``step``, ``total_steps``, ``loss``, ``tokens_per_s``, ``eval_loss``, ``eval_step``
    and ``eta_s`` (seconds left at the recent step time), each ``None`` when unknown; and
    ``eval_curve`` (``{"steps": [...], "eval_loss": [...]}``, at most
    :data:`EVAL_CURVE_POINTS`, from every evaluation of the run)."""
    steps = [r for r in tail_records(metrics_path(job))
             if _number(r.get("step")) is not None and _number(r.get("loss")) is not None]
    last = steps[-1] if steps else {}
    step = int(last["step"]) if steps else None
    total = total_steps(job)
    times = [t for t in (_number(r.get("step_time_s")) for r in steps[-ETA_WINDOW:]) if t is not None]
    eta = None
    if job.state == "running" and step is not None and total is not None and times:
        eta = max(0, total - step) * sum(times) / len(times)
    evals = eval_points(metrics_path(job))
    curve = thinned(evals)
    return {"step": step, "total_steps": total, "loss": _number(last.get("loss")),
            "tokens_per_s": _number(last.get("tokens_per_s")),
            "eval_loss": evals[-1][1] if evals else None, "eval_step": evals[-1][0] if evals else None, "eta_s": eta,
            "eval_curve": {"steps": [s for s, _ in curve], "eval_loss": [v for _, v in curve]}}


def queue_wait_s(job: JobRecord, now: float | None = None) -> float | None:
    """Seconds a waiting (queued or preempted) job has waited; ``None`` for other states."""
    if job.state not in WAITING:
        return None
    return max(0.0, (now or time.time()) - job.queued_at)


def attempts(job: JobRecord) -> list[dict[str, Any]]:
    """The ended attempts of the job's history, then the one running now (``outcome``
    ``"running"``, its devices and start time) when the job runs."""
    shown = list(job.history)
    if job.state == "running":
        shown.append({"attempt": job.attempt, "outcome": "preempting" if job.preempting else "running",
                      "exit_code": None, "devices": list(job.devices), "reason": job.reason,
                      "started_at": job.started_at})
    return shown
