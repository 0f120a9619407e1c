"""Atomic, verified checkpoints.

A checkpoint is a directory: ``model.pt`` (the model's state dict), ``engine.pt``
(optimizer, scheduler, loss scaler, counters, RNG states, the caller's state) and
``meta.json`` (format, step, SHA-256 of each file, parameter shapes, the settings a resume
must share). It is written into a temporary sibling directory, flushed to disk and renamed
into place, so a crash mid-save never destroys the previous checkpoint at that path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or does not match what loads it."""


def save_checkpoint(path: str | Path, files: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write ``files`` (name → picklable state) and ``meta`` atomically to ``path``.

    An existing checkpoint at ``path`` is replaced only after the new one is complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        digests = {}
        for name, state in files.items():
            target = tmp / name
            with open(target, "wb") as fh:
                torch.save(state, fh)
                fh.flush()
                os.fsync(fh.fileno())
            digests[name] = _sha256(target)
        full_meta = {"format": FORMAT_VERSION, **meta, "files": digests}
        _write_synced(tmp / META, json.dumps(full_meta, indent=1, sort_keys=True))
        _fsync_dir(tmp)
        backup = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        if path.exists():
            path.rename(backup)
        tmp.rename(path)
        _fsync_dir(path.parent)
        shutil.rmtree(backup, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read and verify a checkpoint; returns ``(files, meta)``.

    Raises:
        CheckpointError: missing, not a hybridtrain checkpoint, wrong format, or a file
            whose checksum does not match (corrupt or truncated).
    """
    path = _existing(Path(path))
    meta_file = path / META
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not a hybridtrain checkpoint ({META} unreadable: {exc})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format {meta.get('format')!r}; this version reads {FORMAT_VERSION}")
    files: dict[str, Any] = {}
    for name, digest in meta["files"].items():
        target = path / name
        if not target.is_file() or _sha256(target) != digest:
            raise CheckpointError(f"checkpoint file {target} is missing or corrupt (checksum mismatch)")
        files[name] = torch.load(target, map_location="cpu", weights_only=True)
    return files, meta


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


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
