"""The Ray backend: a job is a Ray job (Ray Jobs API) running one rank group per node.

Why Ray Jobs and not TorchX's Ray scheduler: TorchX would add its ``AppDef`` model and a
dependency for what is one ``JobSubmissionClient`` call here, and its scheduler submits
through the same Ray Jobs API anyway. The job's entrypoint is
:mod:`hybridtrain.service.ray_driver`, which places the nodes with a placement group and
runs ``hybridtrain launch``'s static rendezvous across them.

Ray ships the service's ``hybridtrain`` package to the nodes (``runtime_env``'s
``py_modules``); the job's own program must be on them (its image, or shared storage).
The job's directory must be on storage the Ray nodes share with the service (its
checkpoints are what a restart resumes from). A cancel is ``ray job stop``: Ray sends
SIGTERM to the driver, which passes it on, then SIGKILL after the cluster's
``RAY_JOB_STOP_WAIT_TIME_S`` (default 3 s): set that to at least the job's ``kill_grace``
on the cluster, so a trainer has time to save its checkpoint.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import hybridtrain
from hybridtrain.service.backend import Backend, Ended, Started
from hybridtrain.service.errors import BackendError
from hybridtrain.service.store import JobRecord

#: Terminal colour and style codes (ANSI CSI sequences) in Ray's log lines.
_COLOUR = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: Seconds between two copies of a running job's logs into its directory.
_LOG_EVERY = 2.0


class RayBackend(Backend):
    """Submits attempts to the Ray cluster at ``address`` (its job server, port 8265).

    Args:
        address: ``http://HEAD:8265`` (or ``ray://`` / ``auto`` as Ray accepts).
        python: the Python that runs hybridtrain on the cluster (default: this one).
    """

    name = "ray"

    def __init__(self, address: str, python: str | None = None) -> None:
        self.address = address
        self.python = python or sys.executable
        self._client: Any = None
        self._logged: dict[str, float] = {}

    def client(self) -> Any:
        """The ``JobSubmissionClient`` (connected on first use)."""
        if self._client is None:
            try:
                from ray.job_submission import JobSubmissionClient
            except ImportError:
                raise BackendError("the Ray backend needs ray[default]: pip install "
                                   "'hybridtrain[ray]'") from None
            try:
                self._client = JobSubmissionClient(self.address)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise BackendError(f"cannot reach the Ray job server at {self.address}: "
                                   f"{exc}") from None
        return self._client

    def check(self) -> None:
        """The Ray job server must answer."""
        self.client()

    def entrypoint(self, job: JobRecord, argv: list[str]) -> str:
        """The Ray job's entrypoint command line."""
        if argv and argv[0] == sys.executable:
            argv = [self.python, *argv[1:]]
        spec = job.spec
        return shlex.join([self.python, "-m", "hybridtrain.service.ray_driver", "--nodes",
                           str(spec.nodes), "--devices", str(spec.devices), "--", *argv])

    def start(self, job: JobRecord, argv: list[str], env: dict[str, str],
              devices: tuple[int, ...]) -> Started:
        Path(job.job_dir).mkdir(parents=True, exist_ok=True)
        submission = submission_id(job)
        try:
            ref = self.client().submit_job(
                entrypoint=self.entrypoint(job, argv), submission_id=submission,
                # Ray ships this hybridtrain to the nodes, so they run the service's version.
                runtime_env={"env_vars": env, "py_modules": [str(Path(hybridtrain.__file__).parent)]},
                metadata={"hybridtrain_job": job.name, "attempt": str(job.attempt)})
        except RuntimeError as exc:
            raise BackendError(f"Ray refused job {job.name!r}: {_last_line(exc)}") from None
        return Started(ref=str(ref))

    def poll(self, job: JobRecord) -> Ended | None:
        from ray.job_submission import JobStatus

        if not job.backend_ref:
            # Its service died between submitting and recording it: the submission id is
            # derived from the job, so Ray tells whether it was submitted.
            job = replace(job, backend_ref=submission_id(job))
        try:
            info = self.client().get_job_info(job.backend_ref)
        except RuntimeError as exc:
            if "does not exist" in str(exc) and job.pgid is None:
                return Ended(None, never_started=True)
            raise BackendError(f"Ray job {job.backend_ref}: {_last_line(exc)}") from None
        done = info.status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED)
        self._copy_logs(job, force=done)
        if not done:
            return None
        code = getattr(info, "driver_exit_code", None)
        if info.status == JobStatus.SUCCEEDED:
            return Ended(0 if code is None else code)
        if info.status == JobStatus.STOPPED:
            return Ended(130 if code is None else code, "stopped on Ray")
        return Ended(code, f"Ray: {(info.message or 'failed').splitlines()[0][:200]}")

    def _copy_logs(self, job: JobRecord, force: bool) -> None:
        """Write the attempt's Ray logs into the job's output file (every few seconds)."""
        ref = str(job.backend_ref)
        now = time.monotonic()
        if not force and now - self._logged.get(ref, 0.0) < _LOG_EVERY:
            return
        self._logged[ref] = now
        try:
            text = self.client().get_job_logs(ref)
        except RuntimeError:
            return
        directory = Path(job.job_dir)
        # Ray colours its prefixes for a terminal; a log file read later is plain text.
        text = _COLOUR.sub("", text)
        (directory / f"ray-attempt-{job.attempt}.log").write_text(
            f"--- attempt {job.attempt} on Ray ({ref}) ---\n{text}")
        parts = sorted(directory.glob("ray-attempt-*.log"),
                       key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        (directory / job.spec.stdout_file).write_text("".join(p.read_text() for p in parts))

    def stop(self, job: JobRecord, force: bool) -> None:
        with contextlib.suppress(RuntimeError):  # already ended, or never submitted
            self.client().stop_job(job.backend_ref or submission_id(job))


def submission_id(job: JobRecord) -> str:
    """The Ray submission id of the job's current attempt: unique across storages (the
    job's creation time) and the same every time it is computed (so a service that died
    before recording it finds it again)."""
    return f"hybridtrain-{job.name}-{int(job.created_at * 1e6)}-{job.attempt}"


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip(" .")]
    return lines[-1][:300] if lines else type(exc).__name__
