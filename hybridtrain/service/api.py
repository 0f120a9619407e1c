"""The REST API of the training service, served next to the HPO service's ``/v1``.

=======  ================================  ============================================
method   path                              what
=======  ================================  ============================================
GET      /v1/jobs                          jobs (``?state=queued&kind=job``)
POST     /v1/jobs                          submit a :class:`~.spec.JobSpec` (201)
GET      /v1/jobs/{name}                   one job: state, reason, devices, restarts
POST     /v1/jobs/{name}/cancel            SIGTERM: the trainer saves a checkpoint, stops
POST     /v1/jobs/{name}/resubmit          queue a finished job again (resumes; ``set``)
GET      /v1/jobs/{name}/logs              output from ``?offset=`` on (follow with it)
GET      /v1/jobs/{name}/curve             the loss curve of a training job
GET      /v1/service                       devices, leader, queue
=======  ================================  ============================================

A user's token (:mod:`.users`) opens these routes for that user's own jobs (another user's
job is answered 404, as if it did not exist); the service's own token opens every job.

The body limit and the 401/404/409/413/422 answers are the servers' shared ones
(:class:`~hybridtrain.server.guard.ApiGuard` and
:func:`~hybridtrain.server.rest.answer_errors_in_one_line`): ``hybridtrain serve`` mounts these
routes on the app that also serves the HPO service.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Query
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from hybridtrain.config.loading import explain_config
from hybridtrain.server.metric_lines import BadMetricLine, parse_json_line
from hybridtrain.service.devices import start_order
from hybridtrain.service.errors import JobNotFoundError, JobSpecError
from hybridtrain.service.page_progress import metrics_path
from hybridtrain.service.scheduler import Scheduler, want_of
from hybridtrain.service.spec import JobSpec, load_job_spec
from hybridtrain.service.states import WAITING
from hybridtrain.service.store import JobRecord, JobStore
from hybridtrain.service.users import ADMIN, Authenticator, User, UserStore

#: Largest chunk of a log one request returns (the client asks again from the offset).
LOG_CHUNK = 1 << 20
#: Largest log offset a request may ask for (a file offset is a signed 64-bit number).
MAX_OFFSET = 2**63 - 1
#: Loss-curve points a request returns at most (evenly thinned beyond).
CURVE_POINTS = 2000


class JobService:
    """What the routes, the page and the CLI's embedded service share.

    Args:
        store: the job storage.
        scheduler: the scheduler of this process (woken on submit and cancel).
        jobs_dir: the directory that holds every job's directory.
        users: the users' tokens and quotas (``None``: the service's own token only).
    """

    def __init__(self, store: JobStore, scheduler: Scheduler, jobs_dir: Path,
                 users: UserStore | None = None) -> None:
        self.store = store
        self.users = users
        self.scheduler = scheduler
        self.jobs_dir = jobs_dir.resolve()
        # Job directories hold logs and environments: the owner's only.
        self.jobs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def job_dir(self, name: str) -> Path:
        """``JOBS_DIR/NAME``, checked to stay inside ``JOBS_DIR`` whatever the name."""
        path = (self.jobs_dir / name).resolve()
        if path.parent != self.jobs_dir:
            raise JobSpecError(f"job name {name!r} would leave the jobs directory")
        return path

    def job(self, name: str, user: User = ADMIN) -> JobRecord:
        """The job ``name`` if ``user`` may see it.

        Raises:
            JobNotFoundError: no such job, or another user's (the same answer, so names of
                others' jobs are not revealed).
        """
        job = self.store.get(name)
        if not user.may_see(job.submitter):
            raise JobNotFoundError(f"job {name!r} not found; `hybridtrain jobs list` shows the jobs")
        return job

    def jobs(self, user: User = ADMIN, states: tuple[str, ...] | None = None,
             kind: str | None = None) -> list[JobRecord]:
        """The jobs ``user`` may see (in ``states``, of ``kind`` if given), oldest first."""
        return [j for j in self.store.jobs(states, kind) if user.may_see(j.submitter)]

    def submit(self, data: dict[str, Any], user: User = ADMIN) -> JobRecord:
        """Validate and queue a job for ``user`` (a name is made up when none is given).

        Raises:
            JobSpecError: invalid spec, more devices than this machine has or than the
                user's quota.
            JobConflictError: the name is taken.
        """
        if isinstance(data, dict) and not data.get("name"):
            data = data | {"name": _make_name(data)}
        spec = load_job_spec(data)
        slots = self.scheduler.slots
        if spec.backend == "local" and spec.devices > len(slots.ids):
            raise JobSpecError(f"job spec field devices = {spec.devices}: this machine has "
                               f"{len(slots.ids)} {slots.kind} slots; ask for at most that, or "
                               "use --backend ray/kubernetes")
        if spec.backend not in self.scheduler.backends:
            raise JobSpecError(f"job spec field backend = {spec.backend!r}: not enabled in this "
                               f"service (enabled: {', '.join(sorted(self.scheduler.backends))}"
                               f"; `hybridtrain serve --ray ADDRESS` or `--kubernetes`)")
        if spec.backend == "local":
            # Paths are this machine's: a missing one fails now, in one line, not at start.
            if not _is_path(Path(spec.workdir), "dir"):
                raise JobSpecError(f"job spec field workdir = {spec.workdir[:120]!r}: not a "
                                   "directory on the service's machine")
            if spec.config is not None and not _is_path(Path(spec.workdir, spec.config), "file"):
                raise JobSpecError(f"job spec field config = {spec.config[:120]!r}: no such file "
                                   "on the service's machine")
        if user.devices is not None and spec.devices > user.devices:
            raise JobSpecError(f"job spec field devices = {spec.devices}: user {user.name} may hold at "
                               f"most {user.devices} devices at once (their quota)")
        check_training_config(spec)
        submitter = None if user is ADMIN else user.name
        record = self.store.submit(spec, str(self.job_dir(spec.name)), submitter=submitter)
        self.scheduler.wake.set()
        return record

    def cancel(self, name: str, user: User = ADMIN) -> JobRecord:
        """Cancel (see :meth:`JobStore.cancel`) and wake the scheduler."""
        record = self.store.cancel(self.job(name, user).id)
        self.scheduler.wake.set()
        return record

    def resubmit(self, name: str, overrides: list[str] | tuple[str, ...] = (),
                 user: User = ADMIN) -> JobRecord:
        """Queue a finished job again and wake the scheduler.

        Args:
            name: the job.
            overrides: more ``--set KEY=VALUE`` for a training job, after its own (so they
                win): e.g. ``train.steps=400`` continues a finished run to step 400.

        Raises:
            JobSpecError: overrides for a job that runs a command, or a bad key or value.
            JobConflictError: the job is queued or running.
        """
        job = self.job(name, user)
        spec = None
        if overrides:
            if job.spec.config is None:
                raise JobSpecError(f"job spec field overrides = {list(overrides)!r}: --set "
                                   f"applies to a training config; job {job.name} runs a command")
            spec = load_job_spec(job.spec.model_dump() | {
                "overrides": [*job.spec.overrides, *overrides]})
            check_training_config(spec)
        record = self.store.resubmit(job.id, spec)
        self.scheduler.wake.set()
        return record

    def logs(self, name: str, offset: int = 0, user: User = ADMIN) -> dict[str, Any]:
        """The job's output from byte ``offset`` on (at most :data:`LOG_CHUNK`)."""
        job = self.job(name, user)
        path = Path(job.job_dir) / job.spec.stdout_file
        text, end = "", offset
        try:
            with path.open("rb") as f:
                f.seek(max(0, offset))
                data = f.read(LOG_CHUNK)
            text, end = data.decode("utf-8", "replace"), max(0, offset) + len(data)
        except OSError:
            pass
        return {"name": job.name, "state": job.state, "text": text, "offset": end}

    def curve(self, name: str, user: User = ADMIN) -> dict[str, Any]:
        """``{"steps": [...], "loss": [...]}`` from the job's ``run/metrics.jsonl`` (a
        training job) or ``metrics.jsonl`` (an HPO trial that reports with ``hpo.report``)."""
        job = self.job(name, user)
        steps: list[int] = []
        losses: list[float] = []
        try:
            with metrics_path(job).open(errors="replace") as f:
                for line in f:
                    # Any program may write this file: a line the HPO service would skip
                    # (a step or loss no JSON number holds, nesting) is skipped here too.
                    try:
                        values, step = parse_json_line(line)
                    except BadMetricLine:
                        continue
                    loss = values.get("loss")
                    if step is None or loss is None or not math.isfinite(loss):
                        continue
                    steps.append(step)
                    losses.append(loss)
        except OSError:
            pass
        if len(steps) > CURVE_POINTS:
            every = -(-len(steps) // CURVE_POINTS)
            steps, losses = steps[::every], losses[::every]
        return {"name": job.name, "steps": steps, "loss": losses}

    def queue_positions(self) -> dict[str, int]:
        """Every waiting (queued or preempted) job's place in the start order (1 = next),
        by name."""
        wants = [want_of(j) for j in self.store.jobs(WAITING)]
        shares = self.scheduler.shares(self.store.jobs(("running",)))
        order = start_order(wants, time.time(), self.scheduler.aging_s, shares)
        return {want.name: place for place, want in enumerate(order, 1)}

    def brief(self, job: JobRecord, positions: dict[str, int]) -> dict[str, Any]:
        """A job without its spec and history, with its queue position (``None``: not
        queued), as lists show it."""
        out = job.as_dict()
        out.pop("spec")
        out.pop("history")
        return out | {"queue_position": positions.get(job.name)}

    def summary(self, user: User = ADMIN) -> dict[str, Any]:
        """Devices, the leader and the number of ``user``'s jobs by state."""
        jobs = self.jobs(user)
        counts: dict[str, int] = {}
        for job in jobs:
            counts[job.state] = counts.get(job.state, 0) + 1
        busy = sorted(d for j in self.store.jobs(("running",)) if j.spec.backend == "local"
                      for d in j.devices)
        owner, url = self.store.leader()
        slots = self.scheduler.slots
        return {"devices": {"kind": slots.kind, "ids": list(slots.ids), "busy": busy},
                "leader": owner, "leader_url": url, "jobs": counts,
                "backends": sorted(self.scheduler.backends)}


def check_training_config(spec: JobSpec) -> None:
    """Validate a training job's config with its overrides (``--set``) now, as ``hybridtrain
    train`` will: an unknown key or a bad value is refused at submit, not when the job
    starts. Pure (reads the file, starts nothing, imports no torch). A config that is not
    on this machine (a Ray or Kubernetes job's) is left to the job.

    Raises:
        JobSpecError: one line naming the config and the first bad key or value.
    """
    if spec.config is None:
        return
    path = Path(spec.workdir, spec.config)
    if spec.backend != "local" and not _is_path(path, "file"):
        return
    try:
        explain_config(path, spec.overrides)
    except (ValueError, OSError) as exc:
        shown = "; ".join(str(exc).splitlines())
        raise JobSpecError(f"job spec field config = {spec.config[:120]!r}: {shown}") from None


def _is_path(path: Path, kind: str) -> bool:
    """Whether ``path`` is a directory (``kind="dir"``) or a regular file; an unreadable or
    too long path is neither (``Path.is_dir`` raises for some of those)."""
    try:
        return path.is_dir() if kind == "dir" else path.is_file()
    except OSError:
        return False


def _make_name(data: dict[str, Any]) -> str:
    source = data.get("config") or (data.get("command") or ["job"])[0]
    stem = Path(str(source).split()[0] if source else "job").stem or "job"
    stem = re.sub(r"[^A-Za-z0-9_-]", "-", stem).strip("-")[:40] or "job"
    return f"{stem}-{secrets.token_hex(3)}"


class ResubmitBody(BaseModel):
    """What ``POST /v1/jobs/NAME/resubmit`` may carry: more ``--set`` overrides."""

    model_config = ConfigDict(extra="forbid")

    set: list[str] = Field(default_factory=list, max_length=256)


_SCHEME = HTTPBearer(auto_error=False)


def job_router(service: JobService, auth: Authenticator) -> APIRouter:
    """The ``/v1/jobs`` routes: every one needs the service's token or a user's."""
    def current_user(cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_SCHEME)]) -> User:
        # The guard in front refused unknown tokens before the body was read; this keeps a
        # route safe without it and tells each route who asks.
        user = auth.user(cred.credentials if cred else None)
        if user is None:
            raise HTTPException(401, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"})
        return user

    # A default, not an Annotated alias: the annotations of this module are strings that
    # FastAPI resolves in the module's globals, where a local alias is not found.
    caller = Depends(current_user)
    router = APIRouter(prefix="/v1")

    @router.get("/jobs")
    def list_jobs(state: Annotated[str | None, Query()] = None,
                  kind: Annotated[str | None, Query()] = None, user: User = caller) -> list[dict[str, Any]]:
        """Jobs, oldest first (``state``: comma-separated states)."""
        states = tuple(state.split(",")) if state else None
        positions = service.queue_positions()
        return [service.brief(j, positions) for j in service.jobs(user, states, kind)]

    @router.post("/jobs", status_code=201)
    def submit(spec: Annotated[dict[str, Any], Body()], user: User = caller) -> dict[str, Any]:
        """Queue a job; it starts when its devices are free."""
        return service.submit(spec, user).as_dict()

    @router.get("/jobs/{name}")
    def show(name: str, user: User = caller) -> dict[str, Any]:
        """One job with its spec, history of attempts and queue position."""
        job = service.job(name, user)
        return job.as_dict() | {"queue_position": service.queue_positions().get(job.name)}

    @router.post("/jobs/{name}/cancel")
    def cancel(name: str, user: User = caller) -> dict[str, Any]:
        """Cancel: queued jobs at once, running ones by SIGTERM (checkpoint, exit 130)."""
        return service.cancel(name, user).as_dict()

    @router.post("/jobs/{name}/resubmit")
    def resubmit(name: str, body: Annotated[ResubmitBody | None, Body()] = None, user: User = caller
                 ) -> dict[str, Any]:
        """Queue a finished job again (409 while it is queued or running); ``{"set":
        ["train.steps=400"]}`` adds config overrides to a training job's own."""
        return service.resubmit(name, body.set if body else (), user).as_dict()

    @router.get("/jobs/{name}/logs")
    def logs(name: str, offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0, user: User = caller
             ) -> dict[str, Any]:
        """Output from ``offset`` on; pass the returned ``offset`` to follow."""
        return service.logs(name, offset, user)

    @router.get("/jobs/{name}/curve")
    def curve(name: str, user: User = caller) -> dict[str, Any]:
        """Loss by step of a training job."""
        return service.curve(name, user)

    @router.get("/service")
    def summary(user: User = caller) -> dict[str, Any]:
        """Devices, leader, the caller's jobs by state."""
        return service.summary(user)

    return router
