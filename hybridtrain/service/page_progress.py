"""What the jobs page shows of a job beyond its stored row: progress (step N of total,
tokens/s, ETA, eval loss) read from the job's metrics file, queue position and wait, and the
attempt running now (the stored history holds only the attempts that ended).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from hybridtrain.service.states import WAITING
from hybridtrain.service.store import JobRecord

#: Bytes from the end of a metrics file read for the newest records.
METRICS_TAIL = 64 * 1024
#: Newest step records averaged for the ETA.
ETA_WINDOW = 20


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


def progress(job: JobRecord) -> dict[str, Any]:
    """``step``, ``total_steps``, ``loss``, ``tokens_per_s``, ``eval_loss``, ``eval_step``
    and ``eta_s`` (seconds left at the recent step time); each ``None`` when unknown."""
    steps = [r for r in tail_records(metrics_path(job))
             if _number(r.get("step")) is not None and _number(r.get("loss")) is not None]
    evals = [r for r in tail_records(metrics_path(job)) if _number(r.get("eval_loss")) is not None]
    last = steps[-1] if steps else {}
    step = int(last["step"]) if steps else None
    total = total_steps(job)
    times = [t for t in (_number(r.get("step_time_s")) for r in steps[-ETA_WINDOW:]) if t is not None]
    eta = None
    if job.state == "running" and step is not None and total is not None and times:
        eta = max(0, total - step) * sum(times) / len(times)
    return {"step": step, "total_steps": total, "loss": _number(last.get("loss")),
            "tokens_per_s": _number(last.get("tokens_per_s")),
            "eval_loss": _number(evals[-1]["eval_loss"]) if evals else None,
            "eval_step": _number(evals[-1].get("step")) if evals else None, "eta_s": eta}


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
