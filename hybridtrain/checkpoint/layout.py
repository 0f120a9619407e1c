"""The checkpoint directory: how one appears atomically, how a complete one is told from a
partial one, and what is cleaned up.

::

    checkpoints/
      .step-0000120.tmp-3f9a…/     being written: owner.json (host, pid of the writer rank),
                                   every rank's shard files (__<rank>_0.distcp), .metadata
      step-0000100/                complete: the shards, .metadata, meta.json, COMMITTED

A save writes into a hidden temporary sibling; when every rank has finished its shards,
the writer rank (rank 0) writes ``meta.json`` (step, parameter shapes, the settings a
resume must share, the size and SHA-256 of every file), then ``COMMITTED`` (the SHA-256 of
``meta.json``), syncs, and renames the directory into place. A directory without a
valid marker is not a checkpoint. Overwriting a path moves the old checkpoint aside first
(``.<name>.old-*``) and deletes it after the rename, so a crash never loses both.

Cleanup (:func:`remove_partial`, at the next start, by the writer rank): a temporary
directory is removed unless it may still be in progress — its writer's process is alive
on this host, or it was written by another host in the last :data:`FOREIGN_GRACE_S`
seconds (its process cannot be checked from here).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

FORMAT_VERSION = 2
META = "meta.json"
MARKER = "COMMITTED"
OWNER = "owner.json"
FOREIGN_GRACE_S = 600.0
"""How long a temporary directory written by another host counts as possibly in progress."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or does not match what loads it."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint whose files are missing, truncated or corrupt (an older one may serve)."""


def temporary_dir(path: Path) -> Path:
    """Create the hidden sibling a save of ``path`` writes into, with ``owner.json``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    (tmp / OWNER).write_text(json.dumps(owner))
    return tmp


def plain_file_problem(directory: Path, name: Any) -> str | None:
    """Why ``name`` is not a plain regular file directly inside the checkpoint ``directory``
    (None when it is): a checkpoint reads only its own files.

    Refused: a name that is not a plain file name (absolute, ``..``, a subdirectory, NUL), a
    missing file, a symbolic link that leads out of ``directory``, and anything but a regular
    file (a FIFO would block the read forever, a device never end). Checked with ``lstat``
    and ``stat`` before anything is opened.
    """
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        return "is not the name of a file inside the checkpoint"
    target = directory / name
    try:
        mode = os.lstat(target).st_mode
        if stat.S_ISLNK(mode):
            real, home = os.path.realpath(target), os.path.realpath(directory)
            if os.path.dirname(real) != home:
                return f"is a symbolic link out of the checkpoint (to {real})"
            mode = os.stat(real).st_mode
    except FileNotFoundError:
        return "is missing"
    except OSError as exc:
        return f"cannot be checked ({exc.strerror})"
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        return f"is {kind}, not a regular file"
    return None


