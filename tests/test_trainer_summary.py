"""``summary.json``: what a run did stays true after a resume with nothing left to train,
and it lists only checkpoints that are still on disk."""

from __future__ import annotations

import json
from pathlib import Path

from hybridtrain.config import load_config
from hybridtrain.trainer import run_training


def test_summary_lists_kept_checkpoints_and_survives_a_resume_with_nothing_to_train(tmp_path: Path) -> None:
    cfg = load_config({"device": "cpu", "model": {"name": "gpt-tiny", "overrides": {"n_layer": 1}},
                       "data": {"seq_len": 16}, "train_batch_size": 2,
                       "train": {"steps": 3, "output_dir": str(tmp_path), "checkpoint_every": 1,
                                 "keep_checkpoints": 1, "eval_batches": 1}})
    first = run_training(cfg, progress=False)
    on_disk = sorted(str(p) for p in (tmp_path / "checkpoints").iterdir())
    assert first.checkpoints == on_disk == [str(tmp_path / "checkpoints" / "step-0000003")]
    written = (tmp_path / "summary.json").read_text()
    assert json.loads(written)["checkpoints"] == on_disk

    again = run_training(cfg, resume=True, progress=False)
    assert (tmp_path / "summary.json").read_text() == written  # not rewritten with 0 tokens/s and no losses
    assert again.tokens_per_s == first.tokens_per_s > 0 and again.last_loss == first.last_loss is not None
