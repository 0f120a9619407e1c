"""One line for each failure a user can cause or meet: the CLI's error vocabulary.

:func:`describe_failure` maps an exception to ``(message, exit code)``: bad input
(configuration, files, checkpoints) is exit code 2, a failure while training (disk full,
NaN loss, out of memory, a lost or stuck peer) is 1. Exceptions it does not know
(programming errors) map to None and keep their traceback.
"""

from __future__ import annotations

import errno
import os
import re

import torch

from hybridtrain.checkpoint import CheckpointError
from hybridtrain.parallel.peer_failure import PeerFailure, peer_failure

__all__ = ["PeerFailure", "describe_failure", "describe_os_error", "peer_failure"]


def describe_failure(exc: BaseException) -> tuple[str, int] | None:
    """``(one-line message, exit code)`` for a failure a user can act on, else None."""
    if isinstance(exc, ValueError | CheckpointError | ImportError | UnicodeDecodeError):
        return _one_line(str(exc)), 2
    # NonFiniteLossError, or an fp16 overflow at the minimum loss scale (LossScaleAtMinimumError).
    if isinstance(exc, FloatingPointError | PeerFailure):
        return _one_line(str(exc)), 1
    if isinstance(exc, OSError):
        return describe_os_error(exc), 1
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return f"out of memory: {_one_line(str(exc))}", 1
    host = _host_allocation_failure(exc)
    if host is not None:
        return host, 1
    failure = peer_failure(exc)
    return (str(failure), 1) if failure is not None else None


_HOST_ALLOC = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


def _host_allocation_failure(exc: BaseException) -> str | None:
    """torch's CPU allocator failing (a ``RuntimeError`` with an ``enforce fail`` banner:
    the machine, its overcommit policy or ``ulimit -v`` refused) as one line."""
    found = _HOST_ALLOC.search(str(exc)) if isinstance(exc, RuntimeError) else None
    if found is None:
        return None
    return (f"out of host memory: an allocation of {int(found.group(1)) / 2**30:.2f} GiB was refused (the machine's "
            "memory or a ulimit -v); use a smaller train_micro_batch_size_per_gpu (gradient_accumulation_steps "
            "keeps the global batch), activation_checkpointing, or a smaller model")


def describe_os_error(exc: OSError) -> str:
    """An ``OSError`` as one line naming the file and what to do."""
    where = f" {exc.filename}" if exc.filename else ""
    if exc.errno == errno.ENOSPC:
        detail = f" {exc.strerror};" if exc.strerror and exc.strerror != os.strerror(errno.ENOSPC) else ""
        return f"disk full writing{where}:{detail} free space, or point train.output_dir at another disk"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "read-only file system" if exc.errno == errno.EROFS else "permission denied"
        return f"cannot write{where} ({why}): choose a writable train.output_dir"
    if exc.errno == errno.EDQUOT:
        return f"disk quota exceeded writing{where}: free space or raise the quota"
    return f"{exc.strerror or type(exc).__name__}{':' if where else ''}{where}"


def _one_line(text: str) -> str:
    return " ".join(text.split())
