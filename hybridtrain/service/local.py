"""The local backend: an attempt is a process group on this machine, adopted after a crash.

Each attempt starts :mod:`hybridtrain.service.wrap` in a new session, holding an exclusive
``flock`` on ``attempt-K.lock`` in the job's directory; the wrapper writes the job's exit
code to ``attempt-K.exit``. A job therefore outlives the service: after a ``kill -9`` the
next service *adopts* it (the lock is still held: it runs) or collects its exit code (lock
free, exit file there), and an attempt whose wrapper was never started (lock free, no exit
file, no process) is queued again: it had not run, so it cannot run twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hybridtrain.server.process_groups import group_alive, process_start_ticks
from hybridtrain.service import wrap
from hybridtrain.service.backend import Backend, Ended, Started, inherited_env
from hybridtrain.service.devices import Slots
from hybridtrain.service.store import JobRecord


def attempt_paths(job: JobRecord) -> tuple[Path, Path]:
    """``(lock file, exit file)`` of the job's current attempt."""
    base = Path(job.job_dir) / f"attempt-{job.attempt}"
    return base.with_suffix(".lock"), base.with_suffix(".exit")


def _read_exit(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["code"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _lock_held(path: Path) -> bool | None:
    """Whether some process holds ``path``'s lock; ``None`` when the file is missing."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock if we got it
    return False


class LocalBackend(Backend):
    """Runs attempts as process groups of this machine.

    Args:
        slots: the machine's device slots (GPUs are given by ``CUDA_VISIBLE_DEVICES``,
            CPU cores by pinning the processes and ``OMP_NUM_THREADS``).
    """

    name = "local"
    uses_local_slots = True

    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        # Attempts this process started: Popen objects, reaped here (no zombies).
        self._children: dict[tuple[int, int], subprocess.Popen[bytes]] = {}

    def start(self, job: JobRecord, argv: list[str], env: dict[str, str],
              devices: tuple[int, ...]) -> Started:
        directory = Path(job.job_dir)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_path, exit_path = attempt_paths(job)
        exit_path.unlink(missing_ok=True)
        full_env = inherited_env() | env
        cores = ""
        if devices and self.slots.kind == "gpu":
            full_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        elif devices:
            cores = ",".join(map(str, devices))
            full_env["OMP_NUM_THREADS"] = str(len(devices))
            # The service hands out no GPUs here: a job sees none, unless its own spec names
            # some (an HPO trial given GPUs by its experiment's own pool).
            if "CUDA_VISIBLE_DEVICES" not in env:
                full_env["CUDA_VISIBLE_DEVICES"] = ""
        full_env["HYBRIDTRAIN_JOB_DEVICES"] = ",".join(map(str, devices))
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            spec = job.spec
            with open(directory / spec.stdout_file, "ab", opener=wrap.private) as out, \
                    open(directory / spec.stderr_file, "ab", opener=wrap.private) as err:
                if spec.stdout_file == spec.stderr_file:
                    out.write(f"--- attempt {job.attempt} on {self.slots.kind} "
                              f"{list(devices)} ---\n".encode())
                    out.flush()
                popen = subprocess.Popen(
                    [sys.executable, "-S", wrap.__file__, str(lock_fd), str(exit_path), cores,
                     "--", *argv],
                    cwd=spec.workdir, env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=err, start_new_session=True, pass_fds=(lock_fd,))
        finally:
            os.close(lock_fd)  # the wrapper holds the lock from here on
        self._children[(job.id, job.attempt)] = popen
        return Started(pgid=popen.pid, start_ticks=process_start_ticks(popen.pid))

    def poll(self, job: JobRecord) -> Ended | None:
        lock_path, exit_path = attempt_paths(job)
        child = self._children.get((job.id, job.attempt))
        if child is not None:
            if child.poll() is None:
                return None
            del self._children[(job.id, job.attempt)]
        else:
            held = _lock_held(lock_path)
            if held:
                return None
            if held is None and self.pgid(job) is None:
                return Ended(None, never_started=True)
        code = _read_exit(exit_path)
        if code is not None:
            self._sweep(job)
            return Ended(code)
        pgid = self.pgid(job)
        if pgid is None:
            return Ended(None, never_started=True)
        # The wrapper died without writing (killed): stop what it left running.
        left = group_alive(pgid)
        self._sweep(job)
        return Ended(None, "its supervising process was killed before the job's exit was "
                     "recorded" + ("; the job's processes left behind were stopped" if left else ""))

    def _sweep(self, job: JobRecord, wait: float = 2.0) -> None:
        """SIGKILL what the job left in its group after its main process exited, and wait
        (briefly) until the group is gone, so an ended job holds no process."""
        pgid = self.pgid(job)
        if pgid is None or not group_alive(pgid):
            return
        self._signal(job, signal.SIGKILL)
        deadline = time.monotonic() + wait
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.01)

    @staticmethod
    def pgid(job: JobRecord) -> int | None:
        """The attempt's process group: as recorded, else as its wrapper wrote it (a
        scheduler killed between starting it and recording it)."""
        if job.pgid is not None:
            return job.pgid
        try:
            return int(attempt_paths(job)[1].with_suffix(".pid").read_text())
        except (OSError, ValueError):
            return None

    def stop(self, job: JobRecord, force: bool) -> None:
        self._signal(job, signal.SIGKILL if force else signal.SIGTERM)

    def _signal(self, job: JobRecord, sig: int) -> None:
        pgid = self.pgid(job)
        if pgid is None:
            return
        ticks = process_start_ticks(pgid)
        # A live leader that is not our wrapper means the pid was reused: not ours to signal
        # (a group id cannot be reused while any member of the group lives).
        if ticks is not None and job.start_ticks is not None and ticks != job.start_ticks:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
