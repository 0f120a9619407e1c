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
from hybridtrain.parallel.mesh import stalled_ranks

_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Connection refused", "Broken pipe",
              "connectFullMesh failed")
"""Words of gloo/NCCL/TCPStore errors that mean another rank is gone."""
_TIMED_OUT = ("Timed out waiting", "timed out", "Timeout", "watchdog")


class PeerFailure(RuntimeError):
    """A collective failed because another rank died or stalled; the message names them."""


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


def peer_failure(exc: BaseException, timeout_s: float | None = None) -> PeerFailure | None:
    """``exc`` as a :class:`PeerFailure` when a collective failed because another rank died
    (connection reset/refused) or stalled (timed out after ``timeout_s``); else None."""
    if not isinstance(exc, RuntimeError):
        return None
    text = _one_line(str(exc))
    kinds = {cls.__name__ for cls in type(exc).__mro__}
    lost = any(word in text for word in _PEER_LOST)
    timed_out = any(word in text for word in _TIMED_OUT)
    if not (lost or timed_out or kinds & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}):
        return None
    if "DistStoreError" in kinds:  # the ranks never met (rendezvous), no collective involved
        return PeerFailure(f"the ranks could not meet in the rendezvous store ({text[:200]}); check that every "
                           "rank was started and can reach MASTER_ADDR:MASTER_PORT")
    if timed_out and not lost:
        stalled = stalled_ranks()
        who = (f"rank{'s' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))} never reached it"
               if stalled else "every rank was waiting (collectives called in a different order?)")
        within = f" within distributed.timeout_s = {timeout_s:g} s" if timeout_s is not None else ""
        return PeerFailure(f"a collective did not finish{within}: {who}; raise distributed.timeout_s "
                           "if that rank is only slow")
    return PeerFailure(f"lost contact with another rank in a collective ({text[:160]}); the launcher "
                       "names the rank that failed first")


def _one_line(text: str) -> str:
    return " ".join(text.split())
