"""Checkpoint/resume: exact continuation, atomic writes, refused corrupt/mismatched files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import hybridtrain as ht
import hybridtrain.models
from hybridtrain import checkpoint as ckpt
from hybridtrain.checkpoint import CheckpointError, IncompleteCheckpointError
from hybridtrain.runtime.device import get_rng_state as torch_rng
from tests.equivalence import gpt_case

CONFIG = {
    "device": "cpu",
    "gradient_accumulation_steps": 2,
    "fp16": {"enabled": True, "loss_scale_window": 2},
    "activation_checkpointing": {"enabled": True},
    "scheduler": {"type": "cosine", "params": {"warmup_num_steps": 2, "total_num_steps": 8}},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}
PLAIN = {"device": "cpu", "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


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

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", disk_full)
    with pytest.raises(CheckpointError, match="saving checkpoint .* failed: .*No space left"):
        engine.save_checkpoint(tmp_path / "ck", client_state={"v": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert _engine(1).load_checkpoint(tmp_path / "ck") == {"v": 1}


def test_backup_is_used_when_the_final_rename_did_not_happen(tmp_path: Path) -> None:
    engine = _engine(0)
    engine.save_checkpoint(tmp_path / "ck", client_state={"v": 1})
    (tmp_path / "ck").rename(tmp_path / ".ck.old-deadbeef")
    with pytest.warns(UserWarning, match="complete backup"):
        assert _engine(1).load_checkpoint(tmp_path / "ck") == {"v": 1}


def test_corrupt_or_incomplete_checkpoint_is_refused_and_the_model_untouched(tmp_path: Path) -> None:
    engine = _engine(0)
    engine.save_checkpoint(tmp_path / "ck")
    shard = tmp_path / "ck" / "__0_0.distcp"
    good = shard.read_bytes()
    other = _engine(5)
    before = other.model_state_dict()
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(IncompleteCheckpointError, match="corrupt"):
        other.load_checkpoint(tmp_path / "ck")
    shard.write_bytes(good[:-10])
    with pytest.raises(IncompleteCheckpointError, match="incomplete: __0_0.distcp has"):
        other.load_checkpoint(tmp_path / "ck")
    shard.write_bytes(good)
    (tmp_path / "ck" / "COMMITTED").unlink()
    with pytest.raises(IncompleteCheckpointError, match="no commit marker"):
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
    _engine(0).save_checkpoint(tmp_path / "x")
    text = (tmp_path / "x" / "meta.json").read_text().replace('"format": 2', '"format": 99')
    (tmp_path / "x" / "meta.json").write_text(text)
    with pytest.raises(CheckpointError, match="format 99; this version reads 1 and 2"):
        _engine(0).load_checkpoint(tmp_path / "x")


def _write_format_1(engine: ht.Engine, path: Path, client_state: dict) -> None:
    """A checkpoint as hybridtrain wrote it before format 2 (model.pt, engine.pt, meta.json)."""
    path.mkdir()
    model = engine.model_state_dict()
    torch.save(model, path / "model.pt")
    torch.save({"optimizer": engine.optimizer.state_dict(), "scheduler": engine.scheduler.state_dict(),
                "scaler": engine.scaler.state_dict(), "global_step": engine.global_step, "nonfinite_skips": 0,
                "rng": torch_rng(), "client_state": client_state}, path / "engine.pt")
    files = {n: hashlib.sha256((path / n).read_bytes()).hexdigest() for n in ("model.pt", "engine.pt")}
    meta = {"format": 1, "step": engine.global_step, "params": {k: list(v.shape) for k, v in model.items()},
            "setup": engine.options.setup, "files": files}
    (path / "meta.json").write_text(json.dumps(meta))


def test_format_1_checkpoints_still_resume_exactly(tmp_path: Path) -> None:
    batches = gpt_case().batches(4)
    full = _engine(0)
    torch.manual_seed(99)
    expected = [full.train_batch(b) for b in batches]
    first = _engine(0)
    torch.manual_seed(99)
    losses = [first.train_batch(b) for b in batches[:2]]
    _write_format_1(first, tmp_path / "old", {"data_step": 2})
    second = _engine(3)
    assert second.load_checkpoint(tmp_path / "old") == {"data_step": 2}
    assert losses + [second.train_batch(b) for b in batches[2:]] == expected
    second.save_checkpoint(tmp_path / "new")  # the next save writes format 2
    assert json.loads((tmp_path / "new" / "meta.json").read_text())["format"] == 2


def test_background_save_holds_the_state_of_the_moment_it_was_called(tmp_path: Path) -> None:
    batches = gpt_case().batches(3)
    full = _engine(0, PLAIN)
    torch.manual_seed(99)
    expected = [full.train_batch(b) for b in batches]
    first = _engine(0, PLAIN)
    torch.manual_seed(99)
    head = [first.train_batch(b) for b in batches[:1]]
    first.save_checkpoint(tmp_path / "ck", client_state={"data_step": 1}, async_save=True)
    first.train_batch(batches[1])  # training goes on while the files are written
    assert ckpt.wait_for_pending() == tmp_path / "ck"
    second = _engine(3, PLAIN)
    assert second.load_checkpoint(tmp_path / "ck") == {"data_step": 1}
    assert head + [second.train_batch(b) for b in batches[1:]] == expected
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_streamed_and_plain_runs_read_each_others_checkpoints(tmp_path: Path) -> None:
    """Layer streaming's optimizer updates host masters; its state is still keyed by the
    model's parameter names, so a plain run continues it (and the other way round)."""
    batches = gpt_case().batches(4)
    plain = PLAIN
    streamed = {**plain, "layer_streaming": {"enabled": True}}
    straight = _engine(0, plain)
    expected = [straight.train_batch(b) for b in batches]
    for saver, loader in ((streamed, plain), (plain, streamed)):
        first = _engine(0, saver)
        losses = [first.train_batch(b) for b in batches[:2]]
        first.save_checkpoint(tmp_path / "ck")
        second = _engine(4, loader)
        second.load_checkpoint(tmp_path / "ck")
        losses += [second.train_batch(b) for b in batches[2:]]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
