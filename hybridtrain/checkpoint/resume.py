"""Which checkpoint a run continues from: the newest complete one, falling back past a
newest one that is incomplete or corrupt (a crash mid-save, a truncated copy)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hybridtrain.checkpoint.layout import (
    CheckpointError,
    IncompleteCheckpointError,
    complete_checkpoints,
)

T = TypeVar("T")


class NoUsableCheckpointError(CheckpointError):
    """A resume found checkpoint directories but none it can load: refused, nothing changed."""


def latest_complete(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` that passes the cheap completeness checks
    (commit marker, every file present with its size); None when there is none."""
    return next((path for path, problem in complete_checkpoints(root) if problem is None), None)


def resume_newest(root: Path, load: Callable[[Path], T], say: Callable[[str], None],
                  refuse: bool = False) -> tuple[Path, T] | None:
    """Load the newest usable checkpoint under ``root`` with ``load`` (every rank calls it).

    A checkpoint that is incomplete, or that ``load`` finds corrupt
    (:class:`IncompleteCheckpointError`, raised before anything is modified), is passed
    over for the next older one, and ``say`` gets one line naming what was skipped and why.
    Other errors (a checkpoint of another model or setup) propagate: an older checkpoint
    of the same run would not fit either.

    Args:
        refuse: raise instead of returning None when there are checkpoint directories
            but none is usable (a resume must never start over silently).

    Returns:
        ``(path, load's result)``, or None when no checkpoint is usable.

    Raises:
        NoUsableCheckpointError: with ``refuse``, every checkpoint was skipped; the
            message names them and why.
    """
    skipped: list[tuple[Path, str]] = []
    for path, problem in complete_checkpoints(root):
        if problem is None:
            try:
                result = load(path)
            except IncompleteCheckpointError as exc:
                problem = str(exc)
            else:
                if skipped:
                    say(_skipped_line(skipped, f"continuing from {path.name}"))
                return path, result
        skipped.append((path, problem))
    if skipped and refuse:
        why = _skipped_line(skipped, "nothing was changed")[len("resume: "):]
        raise NoUsableCheckpointError(f"--resume found no usable checkpoint in {root}: {why}; repair or move them "
                                      "away, or use --overwrite to start over")
    if skipped:
        say(_skipped_line(skipped, "no complete checkpoint is left"))
    return None


def _skipped_line(skipped: list[tuple[Path, str]], then: str) -> str:
    path, why = skipped[0]
    more = f" (and {len(skipped) - 1} older)" if len(skipped) > 1 else ""
    return f"resume: skipping {path.name}{more}: {why}; {then}"
