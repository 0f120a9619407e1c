"""Checkpoints of a split model (pipeline or tensor parallel) resume exactly: every
stage's optimizer state is in the checkpoint, not only rank 0's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import hybridtrain as ht
from tests.equivalence import SEED, Mode, engine_config, model_cases
from tests.parallel.spawn import run_ranks

SPLITS = {
    "pp2": {"pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 2, "partition": "params"}},
    "tp2": {"tensor_parallel": {"size": 2}},
}


def _resume_runs(ckpt_dir: str) -> dict[str, dict[str, Any]]:
    return {name: _resume_run(config, f"{ckpt_dir}/{name}") for name, config in SPLITS.items()}


def _resume_run(config: dict[str, Any], ckpt_dir: str) -> dict[str, Any]:
    """4 steps straight; 2 steps, save, a fresh engine loads, 2 more steps."""
    case = model_cases()["gpt_tied"]
    batches = case.batches(4)

    def engine() -> ht.Engine:
        torch.manual_seed(SEED)
        return ht.initialize(case.build(), engine_config(Mode("split", config)), loss_fn=case.loss_fn)

    straight = engine()
    expected = [straight.train_batch(straight.local_batch(b)) for b in batches]
    first = engine()
    losses = [first.train_batch(first.local_batch(b)) for b in batches[:2]]
    first.save_checkpoint(Path(ckpt_dir) / "ckpt", client_state={"step": 2})
    resumed = engine()
    client = resumed.load_checkpoint(Path(ckpt_dir) / "ckpt")
    losses += [resumed.train_batch(resumed.local_batch(b)) for b in batches[2:]]
    return {"expected": expected, "resumed": losses, "client": client,
            "final": resumed.model_state_dict(), "straight": straight.model_state_dict()}


def test_split_model_checkpoints_resume_exactly(tmp_path: Path) -> None:
    ranks = run_ranks(_resume_runs, 2, str(tmp_path), timeout=180)
    for name in SPLITS:
        for rank in ranks:
            out = rank[name]
            assert out["client"] == {"step": 2}
            torch.testing.assert_close(torch.tensor(out["resumed"]), torch.tensor(out["expected"]),
                                       rtol=1e-6, atol=0, msg=lambda m, n=name: f"{n}: {m}")
            for key, value in out["straight"].items():
                torch.testing.assert_close(out["final"][key], value, rtol=1e-6, atol=1e-7)
