"""The smallest CPU training config the run-directory, output and checkpoint-safety tests
train: a one-layer reference GPT on 16-token windows, two sequences a step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridtrain.config import Config, load_config


def tiny_config(out: Path, steps: int = 1, **train: Any) -> Config:
    """A validated config training ``steps`` steps into ``out`` (``train`` adds keys of the
    ``train`` section)."""
    return load_config({"device": "cpu", "model": {"overrides": {"n_layer": 1, "d_model": 32, "n_head": 2}},
                        "data": {"seq_len": 16}, "train_batch_size": 2,
                        "train": {"steps": steps, "output_dir": str(out), "eval_batches": 1, **train}})
