"""The first process of every local job attempt: it runs the job and writes its exit code.

    python -S wrap.py LOCK_FD EXIT_FILE CORES -- ARGV...

Started by the scheduler in a new session with ``LOCK_FD`` inherited: an open file on
which the scheduler took an exclusive ``flock`` before starting it. The lock belongs to
the open file, so it stays held while this process lives, whoever started it and whether
or not that scheduler is still alive. A scheduler coming back after a ``kill -9`` tells a
running attempt (lock held) from a finished one (lock free, ``EXIT_FILE`` written) and
from one that never started (lock free, no ``EXIT_FILE``) without trusting a pid.

It ignores SIGTERM/SIGINT itself (a handler, not ``SIG_IGN``: the job must not inherit an
ignored signal) and waits for the job, which gets them as part of the process group; so
the exit code it writes is the job's own: 130 for a trainer that saved a checkpoint and
stopped. Standard library only and run without ``site``: it starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys


def private(path: str, flags: int) -> int:
    """``open``'s opener for the service's own files: readable by their owner only
    (mode 0600), whatever the umask, since a job's output may hold what it printed."""
    return os.open(path, flags, 0o600)


def pinned_cores(slots: list[int], allowed: list[int]) -> set[int]:
    """The cores a job on CPU ``slots`` runs on: the slots themselves where this process may
    run on them; slots beyond (``HYBRIDTRAIN_SERVICE_DEVICES=cpu:8`` on a 4-core machine, to
    run more light jobs at once than there are cores) wrap around onto the allowed cores.

        >>> sorted(pinned_cores([2, 3], [0, 1]))
        [0, 1]
    """
    return {s if s in allowed else allowed[s % len(allowed)] for s in slots}


def main(argv: list[str]) -> int:
    """Run ``argv`` after ``--``; write ``{"code": N}`` to the exit file; return N."""
    # First of all: a cancel that comes this early must not kill the wrapper.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda _s, _f: None)
    lock_fd, exit_path, cores = int(argv[0]), argv[1], argv[2]
    program = argv[argv.index("--") + 1:]
    # Who to signal, for a scheduler that adopts this attempt before it recorded the pid.
    with open(exit_path.replace(".exit", ".pid"), "w", opener=private) as out:
        out.write(str(os.getpid()))
    if cores:
        os.sched_setaffinity(0, pinned_cores([int(c) for c in cores.split(",")], sorted(os.sched_getaffinity(0))))
    try:
        child = subprocess.Popen(program)  # the lock fd is not passed on (close_fds)
    except OSError as exc:
        print(f"error: cannot start {program[0]!r}: {exc.strerror}", file=sys.stderr, flush=True)
        code = 127
    else:
        while True:
            try:
                code = child.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries wait itself
                continue
    # A negative code (killed by a signal) is written as the shell writes it: 128 + N.
    code = 128 - code if code < 0 else code
    tmp = f"{exit_path}.tmp"
    with open(tmp, "w", opener=private) as out:
        json.dump({"code": code}, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, exit_path)
    os.close(lock_fd)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
