"""Run directories: the start decision (a pure value) and ``--overwrite``'s removal."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridtrain.run_dir import TRASH_PREFIX, Start, clear_run, decide_start, remove_trash


def test_a_fresh_start_into_checkpoints_is_refused_naming_both_ways_out(tmp_path: Path) -> None:
    newest = tmp_path / "checkpoints" / "step-0000120"
    with pytest.raises(ValueError, match=rf"^output directory {tmp_path} has checkpoints up to step 120: "
                                         r"use --resume to continue or --overwrite to start over$"):
        decide_start(tmp_path, newest, resume=False, overwrite=False, restart=0)
    assert decide_start(tmp_path, None, resume=False, overwrite=False, restart=0) == Start("fresh")


@pytest.mark.parametrize(("resume", "overwrite", "restart", "newest", "expected"), [
    (True, False, 0, "step-0000003", Start("resume")),
    ("ckpt/step-0000002", False, 0, "step-0000003", Start("resume", "ckpt/step-0000002")),
    (False, True, 0, "step-0000003", Start("overwrite")),
    # A restart resumes the run's own newest checkpoint whatever the first round was told:
    # --overwrite must not wipe it, an explicit --resume path is older than it.
    (False, False, 1, "step-0000003", Start("resume", None, 1)),
    (False, True, 2, "step-0000003", Start("resume", None, 2)),
    ("ckpt/step-0000002", False, 1, "step-0000003", Start("resume", None, 1)),
    ("ckpt/step-0000002", False, 1, None, Start("resume", "ckpt/step-0000002", 1)),
    (False, False, 1, None, Start("resume", None, 1)),
])
def test_resume_overwrite_and_restarts(tmp_path: Path, resume: bool | str, overwrite: bool, restart: int,
                                       newest: str | None, expected: Start) -> None:
    found = tmp_path / "checkpoints" / newest if newest else None
    assert decide_start(tmp_path, found, resume, overwrite, restart) == expected


def test_resume_with_overwrite_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--resume and --overwrite contradict each other"):
        decide_start(tmp_path, None, resume=True, overwrite=True, restart=0)


def test_clear_run_removes_the_run_files_and_keeps_the_rest(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "step-0000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-0000001" / "model.pt").write_bytes(b"x")
    for name in ("metrics.jsonl", "summary.json", "config.json", "notes.txt"):
        (tmp_path / name).write_text("{}")
    (tmp_path / f"{TRASH_PREFIX}dead").mkdir()  # left by a crash inside an earlier clear_run
    clear_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_crash_mid_clear_leaves_whole_files_in_the_trash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "checkpoints" / "step-0000001").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    import shutil

    def crash(path: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        clear_run(tmp_path)
    monkeypatch.undo()
    # Nothing half-deleted: the old run is complete, but out of the way, in the trash.
    trash = [p for p in tmp_path.iterdir() if p.name.startswith(TRASH_PREFIX)]
    assert [p.name for p in tmp_path.iterdir() if p not in trash] == []
    assert (trash[0] / "checkpoints" / "step-0000001").is_dir() and (trash[0] / "metrics.jsonl").exists()
    remove_trash(tmp_path)
    assert list(tmp_path.iterdir()) == []
