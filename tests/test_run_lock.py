"""One owner per run directory, and a resume that never starts over silently (issue #25's
probe: every way into a run directory another run owns, every way a resume could wipe one)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridtrain.checkpoint import CheckpointError
from hybridtrain.checkpoint.layout import MARKER, commit, file_digests, temporary_dir
from hybridtrain.commands.cli import main
from hybridtrain.config import Config
from hybridtrain.run_lock import (
    LOCK_FILE,
    RANKS_FILE,
    TOKEN_ENV,
    RunDirBusyError,
    acquire,
    own_run_dir,
)
from hybridtrain.trainer import run_training
from tests.tiny_run import tiny_config


def _cfg(out: Path, steps: int = 3, **train: Any) -> Config:
    return tiny_config(out, steps, **{"checkpoint_every": 1, "keep_checkpoints": 2, **train})


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step run: checkpoints step-2 and step-3, metrics.jsonl."""
    out = tmp_path_factory.mktemp("trained") / "run"
    run_training(_cfg(out), progress=False)
    return out


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name not in (LOCK_FILE, RANKS_FILE)}


@pytest.mark.parametrize("way_in", [{}, {"resume": True}, {"overwrite": True}],
                         ids=["train", "resume", "overwrite"])
def test_a_live_runs_directory_refuses_every_way_in_naming_the_holder(trained: Path, tmp_path: Path,
                                                                      way_in: dict[str, Any]) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = _snapshot(run)
    holder = acquire(run)  # the live run (this process, through its own descriptor)
    try:
        with pytest.raises(RunDirBusyError, match=rf"^output directory {run} is in use by another hybridtrain run "
                                                  rf"\(pid {os.getpid()} on host .+ since .+ UTC\)"):
            run_training(_cfg(run, steps=5), progress=False, **way_in)
    finally:
        holder.release()
    assert _snapshot(run) == before  # nothing read, pruned or truncated


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    code = ("import sys, time; from pathlib import Path; from hybridtrain.run_lock import acquire; "
            "lock = acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusyError, match=f"pid {holder.pid} "):
            acquire(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = acquire(tmp_path)  # the kernel dropped the dead process's lock
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == lock.token
    lock.release()


def test_the_launchers_ranks_share_its_lock_and_nobody_elses(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    lock = acquire(tmp_path)
    try:
        monkeypatch.setenv(TOKEN_ENV, lock.token)
        with own_run_dir(tmp_path, rank=0) as mine:
            assert mine is None  # the launcher holds it for every rank, restarts included
        monkeypatch.setenv(TOKEN_ENV, "another launch's token")
        with pytest.raises(RunDirBusyError), own_run_dir(tmp_path, rank=0):
            pass
    finally:
        lock.release()
    # Ranks that outlive their killed launcher still own the directory until they exit.
    with own_run_dir(tmp_path / "orphans", rank=1), pytest.raises(RunDirBusyError, match="ranks of an earlier run"):
        acquire(tmp_path / "orphans")
    acquire(tmp_path / "orphans").release()
    # A start refused before it wrote anything leaves no directory behind.
    fresh = tmp_path / "never-used"
    acquire(fresh).release()
    assert not fresh.exists()


def _corrupt_shards(run: Path) -> None:
    for step in (run / "checkpoints").glob("step-*"):
        shard = next(step.glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[100:104] = b"XXXX"
        shard.write_bytes(bytes(data))


def _uncommit(run: Path) -> None:
    for step in (run / "checkpoints").glob("step-*"):
        (step / MARKER).unlink()


@pytest.mark.parametrize(("damage", "start", "refusal"), [
    (_corrupt_shards, {"resume": True}, r"--resume found no usable checkpoint in .*checkpoints: skipping step-0000003 "
                                        r"\(and 1 older\): .*corrupt \(checksum mismatch\); nothing was changed"),
    (_uncommit, {"resume": True}, r"--resume found no usable checkpoint .*no commit marker COMMITTED"),
    (_uncommit, {}, r"has checkpoint directories up to step-0000003, none of them complete: use --overwrite"),
], ids=["resume-corrupt", "resume-uncommitted", "fresh-uncommitted"])
def test_no_start_replaces_a_run_whose_checkpoints_are_all_unusable(trained: Path, tmp_path: Path, damage: Any,
                                                                   start: dict[str, Any], refusal: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    damage(run)
    before = _snapshot(run)
    with pytest.raises((CheckpointError, ValueError), match=refusal):
        run_training(_cfg(run, steps=5), progress=False, **start)
    assert _snapshot(run) == before
    # The CLI says it in one line, exit 2; --overwrite is the way to start over.
    assert main(["train", "--output-dir", str(run), "--steps", "1", "--no-progress", "--set", "device=cpu",
                 "--set", "data.seq_len=16", "--set", "model.overrides.n_layer=1", *(
                     ["--resume"] if start else [])]) == 2


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = root / f"step-{step:07d}"
    tmp = temporary_dir(path)
    (tmp / "shard").write_bytes(b"weights")
    commit(tmp, path, {"step": step, "params": {}, "setup": {}, "world_size": 1}, file_digests(tmp, ["shard"]))
    if not complete:
        (path / MARKER).unlink()
    return path


def test_pruning_keeps_the_only_good_checkpoint_and_another_timelines_newer_ones(tmp_path: Path) -> None:
    from hybridtrain.checkpoint import prune

    # A run resumed from step 2 (another run's checkpoint): step 5 of this directory's
    # earlier timeline is newer than its start and not its own.
    for step in (1, 2, 5):
        _fake_checkpoint(tmp_path, step)
    own = [_fake_checkpoint(tmp_path, 3), _fake_checkpoint(tmp_path, 4)]
    assert [p.name for p in prune(tmp_path, 1, start=2, own=own)] == ["step-0000003", "step-0000002",
                                                                      "step-0000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000004", "step-0000005"]
    # Newer directories that are not complete never push out the only good one.
    for step in (6, 7):
        _fake_checkpoint(tmp_path, step, complete=False)
    assert [p.name for p in prune(tmp_path, 1)] == ["step-0000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000005", "step-0000006", "step-0000007"]