def listed_files(path: Path) -> set[str] | None:
    """The file names the ``meta.json`` of checkpoint ``path`` lists (None when there is no
    readable one: a bare DCP directory)."""
    if plain_file_problem(path, META):
        return None
    try:
        files = json.loads((path / META).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return {str(name) for name in files} if isinstance(files, dict) else None


def file_digests(directory: Path, names: Iterable[str]) -> dict[str, list[Any]]:
    """``name -> [bytes, sha256]`` of the files ``names`` in ``directory``."""
    return {name: [(directory / name).stat().st_size, _sha256(directory / name)] for name in names}


def commit(tmp: Path, path: Path, meta: dict[str, Any], files: dict[str, list[Any]]) -> Path:
    """Write ``meta.json`` and the marker into ``tmp`` and rename it to ``path`` (atomic:
    a crash leaves either the old checkpoint at ``path`` or the new one)."""
    text = json.dumps({"format": FORMAT_VERSION, **meta, "files": files}, indent=1, sort_keys=True)
    write_synced(tmp / META, text)
    write_synced(tmp / MARKER, json.dumps({"meta_sha256": hashlib.sha256(text.encode()).hexdigest()}))
    (tmp / OWNER).unlink(missing_ok=True)
    fsync_dir(tmp)
    backup = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    if path.exists():
        path.rename(backup)
    tmp.rename(path)
    fsync_dir(path.parent)
    shutil.rmtree(backup, ignore_errors=True)
    return path


def read_meta(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint at ``path`` (or its complete backup) and its ``meta.json``, checked
    cheaply: marker, format, every listed file present with its size (no checksums).

    Raises:
        CheckpointError: missing, or not a hybridtrain checkpoint.
        IncompleteCheckpointError: no commit marker, or files missing or truncated.
    """
    path = _existing(Path(path))
    problem = plain_file_problem(path, META)
    if problem:
        raise CheckpointError(f"{path} is not a hybridtrain checkpoint ({path / META} {problem})")
    try:
        text = (path / META).read_text()
        meta: dict[str, Any] = json.loads(text)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a hybridtrain checkpoint ({META} unreadable: {exc})") from None
    known = isinstance(meta, dict) and meta.get("format") in (1, FORMAT_VERSION)
    # An unfinished save says so first, whatever its meta.json holds.
    problem = _uncommitted(path, text) if known and meta["format"] == FORMAT_VERSION else None
    if problem:
        raise IncompleteCheckpointError(f"checkpoint {path} is incomplete: {problem}")
    shape = _shape_problem(meta)
    if shape:
        raise CheckpointError(f"{path} is not a hybridtrain checkpoint ({META}: {shape})")
    if meta["format"] == 1:
        return path, meta  # the previous layout (hybridtrain.checkpoint.legacy) has no marker
    problem = _incomplete(path, meta)
    if problem:
        raise IncompleteCheckpointError(f"checkpoint {path} is incomplete: {problem}")
    return path, meta


def verify_files(path: Path, names: Iterable[str], meta: dict[str, Any]) -> str | None:
    """The first of ``names`` whose SHA-256 differs from ``meta``'s, as a reason; None if all match."""
    for name in names:
        if _sha256(path / name) != meta["files"][name][1]:
            return f"{path / name} is corrupt (checksum mismatch)"
    return None


def complete_checkpoints(root: Path, pattern: str = "step-*") -> list[tuple[Path, str | None]]:
    """Checkpoint directories under ``root``, newest (highest name) first, each with the
    reason it is incomplete (None when it passes :func:`read_meta`'s cheap checks)."""
    found: list[tuple[Path, str | None]] = []
    for path in sorted(root.glob(pattern), reverse=True):
        try:
            read_meta(path)
            found.append((path, None))
        except CheckpointError as exc:
            found.append((path, str(exc)))
    return found


def remove_partial(root: Path, now: Callable[[], float] = time.time) -> list[Path]:
    """Remove temporary directories of saves that can no longer finish (see the module
    docstring), and backups whose checkpoint is complete; returns what was removed."""
    removed = []
    for tmp in sorted(root.glob(".*.tmp-*")):
        if tmp.is_dir() and not _maybe_in_progress(tmp, now()):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    for backup in sorted(root.glob(".*.old-*")):
        final = root / backup.name[1:].split(".old-")[0]
        if (final / MARKER).exists():
            shutil.rmtree(backup, ignore_errors=True)
            removed.append(backup)
    return removed


def prune(root: Path, keep: int, pattern: str = "step-*", start: int | None = None,
          own: Iterable[str | Path] = ()) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints under ``root``.

    Never deleted: the newest complete checkpoints (at least one: a run whose other
    checkpoints are corrupt keeps its only good one), directories newer than the newest
    complete one, and, when ``start`` is given, any
    checkpoint of a step after ``start`` that is not in ``own`` (a run resumed from an
    older checkpoint leaves the newer ones of the earlier timeline alone).

    Args:
        root: the checkpoints directory.
        keep: how many complete checkpoints to keep.
        pattern: which directories are checkpoints (``step-NNNNNNN``).
        start: the step the run started from (None: every checkpoint may go).
        own: the checkpoints this run wrote.

    Returns:
        What was deleted.
    """
    mine = {Path(p).name for p in own}

    def foreign_and_newer(path: Path) -> bool:
        tail = path.name.rpartition("-")[2]
        return start is not None and path.name not in mine and (not tail.isdigit() or int(tail) > start)

    candidates = [(path, problem) for path, problem in complete_checkpoints(root, pattern)
                  if not foreign_and_newer(path)]
    kept = [path for path, problem in candidates if problem is None][:max(keep, 1)]
    if not kept:
        return []  # nothing good among them: deleting would leave the run with nothing
    # Directories newer than the newest good one are left alone: not ours to judge (a copy
    # still arriving, a damaged one a user may repair); resume skips them, saying why.
    removed = [path for path, _ in candidates if path not in kept and path.name < kept[0].name]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _maybe_in_progress(tmp: Path, now: float) -> bool:
    if plain_file_problem(tmp, OWNER):
        return False  # no owner file that can be read without blocking: nothing can be running
    try:
        owner = json.loads((tmp / OWNER).read_text())
    except (OSError, ValueError):
        return False  # the owner file is written first: without it nothing can be running
    if owner.get("host") == socket.gethostname():
        return _alive(int(owner.get("pid", -1)))
    newest = max((f.stat().st_mtime for f in tmp.iterdir()), default=tmp.stat().st_mtime)
    return now - newest < FOREIGN_GRACE_S


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _uncommitted(path: Path, text: str) -> str | None:
    problem = plain_file_problem(path, MARKER)
    if problem == "is missing":
        return f"no commit marker {MARKER} (a save that did not finish)"
    if problem:
        return f"its commit marker {path / MARKER} {problem}"
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return f"no commit marker {MARKER} (a save that did not finish)"
    if not isinstance(marker, dict) or marker.get("meta_sha256") != hashlib.sha256(text.encode()).hexdigest():
        return f"{META} does not match its commit marker"
    return None


def _incomplete(path: Path, meta: dict[str, Any]) -> str | None:
    for name, (size, _) in meta["files"].items():
        target = path / name
        problem = plain_file_problem(path, name)
        if problem:
            return f"{target} {problem}"
        if target.stat().st_size != size:
            return f"{name} has {target.stat().st_size} bytes, {size} were written"
    return None


def _shape_problem(meta: Any) -> str | None:
    """What is wrong with the shape of a parsed ``meta.json`` (None: nothing), checked
    before any field is used: a hand-edited or crafted file is one line, not a KeyError."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    fmt = meta.get("format")
    if fmt not in (1, FORMAT_VERSION) or isinstance(fmt, bool):
        return f"format {fmt!r}; this version reads 1 and {FORMAT_VERSION}"
    files = meta.get("files")

    def entry(value: Any) -> bool:  # format 1: the SHA-256; format 2: [bytes, SHA-256]
        if fmt == 1:
            return isinstance(value, str)
        return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], int)
                and not isinstance(value[0], bool) and value[0] >= 0 and isinstance(value[1], str))

    if not isinstance(files, dict) or not files or not all(
            isinstance(k, str) and k not in ("", ".", "..") and "/" not in k and "\\" not in k and entry(v)
            for k, v in files.items()):
        what = "its SHA-256" if fmt == 1 else "[bytes, SHA-256]"
        return f"'files' must map each file name of the checkpoint to {what}"
    params = meta.get("params")
    if not isinstance(params, dict) or not all(
            isinstance(v, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in v)
            for v in params.values()):
        return "'params' must map each parameter name to its shape (a list of integers)"
    if not isinstance(meta.get("setup"), dict):
        return "'setup' must be an object"
    world = meta.get("world_size")
    if fmt == FORMAT_VERSION and not (isinstance(world, int) and not isinstance(world, bool) and world >= 1):
        return f"'world_size' must be an integer >= 1, got {world!r}"
    return None


def _existing(path: Path) -> Path:
    if (path / META).exists():
        return path
    # A crash between "move the old checkpoint aside" and "move the new one in" leaves
    # only the backup: it is complete, so use it.
    backups = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if backups and (backups[-1] / META).exists():
        warnings.warn(f"{path} is missing; using the complete backup {backups[-1]}", stacklevel=3)
        return backups[-1]
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    raise CheckpointError(f"{path} is not a hybridtrain checkpoint ({META} missing)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_synced(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and flush it to disk."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename or a new file) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
