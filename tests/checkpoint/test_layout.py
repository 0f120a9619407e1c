"""The checkpoint directory protocol: cleanup of saves that cannot finish, and resuming
past a newest checkpoint that is incomplete or corrupt."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import hybridtrain as ht
from hybridtrain import checkpoint as ckpt
from hybridtrain.checkpoint import layout
from tests.equivalence import gpt_case


def _tmp_dir(root: Path, name: str, owner: dict | None) -> Path:
    path = root / f".{name}.tmp-abc"
    path.mkdir(parents=True)
    if owner is not None:
        (path / layout.OWNER).write_text(json.dumps(owner))
    (path / "__0_0.distcp").write_bytes(b"x")
    return path


def test_partial_saves_are_removed_unless_they_may_still_be_running(tmp_path: Path) -> None:
    import socket

    host = socket.gethostname()
    dead = _tmp_dir(tmp_path, "step-1", {"host": host, "pid": 2**22 + 12345})
    ours = _tmp_dir(tmp_path, "step-2", {"host": host, "pid": os.getpid()})  # our own save in flight
    foreign_old = _tmp_dir(tmp_path, "step-3", {"host": "elsewhere", "pid": 1})
    foreign_new = _tmp_dir(tmp_path, "step-4", {"host": "elsewhere", "pid": 1})
    no_owner = _tmp_dir(tmp_path, "step-5", None)
    old = time.time() - 2 * layout.FOREIGN_GRACE_S
    for f in [foreign_old, *foreign_old.iterdir()]:
        os.utime(f, (old, old))
    removed = ckpt.remove_partial(tmp_path)
    assert sorted(removed) == sorted([dead, foreign_old, no_owner])
    assert ours.exists() and foreign_new.exists()


def _engine() -> ht.Engine:
    torch.manual_seed(0)
    case = gpt_case()
    return ht.initialize(case.build(), {"device": "cpu"}, loss_fn=case.loss_fn)


def test_resume_falls_back_past_a_corrupt_or_unfinished_newest_checkpoint(tmp_path: Path) -> None:
    engine = _engine()
    batches = gpt_case().batches(2)
    for step, batch in enumerate(batches, 1):
        engine.train_batch(batch)
        engine.save_checkpoint(tmp_path / f"step-{step:07d}", client_state={"data_step": step})
    shard = tmp_path / "step-0000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    said: list[str] = []
    resumed = _engine()
    assert ckpt.latest_complete(tmp_path) == tmp_path / "step-0000002"  # the cheap checks pass
    path, client = ckpt.resume_newest(tmp_path, resumed.load_checkpoint, said.append)
    assert (path.name, client, resumed.global_step) == ("step-0000001", {"data_step": 1}, 1)
    assert len(said) == 1 and said[0].startswith("resume: skipping step-0000002: checkpoint ")
    assert "corrupt" in said[0] and said[0].endswith("continuing from step-0000001")

    (tmp_path / "step-0000003").mkdir()  # a directory without a commit marker is no checkpoint
    (tmp_path / "step-0000003" / layout.META).write_text(json.dumps({"format": 2, "files": {}}))
    assert ckpt.latest_complete(tmp_path) == tmp_path / "step-0000002"
    said.clear()
    path, _ = ckpt.resume_newest(tmp_path, _engine().load_checkpoint, said.append)
    assert path.name == "step-0000001"
    assert said == [said[0]] and "step-0000003 (and 1 older)" in said[0] and "no commit marker" in said[0]


def test_a_checkpoint_of_another_model_is_not_skipped_silently(tmp_path: Path) -> None:
    _engine().save_checkpoint(tmp_path / "step-0000001")
    wider = ht.initialize(ht.models.build_gpt("gpt-tiny"), {"device": "cpu"}, loss_fn=ht.models.causal_lm_loss)
    with pytest.raises(ckpt.CheckpointError, match="does not match this run"):
        ckpt.resume_newest(tmp_path, wider.load_checkpoint, print)
