"""Saving and loading a flat state on ``torch.distributed.checkpoint`` (DCP), every rank
writing and reading its own part.

A state is a flat ``{key: value}``: tensors (a DTensor is saved as its shards and read
back into any other sharding), and other objects (pickled, saved by the rank that holds
them). DCP writes one file per rank plus ``.metadata`` (what every key's chunks are);
loading asks DCP for exactly the slices this rank's tensors cover, so a checkpoint loads
onto another world size or layout.

Checkpoint collectives run on a process group of their own (gloo), created once: a
background save then never interleaves with the training's collectives, and NCCL runs
can save asynchronously (DCP's ``async_save`` needs a CPU backend).

Asynchronous saves (``async_save=True``): the state is copied to host memory, the call
returns, and a background thread writes the shards, checks them and commits. At most one
save is in flight per process: the next save, any load, and :func:`wait_for_pending`
wait for it, and a failure of the background save is raised there.
"""

from __future__ import annotations

import shutil
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from hybridtrain.checkpoint import layout
from hybridtrain.checkpoint.layout import CheckpointError, IncompleteCheckpointError
from hybridtrain.checkpoint.safe_load import SafePlanner, SafeReader

# DCP warns on every call in one process that it "assumes" a single process; that is
# exactly what a one-process run means, so the line would only be noise on each save.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)", category=UserWarning)

_GROUPS: dict[int, dist.ProcessGroup] = {}
_PENDING: list[Future[Path]] = []
_LOCK = threading.Lock()
_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridtrain-checkpoint")


def checkpoint_group() -> dist.ProcessGroup | None:
    """The process group of checkpoint collectives (None in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    # Keyed by the default group: a restart in the same process makes a new one.
    key = id(dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo")
    return _GROUPS[key]


def rank_and_world() -> tuple[int, int]:
    """This process's global rank and the world size (0, 1 without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def wait_for_pending() -> Path | None:
    """Wait for this process's background save, if any; returns its path.

    Raises:
        CheckpointError: the background save failed (its temporary directory is removed).
    """
    with _LOCK:
        pending = _PENDING.pop() if _PENDING else None
    return pending.result() if pending is not None else None


def save(path: Path, state: dict[str, Any], meta_of: Callable[[], dict[str, Any]],
         async_save: bool = False) -> Path:
    """Save ``state`` as the checkpoint ``path`` on every rank (a collective).

    Args:
        path: the checkpoint directory (replaced atomically if it exists).
        state: this rank's flat state (see the module docstring).
        meta_of: called on rank 0 at the commit: the ``meta.json`` fields.
        async_save: return once the state is copied to host memory (see module docstring).

    Raises:
        CheckpointError: a rank failed to write (the temporary directory is removed).
    """
    wait_for_pending()
    group = checkpoint_group()
    rank, _ = rank_and_world()
    tmp = _shared_temporary_dir(path, group, rank)
    writer = dcp.FileSystemWriter(tmp)
    try:
        if not async_save:
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
            return _commit(tmp, path, meta_of, group, rank)
        response: Any = dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=group is None)
        upload: Future[Any] = getattr(response, "upload_completion", response)
    except (Exception, dcp.CheckpointException) as exc:
        _discard(tmp, rank)
        raise CheckpointError(f"saving checkpoint {path} failed: {_one_line(exc)}") from exc

    def finish() -> Path:
        try:
            upload.result()
        except (Exception, dcp.CheckpointException) as exc:
            _discard(tmp, rank)
            raise CheckpointError(f"saving checkpoint {path} failed: {_one_line(exc)}") from exc
        return _commit(tmp, path, meta_of, group, rank)

    with _LOCK:
        _PENDING.append(_EXECUTOR.submit(finish))
    return path


def storage_metadata(path: Path) -> Metadata:
    """DCP's description of the checkpoint's keys (sizes, dtypes, chunks).

    Raises:
        IncompleteCheckpointError: ``.metadata`` is unreadable.
    """
    try:
        return SafeReader(path).read_metadata()  # no code from the file runs (safe_load)
    except (Exception, dcp.CheckpointException) as exc:
        raise IncompleteCheckpointError(f"checkpoint {path} is unreadable: {_one_line(exc)}") from None


def load(path: Path, targets: dict[str, Any]) -> None:
    """Fill ``targets`` (tensors in place; other values replaced) from the checkpoint ``path``
    on every rank (a collective; each rank may ask for different keys)."""
    try:
        group = checkpoint_group()
        dcp.load(targets, storage_reader=SafeReader(path), planner=SafePlanner(), process_group=group,
                 no_dist=group is None)
    except (Exception, dcp.CheckpointException) as exc:
        raise IncompleteCheckpointError(f"reading checkpoint {path} failed: {_one_line(exc)}") from exc


def verify(path: Path, meta: dict[str, Any]) -> None:
    """Check every file's SHA-256 against ``meta``, the files spread over the ranks (a
    collective); every rank raises the same error.

    Raises:
        IncompleteCheckpointError: a file is corrupt.
    """
    group = checkpoint_group()
    rank, world = rank_and_world()
    names = sorted(meta["files"])
    problem = layout.verify_files(path, names[rank::world], meta)
    if group is not None:
        found: list[str | None] = [None] * world
        dist.all_gather_object(found, problem, group=group)
        problem = next((p for p in found if p), None)
    if problem:
        raise IncompleteCheckpointError(f"checkpoint {problem}")


def _shared_temporary_dir(path: Path, group: dist.ProcessGroup | None, rank: int) -> Path:
    # Rank 0 names the directory, every rank writes its shards into it.
    name = [str(layout.temporary_dir(path)) if rank == 0 else ""]
    if group is not None:
        dist.broadcast_object_list(name, src=0, group=group)
    return Path(name[0])


def _commit(tmp: Path, path: Path, meta_of: Callable[[], dict[str, Any]], group: dist.ProcessGroup | None,
            rank: int) -> Path:
    """Every rank checksums its own shard files; rank 0 writes meta.json and the marker
    and renames; every rank returns once that is done (or raises its failure)."""
    own = sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp")) + ([".metadata"] if rank == 0 else [])
    digests: dict[str, list[Any]] | str
    try:
        digests = layout.file_digests(tmp, own)
    except OSError as exc:
        digests = f"rank {rank}: {_one_line(exc)}"
    parts: list[Any] = [digests]
    if group is not None:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, digests, group=group)
    outcome = [""]
    if rank == 0:
        failed = [p for p in parts if isinstance(p, str)]
        try:
            if failed:
                raise OSError(failed[0])
            files = {name: value for part in parts for name, value in part.items()}
            layout.commit(tmp, path, meta_of(), files)
        except (Exception, dcp.CheckpointException) as exc:
            outcome = [_one_line(exc)]
    if group is not None:
        dist.broadcast_object_list(outcome, src=0, group=group)
    if outcome[0]:
        _discard(tmp, rank)
        raise CheckpointError(f"saving checkpoint {path} failed: {outcome[0]}")
    return path


def _discard(tmp: Path, rank: int) -> None:
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _one_line(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: rank -> (error, stack)
    if isinstance(failures, dict) and failures:
        rank, (first, _) = min(failures.items())
        return f"rank {rank}: {_one_line(first)}"
    text = " ".join(str(exc).split())
    return text if len(text) < 400 else text[:400] + " …"
