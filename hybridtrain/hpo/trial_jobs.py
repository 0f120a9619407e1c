"""HPO trials as training jobs: one runner for both.

An HPO controller (:class:`hybridtrain.hpo.controller.Controller`) builds each trial's
command as before; :class:`JobProcess` then submits it as a job of kind ``trial`` instead
of starting it, so the trial waits in the same queue, gets its devices from the same
allocator and runs through the same backends as every job. The controller keeps doing what
only it knows (metrics, pruning, timeouts, Optuna), through the same calls it makes on a
:class:`~hybridtrain.hpo.process.TrialProcess`.

Who starts the job: whichever scheduler leads the storage, ``hybridtrain serve`` when one
runs, else the scheduler embedded in the controller (:class:`TrialJobs`), so ``hpo run``
still works with nothing else running.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hybridtrain.hpo.process import TrialProcess
from hybridtrain.service.devices import detect_slots
from hybridtrain.service.local import LocalBackend
from hybridtrain.service.scheduler import Scheduler
from hybridtrain.service.spec import JobSpec
from hybridtrain.service.states import ACTIVE, TERMINAL
from hybridtrain.service.store import JobRecord, JobStore

#: Exit code reported for a trial job that ended without one (it could not start).
NO_EXIT_CODE = 127
#: Seconds between two ticks of the embedded scheduler from trial polls.
_TICK_EVERY = 0.05


class TrialJobs:
    """The job side of one controller: the store and an embedded scheduler.

    Args:
        storage: the experiment's storage URL (the jobs live in it too).
        lease: seconds of the embedded scheduler's leader lease.
    """

    def __init__(self, storage: str, lease: float) -> None:
        self.store = JobStore(storage)
        slots = detect_slots()
        self.scheduler = Scheduler(self.store, slots, {"local": LocalBackend(slots)},
                                   lease=lease, on_event=lambda _line: None)
        self._last_tick = 0.0

    def tick(self, force: bool = False) -> None:
        """Run the embedded scheduler (a no-op while another process leads)."""
        now = time.monotonic()
        if force or now - self._last_tick >= _TICK_EVERY:
            self._last_tick = now
            self.scheduler.tick()

    def cancel_trial(self, experiment: str, number: int) -> None:
        """Cancel the job of trial ``number`` if it is still queued or running (its
        controller died and the trial is being settled by another)."""
        for job in self.store.jobs(ACTIVE, kind="trial"):
            if job.experiment == experiment and job.trial_number == number:
                self.store.cancel(job.id, "its trial was settled after its controller died")

    def close(self) -> None:
        """Give up the leader lease, so another scheduler runs the queue at once."""
        self.store.resign(self.scheduler.owner)


def os_environ_diff(env: Mapping[str, str]) -> dict[str, str]:
    """The entries of ``env`` that differ from this process's environment: what the job
    sets on top of the environment of whichever service runs it."""
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def _executable(program: str, env: Mapping[str, str], cwd: Path) -> bool:
    """Whether the kernel runs ``program`` itself (a binary, or a script with ``#!``).

    :class:`TrialProcess` gives a file the kernel refuses to the shell, which runs it as a
    shell script; the job, started once by another process, must choose beforehand.
    """
    path = shutil.which(program, path=env.get("PATH")) if "/" not in program else str(
        cwd / program)
    if path is None:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith((b"#!", b"\x7fELF"))


def trial_job_name(experiment: str, number: int) -> str:
    """A unique job name for trial ``number`` of ``experiment``."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "-", experiment).strip("-")[:40] or "hpo"
    return f"{stem}-t{number}-{secrets.token_hex(3)}"


class JobProcess(TrialProcess):
    """A trial command run as a job, with :class:`TrialProcess`'s interface.

    Args:
        jobs: the controller's :class:`TrialJobs`.
        experiment: experiment name.
        number: Optuna trial number.
        devices: devices the trial asks for (``gpus_per_trial``; 0 for none).
        kill_grace: seconds from SIGTERM to SIGKILL.
        command, cwd, env, stdout_path, stderr_path, argv: as for :class:`TrialProcess`;
            the logs must be in one directory, the trial's.
    """

    def __init__(self, jobs: TrialJobs, experiment: str, number: int, devices: int,
                 kill_grace: float, command: str, cwd: Path, env: Mapping[str, str],
                 stdout_path: Path, stderr_path: Path, argv: Sequence[str] | None = None
                 ) -> None:
        super().__init__(command, cwd, env, stdout_path, stderr_path, argv)
        self.jobs = jobs
        self.experiment, self.number = experiment, number
        self.devices, self.kill_grace = devices, kill_grace
        self.name = trial_job_name(experiment, number)
        self._job: JobRecord | None = None
        self._watched = 0  # the attempt whose exit exit_fd reports

    def start(self) -> JobProcess:
        """Submit the trial as a job and let the scheduler start it if it can."""
        # On a GPU machine the service hands out the GPUs (gpus_per_trial of them, from its
        # own slots); on a machine without GPUs a trial takes one CPU core like any job, so
        # trials and jobs together never run more processes than the machine has cores.
        devices = self.devices if self.jobs.scheduler.slots.kind == "gpu" else 1
        direct = self.argv is not None and _executable(self.argv[0], self.env, self.cwd)
        program = ({"command": list(self.argv or ())} if direct
                   else {"command": [self.command], "shell": True})
        # Not preemptible: its controller watches one run of the trial and reads its
        # reports; a second run of the command would report the same steps again.
        spec = JobSpec(name=self.name, devices=devices, workdir=str(self.cwd.resolve()),
                       env=os_environ_diff(self.env), kill_grace=self.kill_grace,
                       preemptible=False,
                       stdout_file=self.stdout_path.name, stderr_file=self.stderr_path.name,
                       **program)
        self._job = self.jobs.store.submit(spec, str(self.stdout_path.parent), kind="trial",
                                           experiment=self.experiment, trial_number=self.number)
        self.jobs.tick(force=True)
        self._refresh()
        self.started_at = time.monotonic()
        return self

    def _refresh(self) -> JobRecord:
        assert self._job is not None, "start() first"
        self._job = self.jobs.store.get(self._job.id)
        if self._job.pgid is not None and self._job.state == "running":
            self.start_ticks = self._job.start_ticks
            if self.exit_fd is None and self._watched != self._job.attempt:
                # Readable when the attempt's first process exits: the controller wakes
                # then, not at its next poll (as with a TrialProcess).
                self._watched = self._job.attempt
                with contextlib.suppress(OSError, AttributeError):
                    self.exit_fd = os.pidfd_open(self._job.pgid)
        return self._job

    @property
    def pid(self) -> int | None:  # type: ignore[override]
        """The job's process group once it runs (``None`` while it is queued)."""
        return None if self._job is None else self._job.pgid

    def poll(self) -> int | None:
        """The exit code once the job ended, else ``None`` (queued or running)."""
        self.jobs.tick()
        job = self._refresh()
        if job.state not in TERMINAL:
            if self.exit_fd is not None and job.pgid is None:
                self._close_exit_fd()  # readable for good: it would end every wait at once
            return None
        self._close_exit_fd()
        if job.state == "succeeded":
            return 0
        return job.exit_code if job.exit_code is not None else NO_EXIT_CODE

    def elapsed(self) -> float:
        """Seconds since the job started running (0 while queued): a trial's timeout counts
        its run, not its wait for devices."""
        job = self._job
        if job is None or job.started_at is None:
            return 0.0
        return max(0.0, time.time() - job.started_at)

    def terminate(self, pruned: bool = False) -> None:
        """Cancel the job (SIGTERM) without waiting; ``pruned``: it ends ``pruned``."""
        assert self._job is not None, "start() first"
        if pruned:
            self.jobs.store.cancel(self._job.id, "its trial was pruned (Optuna's pruner)",
                                   state="pruned")
        else:
            self.jobs.store.cancel(self._job.id, "its trial was stopped")
        self.jobs.tick(force=True)

    def stop(self, grace: float, pruned: bool = False) -> int:
        """Cancel the job (if still running) and wait until it ended; ``pruned``: the
        pruner stopped it, and the job ends ``pruned`` rather than ``cancelled``.

        Returns:
            Its exit code.
        """
        code = self.poll()
        if code is not None:
            return code
        self.terminate(pruned)
        deadline = time.monotonic() + grace + 30.0  # the leader SIGKILLs after kill_grace
        while time.monotonic() < deadline:
            code = self.poll()
            if code is not None:
                return code
            time.sleep(0.05)
        return NO_EXIT_CODE
