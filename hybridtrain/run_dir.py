"""Run directories: how a start of ``hybridtrain train`` treats ``train.output_dir``.

Three ways in, decided before anything is built (:func:`decide_start`, a pure value):

- *resume*: ``--resume`` was given, or torchrun restarted the worker group after a failure
  (``TORCHELASTIC_RESTART_COUNT > 0``): continue from the newest complete checkpoint of the
  directory. A restart resumes even when the first round was started with ``--overwrite``,
  so it never wipes its own run.
- *fresh*: the directory has no checkpoint; records of an earlier round that died before
  its first checkpoint are dropped from ``metrics.jsonl``.
- *overwrite*: ``--overwrite``; the earlier run's checkpoints and metrics are moved into a
  hidden trash directory by atomic renames and then deleted (:func:`clear_run`). A crash in
  between leaves a trash directory, never a half-deleted checkpoint; the next start
  removes it.

A fresh start into a directory that has checkpoints is refused in one line.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

RUN_FILE = "run.json"
"""The run's global batch (``{"train_batch_size": N}``): a resume on another world size keeps it."""
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.json", RUN_FILE)
"""What ``hybridtrain train`` writes at the top of ``train.output_dir`` (``--overwrite`` removes these)."""
TRASH_PREFIX = ".overwritten-"


@dataclass(frozen=True)
class Start:
    """How this start treats the output directory.

    Attributes:
        mode: ``resume``, ``fresh`` or ``overwrite``.
        checkpoint: with ``resume``, an explicit checkpoint to load (None = the newest).
        restart: torchrun's restart round (0 = first start).
    """

    mode: Literal["resume", "fresh", "overwrite"]
    checkpoint: str | None = None
    restart: int = 0


def decide_start(out: Path, newest: Path | None, resume: bool | str, overwrite: bool, restart: int,
                 present: Path | None = None) -> Start:
    """Decide how to start in ``out`` whose newest complete checkpoint is ``newest``;
    ``present`` is its newest checkpoint directory, complete or not: a fresh start must
    not replace a run whose checkpoints are all incomplete either.

    Raises:
        ValueError: ``--resume`` with ``--overwrite``, or a fresh start into a directory
            that has checkpoints (the message says both ways out).
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite contradict each other: give one")
    if restart > 0:
        # The group restarted after a failure: the newest checkpoint of this run, whatever
        # the first round was told (an explicit --resume path only while none is newer).
        explicit = resume if isinstance(resume, str) and newest is None else None
        return Start("resume", explicit, restart)
    if resume:
        return Start("resume", resume if isinstance(resume, str) else None)
    if overwrite:
        return Start("overwrite")
    if newest is not None:
        raise ValueError(f"output directory {out} has checkpoints up to step {checkpoint_step(newest)}: "
                         "use --resume to continue or --overwrite to start over")
    if present is not None:
        raise ValueError(f"output directory {out} has checkpoint directories up to {present.name}, none of them "
                         "complete: use --overwrite to start over (or move them away)")
    return Start("fresh")


def newest_checkpoint_dir(root: Path) -> Path | None:
    """The newest ``step-*`` directory under ``root``, complete or not (None when there is none)."""
    return max((p for p in root.glob("step-*") if p.is_dir()), default=None)


def checkpoint_step(path: Path) -> str:
    """The step in a ``step-NNNNNNN`` checkpoint name (the name itself when it has none)."""
    tail = path.name.rpartition("-")[2]
    return str(int(tail)) if tail.isdigit() else path.name


def clear_run(out: Path) -> None:
    """Remove an earlier run's files from ``out`` (see the module docstring): each is
    renamed into one trash directory first, so what is left after a crash is either
    untouched or entirely in the trash.

    Raises:
        OSError: the directory cannot be written (read-only, gone).
    """
    remove_trash(out)
    present = [out / name for name in RUN_FILES if (out / name).exists()]
    if not present:
        return
    trash = out / f"{TRASH_PREFIX}{uuid.uuid4().hex[:8]}"
    trash.mkdir()
    for path in present:
        path.rename(trash / path.name)
    shutil.rmtree(trash)


def remove_trash(out: Path) -> None:
    """Delete what an interrupted :func:`clear_run` left behind."""
    for trash in out.glob(f"{TRASH_PREFIX}*"):
        shutil.rmtree(trash, ignore_errors=True)


def previous_global_batch(out: Path) -> int | None:
    """The global batch the run in ``out`` trained with, if it says (:data:`RUN_FILE`)."""
    try:
        return int(json.loads((out / RUN_FILE).read_text(encoding="utf-8"))["train_batch_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_global_batch(out: Path, global_batch: int) -> None:
    """Write :data:`RUN_FILE` (the writer rank, at every start)."""
    (out / RUN_FILE).write_text(json.dumps({"train_batch_size": global_batch}) + "\n", encoding="utf-8")
