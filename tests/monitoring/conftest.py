"""Helpers of the monitoring tests: a tiny, fast training config and a free port."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

TINY: dict[str, Any] = {
    "model": {"name": "gpt-tiny", "overrides": {"n_layer": 1}},
    "data": {"seq_len": 32},
    "train_batch_size": 4,
    "device": "cpu",
    "steps_per_print": 100,
    "wall_clock_breakdown": True,
    "scheduler": {"type": "linear", "params": {"warmup_num_steps": 2, "total_num_steps": 20}},
    "train": {"steps": 6, "eval_batches": 1, "eval_every": 3, "checkpoint_every": 2},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def tiny(tmp_path: Path) -> dict[str, Any]:
    """The tiny config writing to ``tmp_path/run`` (a fresh deep copy per test)."""
    import copy

    cfg = copy.deepcopy(TINY)
    cfg["train"]["output_dir"] = str(tmp_path / "run")
    return cfg
