"""The page's eval-loss curve: every evaluation of a metrics file, read incrementally (only the
complete lines appended since the last refresh), read again when a resumed run rewrites the
file, and thinned evenly to what the page draws."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridtrain.service.page_progress import EvalPoints, thinned


def _append(path: Path, *records: dict[str, object], tail: str = "") -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_evaluations_are_read_incrementally_and_again_after_a_rewrite(tmp_path: Path) -> None:
    path, points = tmp_path / "metrics.jsonl", EvalPoints(kept=1)
    assert points(path) == []  # no file yet
    _append(path, {"step": 1, "loss": 3.0}, {"step": 2, "eval_loss": 2.5}, {"step": 2, "loss": True},
            tail='{"step": 3, "eval_lo')  # a line still being written
    assert points(path) == [(2, 2.5)]
    with path.open("a") as f:  # it is finished; lines that are no evaluation are passed over
        f.write('ss": 2.75}\nnot json\n[1]\n{"step": 6, "eval_loss": NaN}\n')
    _append(path, {"step": 4, "eval_loss": 2.25})
    assert points(path) == [(2, 2.5), (3, 2.75), (4, 2.25)]
    # A resumed run rewrites the file (a new file over the old) without the records it will redo.
    rewritten = tmp_path / "metrics.jsonl.tmp"
    rewritten.write_text(json.dumps({"step": 2, "eval_loss": 2.5}) + "\n" + json.dumps({"step": 9, "loss": 1.0}) * 9)
    os.replace(rewritten, path)
    assert points(path) == [(2, 2.5)]
    other = tmp_path / "other.jsonl"  # a second file pushes the first out (kept=1): still right
    _append(other, {"step": 1, "eval_loss": 1.5})
    assert points(other) == [(1, 1.5)] and points(path) == [(2, 2.5)]


def test_a_long_curve_is_thinned_evenly_with_its_last_point() -> None:
    points = [(float(step), 1.0 / step) for step in range(1, 1002)]
    kept = thinned(points, 200)
    assert len(kept) <= 200 and kept[0] == points[0] and kept[-1] == points[-1]
    steps = [s for s, _ in kept[:-1]]
    assert len({b - a for a, b in zip(steps, steps[1:], strict=False)}) == 1  # evenly spaced
    assert thinned(points[:5], 200) == points[:5]
