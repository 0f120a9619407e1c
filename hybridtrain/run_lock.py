"""One owner per run directory: a lock that ``hybridtrain train`` holds on
``train.output_dir`` for as long as the run lives.

A second ``train``, ``--resume`` or ``--overwrite`` into a directory another live run
owns is refused in one line naming the holder (pid, host, since when). The lock is an
``flock`` on ``<output_dir>/.hybridtrain.lock``: the kernel releases it when its process
dies, however it dies (kill -9 included), so a lock left by a dead run is simply taken
over; no pid file is ever trusted. The file itself stays (deleting a lock file while
another process may open it would let two processes hold two different files).

Who holds it:

- ``hybridtrain train --nproc-per-node N`` (the launcher): the launcher, for the whole
  launch, torchrun restarts included; it passes a token to its ranks
  (:data:`TOKEN_ENV`), which find it in the lock file and go on without locking.
- a rank started some other way (plain ``torchrun``): the writer rank (rank 0) alone.
  After a restart it waits briefly for its previous round's process to let go.
- one process: itself.

Every rank of the live run also holds ``.hybridtrain.ranks.lock`` shared while it runs:
the workers of a launcher killed with ``kill -9`` still save their last checkpoint and
stop on their own, and until they have, a new owner is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

LOCK_FILE = ".hybridtrain.lock"
RANKS_FILE = ".hybridtrain.ranks.lock"
"""Held shared by every rank of the live run (so ranks that outlive a killed launcher still
own the directory until they have saved and exited)."""
TOKEN_ENV = "HYBRIDTRAIN_RUN_LOCK_TOKEN"
"""Set by the launcher for its ranks: the token it wrote into the lock file it holds."""
RESTART_WAIT_S = 30.0
"""How long a restarted rank 0 waits for its previous round's process to release the lock."""


class RunDirBusyError(ValueError):
    """Another live process owns the run directory (a ``ValueError``: bad input, exit 2)."""


class RunDirLock:
    """The held lock of one run directory; :meth:`release` (or process exit) lets it go."""

    def __init__(self, out: Path, handle: IO[str], token: str, created_dirs: list[Path]) -> None:
        self.out = out
        self.token = token
        self._handle: IO[str] | None = handle
        self._created_dirs = created_dirs

    def release(self) -> None:
        """Let the lock go; a directory this lock created and nobody used is removed again,
        so a start refused for bad input leaves nothing behind."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        if self._created_dirs:
            with contextlib.suppress(OSError):
                if {p.name for p in self.out.iterdir()} <= {LOCK_FILE, RANKS_FILE}:
                    for name in (LOCK_FILE, RANKS_FILE):
                        (self.out / name).unlink(missing_ok=True)
                    for path in reversed(self._created_dirs):
                        path.rmdir()  # only while empty: stops at the first that is not
        handle.close()  # closing the descriptor drops the flock


def acquire(out: Path, wait_s: float = 0.0) -> RunDirLock:
    """Take the lock of run directory ``out`` (created if missing).

    Args:
        out: the run directory (``train.output_dir``).
        wait_s: keep trying this long while another process holds it.

    Raises:
        RunDirBusyError: another live process holds it; the message names it.
        OSError: the directory cannot be created or written.
    """
    # The directories this start creates (outermost first), removed again if unused.
    created = [p for p in [*reversed(out.parents), out] if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the run's life
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                handle.close()
                raise RunDirBusyError(f"output directory {out} is in use by {describe_holder(path)}: wait for "
                                      "it to end (or stop it), or choose another train.output_dir") from None
            time.sleep(0.2)
    # The owner of an earlier run may be gone (kill -9 of its launcher) while its ranks still
    # finish their last save: they hold the ranks lock shared until they exit.
    while not _ranks_gone(out):
        if time.monotonic() >= deadline:
            handle.close()
            raise RunDirBusyError(f"output directory {out} is in use by ranks of an earlier run that are still "
                                  "running (their launcher is gone; they save and stop on their own): wait for "
                                  "them, or choose another train.output_dir")
        time.sleep(0.2)
    token = uuid.uuid4().hex
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "token": token}
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(holder) + "\n")
    handle.flush()
    return RunDirLock(out, handle, token, created)


def _ranks_gone(out: Path) -> bool:
    """Whether no rank holds ``out``'s ranks lock (checked by taking it exclusively, at once released)."""
    with open(out / RANKS_FILE, "a", encoding="utf-8") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    return True


@contextlib.contextmanager
def _rank_share(out: Path) -> Iterator[None]:
    """Hold ``out``'s ranks lock shared while this rank lives in the run."""
    with open(out / RANKS_FILE, "a", encoding="utf-8") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_SH)  # waits out a new owner's momentary check only
        yield


def describe_holder(path: Path) -> str:
    """Who holds the lock file ``path``, in words: ``pid 123 on host h since 2026-… UTC``."""
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        since = datetime.fromtimestamp(float(holder["since"]), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"another hybridtrain run (pid {int(holder['pid'])} on host {holder['host']} since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another hybridtrain run (its holder file is being written)"


def held_by_launcher(out: Path) -> bool:
    """Whether the launcher of this rank holds ``out``'s lock (:data:`TOKEN_ENV` matches)."""
    token = os.environ.get(TOKEN_ENV)
    if not token:
        return False
    try:
        return json.loads((out / LOCK_FILE).read_text(encoding="utf-8")).get("token") == token
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def own_run_dir(out: Path, rank: int = 0, restart: int = 0) -> Iterator[RunDirLock | None]:
    """Hold ``out``'s lock for the ``with`` body as this process's share of the run (see the
    module docstring); yields the lock, or None where another process of the run holds it.

    Raises:
        RunDirBusyError: another run owns ``out``.
    """
    if held_by_launcher(out) or rank != 0:
        out.mkdir(parents=True, exist_ok=True)
        with _rank_share(out):
            yield None
        return
    lock = acquire(out, RESTART_WAIT_S if restart > 0 else 0.0)
    try:
        with _rank_share(out):
            yield lock
    finally:
        lock.release()
