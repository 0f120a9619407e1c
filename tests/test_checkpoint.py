"""Checkpoint/resume: exact continuation, atomic writes, refused corrupt/mismatched files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hybridtrain as ht
import hybridtrain.models
from hybridtrain import checkpoint as ckpt
from hybridtrain.checkpoint import CheckpointError
from tests.equivalence import gpt_case

CONFIG = {
    "device": "cpu",
    "gradient_accumulation_steps": 2,
    "fp16": {"enabled": True, "loss_scale_window": 2},
    "activation_checkpointing": {"enabled": True},
    "scheduler": {"type": "cosine", "params": {"warmup_num_steps": 2, "total_num_steps": 8}},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


def _engine(seed: int, config: dict | None = None) -> ht.Engine:
    torch.manual_seed(seed)
    case = gpt_case(dropout=0.1)
    return ht.initialize(case.build(), config or CONFIG, loss_fn=case.loss_fn)


def test_resume_mid_run_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    batches = gpt_case().batches(6)
    full = _engine(0)
    torch.manual_seed(99)
    expected = [full.train_batch(b) for b in batches]

    first = _engine(0)
    torch.manual_seed(99)
    head = [first.train_batch(b) for b in batches[:3]]
    first.save_checkpoint(tmp_path / "ck", client_state={"data_step": 3})
    torch.manual_seed(12345)  # the resumed process starts with other RNG state and weights
    second = _engine(7)
    assert second.load_checkpoint(tmp_path / "ck") == {"data_step": 3}
    tail = [second.train_batch(b) for b in batches[3:]]

    assert head + tail == expected
    assert second.global_step == 6 and second.loss_scale == full.loss_scale
    for k, v in full.model_state_dict().items():
        assert torch.equal(second.model_state_dict()[k], v), k


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(0)
    engine.train_batch(gpt_case().batches(1)[0])
    engine.save_checkpoint(tmp_path / "ck", client_state={"v": 1})
    real_save = torch.save
    calls = {"n": 0}

    def failing_save(obj: object, f: object, *a: object, **k: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(tmp_path / "ck", client_state={"v": 2})
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert _engine(1).load_checkpoint(tmp_path / "ck") == {"v": 1}


def test_backup_is_used_when_the_final_rename_did_not_happen(tmp_path: Path) -> None:
    engine = _engine(0)
    engine.save_checkpoint(tmp_path / "ck", client_state={"v": 1})
    (tmp_path / "ck").rename(tmp_path / ".ck.old-deadbeef")
    with pytest.warns(UserWarning, match="complete backup"):
        assert _engine(1).load_checkpoint(tmp_path / "ck") == {"v": 1}


def test_corrupt_checkpoint_is_refused_and_the_model_untouched(tmp_path: Path) -> None:
    engine = _engine(0)
    engine.save_checkpoint(tmp_path / "ck")
    data = bytearray((tmp_path / "ck" / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "ck" / "model.pt").write_bytes(bytes(data))
    other = _engine(5)
    before = other.model_state_dict()
    with pytest.raises(CheckpointError, match="corrupt"):
        other.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(before[k], v) for k, v in other.model_state_dict().items())
    with pytest.raises(CheckpointError, match="does not exist"):
        other.load_checkpoint(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a hybridtrain checkpoint"):
        other.load_checkpoint(tmp_path / "empty")


def test_mismatched_checkpoint_says_what_differs(tmp_path: Path) -> None:
    _engine(0).save_checkpoint(tmp_path / "ck")
    bf16 = {**CONFIG, "fp16": {"enabled": False}, "bf16": {"enabled": True}}
    with pytest.raises(CheckpointError, match="precision is 'fp16' in the checkpoint but 'bf16' now"):
        _engine(0, bf16).load_checkpoint(tmp_path / "ck")
    wider = ht.initialize(ht.models.build_gpt("gpt-tiny"), {"device": "cpu"}, loss_fn=ht.models.causal_lm_loss)
    with pytest.raises(CheckpointError, match="has shape"):
        wider.load_checkpoint(tmp_path / "ck")


def test_format_version_is_checked(tmp_path: Path) -> None:
    ckpt.save_checkpoint(tmp_path / "x", {"a.pt": {"t": torch.ones(1)}}, {"step": 0})
    files, meta = ckpt.load_checkpoint(tmp_path / "x")
    assert torch.equal(files["a.pt"]["t"], torch.ones(1)) and meta["step"] == 0
    text = (tmp_path / "x" / "meta.json").read_text().replace('"format": 1', '"format": 99')
    (tmp_path / "x" / "meta.json").write_text(text)
    with pytest.raises(CheckpointError, match="format 99"):
        ckpt.load_checkpoint(tmp_path / "x")
