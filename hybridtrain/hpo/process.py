"""A trial as an operating-system process: its own process group, its own log files.

The command runs in a new session, so the trial and everything it starts share one
process group that :meth:`TrialProcess.stop` can signal as a whole (SIGTERM, then
SIGKILL after a grace period); through ``/bin/sh`` unless it needs no shell
(:func:`hybridtrain.hpo.shell.argv_without_shell`). Output goes to files rather than
pipes so a trial survives its controller being killed, and the next controller can
still read it. :func:`wait_for_exit` sleeps until a trial exits (Linux: a pidfd per
trial), so a short trial is recorded when it ends, not at the next poll. Process groups
themselves (alive, stopped, an orphan's) are :mod:`hybridtrain.server.process_groups`.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from hybridtrain.server.process_groups import process_start_ticks, signal_group, stop_group


def _open_pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when process ``pid`` exits (Linux >= 5.3)."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:  # an older kernel, or a seccomp profile that forbids it
        return None


def wait_for_exit(processes: Iterable[TrialProcess], timeout: float,
                  wake_fd: int | None = None) -> None:
    """Sleep until one of ``processes`` exits, ``wake_fd`` is readable, or ``timeout`` s.

    A process without a pidfd (other systems) cannot end the wait early: it is then
    noticed at the timeout, as a poll would.
    """
    poller = select.poll()
    for process in processes:
        if process.exit_fd is not None:
            poller.register(process.exit_fd, select.POLLIN)
    if wake_fd is not None:
        poller.register(wake_fd, select.POLLIN)
    poller.poll(timeout * 1000)  # a signal ends it (PEP 475 retries only what is left)


class TrialProcess:
    """One running trial command.

    Args:
        command: the shell command, placeholders already substituted.
        cwd: its working directory.
        env: its complete environment.
        stdout_path: file that receives stdout (appended).
        stderr_path: file that receives stderr (appended).
        argv: the same command as an argument vector when it needs no shell.

    Raises:
        OSError: the working directory does not exist (from :meth:`start`).
    """

    def __init__(
        self,
        command: str,
        cwd: Path,
        env: Mapping[str, str],
        stdout_path: Path,
        stderr_path: Path,
        argv: Sequence[str] | None = None,
    ) -> None:
        self.command = command
        self.argv = list(argv) if argv is not None else None
        #: Readable once the command exited (``None`` where pidfds are unavailable).
        self.exit_fd: int | None = None
        self.cwd = cwd
        self.env = dict(env)
        self.stdout_path = stdout_path
        self.stderr_path = stderr_path
        self._popen: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.start_ticks: int | None = None

    @property
    def pid(self) -> int:
        """Pid of the shell (or of the program run without one), also the process group id."""
        assert self._popen is not None, "start() first"
        return self._popen.pid

    def start(self) -> TrialProcess:
        """Start the command in a new session (its own process group)."""
        self.stdout_path.parent.mkdir(parents=True, exist_ok=True)
        with self.stdout_path.open("ab") as out, self.stderr_path.open("ab") as err:
            def popen(args: str | list[str], shell: bool) -> subprocess.Popen[bytes]:
                return subprocess.Popen(  # noqa: S602 - a shell line by design (or argv)
                    args, shell=shell, cwd=self.cwd, env=self.env,
                    stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    start_new_session=True)

            self._popen = None
            if self.argv is not None:
                # A file the kernel will not run (a script without "#!") goes to the shell,
                # which runs it as a shell script, as it always did.
                with contextlib.suppress(OSError):
                    self._popen = popen(self.argv, shell=False)
            if self._popen is None:
                self._popen = popen(self.command, shell=True)
        self.started_at = time.monotonic()
        self.start_ticks = process_start_ticks(self._popen.pid)
        self.exit_fd = _open_pidfd(self._popen.pid)
        return self

    def _close_exit_fd(self) -> None:
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None

    def poll(self) -> int | None:
        """The exit code, or ``None`` while the command runs."""
        assert self._popen is not None, "start() first"
        code = self._popen.poll()
        if code is not None:
            self._close_exit_fd()  # readable for good now: it would end every wait at once
        return code

    def elapsed(self) -> float:
        """Seconds since :meth:`start`."""
        return time.monotonic() - self.started_at

    def terminate(self) -> None:
        """Send SIGTERM to the whole process group without waiting (see :meth:`stop`)."""
        assert self._popen is not None, "start() first"
        signal_group(self._popen.pid, signal.SIGTERM)

    def stop(self, grace: float, pruned: bool = False) -> int:
        """Stop the whole process group (SIGTERM, SIGKILL after ``grace`` s).

        Also used after a normal exit, to end anything the command left running.
        ``pruned``: the pruner stopped the trial (a process that keeps a record of its
        run, such as a training-service job, records it; a plain process has no record).

        Returns:
            The exit code of the command (negative: killed by that signal).
        """
        assert self._popen is not None, "start() first"
        stop_group(self._popen.pid, grace, leader=self._popen)
        code = self._popen.wait()
        self._close_exit_fd()
        return code

    def stderr_tail(self, lines: int = 5, chars: int = 400) -> str:
        """The last ``lines`` non-empty lines of stderr joined by `` | ``, at most ``chars``."""
        try:
            with self.stderr_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        tail = " | ".join(line.strip() for line in text.splitlines() if line.strip())
        picked = " | ".join(tail.split(" | ")[-lines:])
        return picked[-chars:]
