"""Reading run directories: ``metrics.jsonl`` (one JSON object per step, plus ``eval_loss``
lines), ``config.json`` and ``summary.json``, as ``hybridtrain train`` writes them.

Every problem is a :class:`ReportError` whose message is one line naming the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
CONFIG = "config.json"
SUMMARY = "summary.json"

# Step-time parts as the trainer records them (``wall_clock_breakdown``), in display order.
TIMING_KEYS = {
    "data_s": "data loading",
    "forward_s": "forward",
    "backward_s": "backward",
    "forward_backward_interleaved_s": "forward+backward (interleaved)",
    "step_s": "optimizer step",
}
# Seconds that are not a part of the step: the whole step, and checkpoint saving.
STEP_TIME = "step_time_s"
NOT_PARTS = frozenset({STEP_TIME, "checkpoint_s"})


class ReportError(Exception):
    """Bad input for a report; the message is one line naming the file."""


@dataclass
class Run:
    """One run: its per-step records (sorted by step, one per step), eval losses, config."""

    path: Path
    name: str
    steps: list[dict[str, Any]]
    evals: list[tuple[int, float]]
    config: dict[str, Any] | None
    summary: dict[str, Any] | None
    timing_keys: list[str] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of ``key`` where the record has a number for it."""
        xs, ys = [], []
        for rec in self.steps:
            value = rec.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                xs.append(int(rec["step"]))
                ys.append(float(value))
        return xs, ys

    def has(self, key: str) -> bool:
        return any(isinstance(rec.get(key), (int, float)) for rec in self.steps)


def load_run(path: str | Path) -> Run:
    """Read one run directory (or its ``metrics.jsonl`` given directly).

    Raises:
        ReportError: no such directory, no ``metrics.jsonl``, a line that is not a JSON
            object with an integer ``step``, or an unreadable ``config.json``/``summary.json``.
    """
    p = Path(path)
    if p.is_file() and p.suffix == ".jsonl":
        metrics, directory = p, p.parent
    elif p.is_dir():
        metrics, directory = p / METRICS, p
        if not metrics.is_file():
            raise ReportError(f"{metrics}: not found ({p} is not a run directory: "
                              f"`hybridtrain train` writes {METRICS} into its output directory)")
    elif p.exists():
        raise ReportError(f"{p}: not a run directory or a {METRICS} file")
    else:
        raise ReportError(f"{p}: no such directory")
    steps, evals = _read_metrics(metrics)
    config = _read_json(directory / CONFIG)
    summary = _read_json(directory / SUMMARY)
    run = Run(path=directory, name=directory.name or str(directory), steps=steps, evals=evals,
              config=config, summary=summary)
    known = [k for k in TIMING_KEYS if run.has(k)]
    other = sorted({k for rec in steps for k, v in rec.items()
                    if k.endswith("_s") and "_per_" not in k and k not in TIMING_KEYS and k not in NOT_PARTS
                    and isinstance(v, (int, float))})
    run.timing_keys = known + other
    return run


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Read every run; runs whose directory names clash are named by their paths."""
    runs = [load_run(p) for p in paths]
    names = [r.name for r in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = str(run.path)
    return runs


def _read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[tuple[int, float]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot read ({_reason(exc)})") from None
    by_step: dict[int, dict[str, Any]] = {}
    evals: dict[int, float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReportError(f"{path} line {number}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise ReportError(f"{path} line {number}: expected a JSON object, got {type(record).__name__}")
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ReportError(f"{path} line {number}: no integer 'step' field")
        if "loss" not in record and "eval_loss" in record:
            value = record["eval_loss"]
            if isinstance(value, (int, float)):
                evals[step] = float(value)
            continue
        # Records of one step merge (the step's metrics, then its checkpoint's seconds and
        # bytes); a step written twice (a resumed run appending to $HYBRIDTRAIN_METRICS_FILE)
        # keeps the later values.
        by_step.setdefault(step, {}).update(record)
        if isinstance(record.get("eval_loss"), (int, float)):
            evals[step] = float(record["eval_loss"])
    return [by_step[s] for s in sorted(by_step)], sorted(evals.items())


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot read ({_reason(exc)})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc).splitlines()[0]


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; lists and scalars are leaves."""
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data} if prefix else {}


_MISSING = object()


def config_differences(runs: list[Run]) -> list[tuple[str, list[Any]]]:
    """Keys (flattened, sorted) whose values are not the same in every run that has a
    config, with each run's value (``None`` printed as ``null``; absent as the ``MISSING``
    marker). Runs without ``config.json`` are left out of the comparison."""
    flat = [flatten(r.config) if r.config is not None else None for r in runs]
    present = [f for f in flat if f is not None]
    if len(present) < 2:
        return []
    keys = sorted({k for f in present for k in f})
    rows = []
    for key in keys:
        values = [f.get(key, _MISSING) if f is not None else _MISSING for f in flat]
        compared = [_canonical(f.get(key, _MISSING)) for f in present]
        if len(set(compared)) > 1:
            rows.append((key, values))
    return rows


def is_missing(value: Any) -> bool:
    return value is _MISSING


def _canonical(value: Any) -> str:
    if value is _MISSING:
        return "\0missing"
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        value = int(value)  # 1.0 and 1 are the same setting
    return json.dumps(value, sort_keys=True)
