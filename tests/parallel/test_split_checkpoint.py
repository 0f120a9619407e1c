"""Checkpoints of a split model (pipeline or tensor parallel) resume exactly: every
stage's optimizer state is in the checkpoint, not only rank 0's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.parallel.scenarios import assert_resumed_exactly, resume_round_trip
from tests.parallel.spawn import run_ranks

SPLITS = {
    "pp2": {"pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 2, "partition": "params"}},
    "tp2": {"tensor_parallel": {"size": 2}},
}


def _resume_runs(ckpt_dir: str) -> dict[str, dict[str, Any]]:
    return {name: resume_round_trip("gpt_tied", config, f"{ckpt_dir}/{name}") for name, config in SPLITS.items()}


def test_split_model_checkpoints_resume_exactly(tmp_path: Path) -> None:
    ranks = run_ranks(_resume_runs, 2, str(tmp_path), timeout=180)
    for name in SPLITS:
        for rank in ranks:
            assert_resumed_exactly(rank[name])
