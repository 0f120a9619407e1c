"""The small interface every backend implements: start an attempt, poll it, stop it.

Call order, all from the leader's scheduler thread: :meth:`Backend.start` once per
attempt, then :meth:`Backend.poll` every tick until it returns an :class:`Ended`;
:meth:`Backend.stop` at any time in between (a cancel: ``force=False`` sends SIGTERM, so
the trainer saves a checkpoint; ``force=True`` after ``kill_grace``). ``poll`` and ``stop``
must work on an attempt started by a scheduler that has since died: everything they need
is in the :class:`~hybridtrain.service.store.JobRecord` (pid, backend reference).
A backend writes the attempt's output under the job's directory (``output.log`` unless
the spec names other files), so ``jobs logs`` reads the same file whatever ran the job.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from pathlib import Path

from hybridtrain.server.auth import TOKEN_ENV
from hybridtrain.service.store import STORAGE_ENVS, JobRecord

#: What the service holds that its jobs must not see: its bearer token (anyone with it
#: may start commands on this machine) and its storage URL and password (the jobs table
#: holds every job's environment).
SECRET_ENV = frozenset({TOKEN_ENV, *STORAGE_ENVS, "PGPASSWORD"})
#: Where ``serve`` keeps job directories (logs, environments) unless told otherwise.
DEFAULT_JOBS_DIR = Path("hybridtrain-jobs")


def inherited_env() -> dict[str, str]:
    """The service's environment less :data:`SECRET_ENV`: what a local job starts from."""
    return {k: v for k, v in os.environ.items() if k not in SECRET_ENV}


@dataclass(frozen=True)
class Started:
    """Where an attempt runs: a local process group, or a cluster's job reference."""

    pgid: int | None = None
    start_ticks: int | None = None
    ref: str | None = None


@dataclass(frozen=True)
class Ended:
    """How an attempt ended.

    Attributes:
        code: its exit code (128 + N when signal N killed it); ``None`` when unknown.
        reason: what the backend knows beyond the code (empty when nothing).
        never_started: the attempt's process was never started (its scheduler died
            between claiming the job and starting it): it may run now without running twice.
    """

    code: int | None
    reason: str = ""
    never_started: bool = False


class Backend(abc.ABC):
    """Runs job attempts somewhere (see the module docstring for the call order)."""

    #: ``local``, ``ray`` or ``kubernetes`` (a job spec's ``backend``).
    name: str = ""
    #: Whether the attempts use this machine's device slots.
    uses_local_slots: bool = False

    def check(self) -> None:
        """Check the backend's configuration (a cluster to reach, a client installed), so
        ``serve`` refuses to start without it instead of failing the first job.

        Raises:
            BackendError: one line saying what is missing.
        """
        return None  # this machine's processes need nothing beyond the service itself

    @abc.abstractmethod
    def start(self, job: JobRecord, argv: list[str], env: dict[str, str],
              devices: tuple[int, ...]) -> Started:
        """Start attempt ``job.attempt``.

        Args:
            job: the job, already marked running for this attempt.
            argv: the program of one node (:meth:`JobSpec.program`).
            env: variables to add to the environment.
            devices: the slots given to it (local backend only).

        Raises:
            OSError or BackendError: it could not be started.
        """

    @abc.abstractmethod
    def poll(self, job: JobRecord) -> Ended | None:
        """``None`` while the attempt runs, else how it ended."""

    @abc.abstractmethod
    def stop(self, job: JobRecord, force: bool) -> None:
        """Ask the attempt to stop (SIGTERM; ``force``: SIGKILL)."""


def job_log(job: JobRecord) -> Path:
    """The job's error output file (all attempts, appended; its standard output too unless
    the spec separates them)."""
    return Path(job.job_dir) / job.spec.stderr_file
