"""Files we write never overwrite what we read or what another run owns.

Every command that writes a file or directory the user names (``report -o``,
``checkpoint export OUT``, ``profile -o``, ``$HYBRIDTRAIN_METRICS_FILE``) checks its
target here first, before any work: one ``ValueError`` line naming the target, what it
would have overwritten and the way out.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

RUN_MARKERS = ("run.json", "checkpoints", ".hybridtrain.lock")
"""What makes a directory a ``hybridtrain train`` run directory."""


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def check_not_an_input(target: str | Path, inputs: Iterable[str | Path], option: str,
                       nothing_inside: bool = False) -> None:
    """Refuse a ``target`` that is one of ``inputs`` or contains one (writing it would
    destroy what is being read); with ``nothing_inside``, also one inside an input
    directory (a checkpoint's directory is not a place for an export).

    Raises:
        ValueError: one line naming ``option``, the target and the input.
    """
    out = Path(target).resolve()
    for item in inputs:
        source = Path(item).resolve()
        if out == source or source in out.parents and nothing_inside or out in source.parents:
            raise ValueError(f"{option} {target} would overwrite the input {item}: write somewhere else")


def check_new_dir(target: str | Path, option: str, overwrite: bool) -> None:
    """Refuse a directory ``target`` that is a file, or that already holds files unless
    ``overwrite`` (``--overwrite``) was given.

    Raises:
        ValueError: one line naming the target and the way out.
    """
    out = Path(target)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{option} {target} is a file: give a directory")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        held = ", ".join(sorted(p.name for p in out.iterdir())[:3])
        raise ValueError(f"{option} {target} already holds files ({held}, …): give a new or empty directory, "
                         "or --overwrite to replace them")


def check_metrics_file(extra: str | Path, own: str | Path) -> None:
    """Refuse an extra metrics file (``$HYBRIDTRAIN_METRICS_FILE``) that is another run's
    ``metrics.jsonl``: a fresh start would truncate that run's records.

    Raises:
        ValueError: one line naming the file and the run directory it belongs to.
    """
    path, mine = Path(extra).resolve(), Path(own).resolve()
    if path == mine:
        return
    if any((path.parent / marker).exists() for marker in RUN_MARKERS):
        raise ValueError(f"HYBRIDTRAIN_METRICS_FILE={extra} is in another run's directory ({path.parent}); "
                         "point it at a file of its own, or unset it")
