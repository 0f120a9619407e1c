"""Per-step metrics as JSON lines: ``<output_dir>/metrics.jsonl``, and also the file named
by ``HYBRIDTRAIN_METRICS_FILE`` when set (how a hyperparameter search collects them)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_ENV = "HYBRIDTRAIN_METRICS_FILE"


class MetricsLog:
    """Appends one JSON object per record, flushed at once so a crash loses nothing."""

    def __init__(self, path: str | Path) -> None:
        self.paths = [Path(path)]
        extra = os.environ.get(METRICS_ENV)
        if extra and Path(extra).resolve() != self.paths[0].resolve():
            self.paths.append(Path(extra))
        for p in self.paths:
            p.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` to every metrics file."""
        line = json.dumps(record, sort_keys=True) + "\n"
        for p in self.paths:
            with open(p, "a", encoding="utf-8") as fh:
                fh.write(line)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (a resumed run recomputes them)."""
        for p in self.paths:
            if not p.exists():
                continue
            kept = [line for line in p.read_text(encoding="utf-8").splitlines()
                    if line.strip() and _step_of(line) <= step]
            tmp = p.with_name(p.name + ".tmp")
            tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
            os.replace(tmp, p)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0
