"""Jobs in the services' storage: one row per job, one row naming the scheduler.

The jobs live in the servers' shared database (:mod:`hybridtrain.server.storage`: SQLite
by default, PostgreSQL for several service processes), the one that also holds the HPO
service's experiments under ``hybridtrain serve``, so one process serves both and a trial
is a job. Job states::

    queued --devices free--> running --exit 0--> succeeded
      ^  \\                     |  \\--cancel (SIGTERM, checkpoint)--> cancelled
      |   \\--cancel--> cancelled  \\--exit != 0--> failed (reason named)
      +------ restart (< max_restarts, from the newest checkpoint) ------+
    preempted <--preempted (SIGTERM, checkpoint)-- running;  preempted --devices free--> running

A ``preempted`` job waits like a queued one (and is cancelled like one); it resumes from
the checkpoint it saved when it was stopped. An HPO trial cancelled because its pruner
stopped it ends ``pruned`` instead of ``cancelled``.

Every transition is a compare-and-set on ``(state, attempt)``, so two schedulers (or a
scheduler and a cancel) never both move a job, and a job is started at most once per
attempt. Exactly one scheduler at a time is the *leader* (a lease in ``LEADER``); only the
leader starts, watches and stops jobs.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from hybridtrain.server.storage import (
    HPO_STORAGE_ENV,
    SERVICE_STORAGE_ENV,
    open_with_tables,
    resolve_url,
)
from hybridtrain.service.errors import JobConflictError, JobNotFoundError
from hybridtrain.service.spec import JobSpec
from hybridtrain.service.states import TERMINAL, WAITING

#: Where the jobs' storage URL is read from when none is given, the first one set: the
#: service's own variable, then the HPO service's (the documented fallback: set-ups that
#: gave both services one database through it keep working).
STORAGE_ENVS = (SERVICE_STORAGE_ENV, HPO_STORAGE_ENV)

METADATA = sa.MetaData()

JOBS = sa.Table(
    "hybridtrain_service_jobs",
    METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(64), nullable=False, unique=True),
    sa.Column("spec_json", sa.Text, nullable=False),
    # queued | running | preempted | succeeded | failed | cancelled | pruned
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text, nullable=False, default=""),
    sa.Column("priority", sa.Integer, nullable=False, default=0),
    # "job" (submitted by a user) or "trial" (an HPO experiment's trial)
    sa.Column("kind", sa.String(16), nullable=False, default="job"),
    sa.Column("experiment", sa.String(128), nullable=True),
    sa.Column("trial_number", sa.Integer, nullable=True),
    # The user whose token submitted it (NULL: the administrator's, or from before users).
    sa.Column("submitter", sa.String(64), nullable=True),
    sa.Column("job_dir", sa.Text, nullable=False),
    # Starts so far (first run and restarts); the attempt running now is ``attempt``.
    sa.Column("attempt", sa.Integer, nullable=False, default=0),
    sa.Column("restarts", sa.Integer, nullable=False, default=0),
    sa.Column("devices_json", sa.Text, nullable=False, default="[]"),
    sa.Column("exit_code", sa.Integer, nullable=True),
    sa.Column("host", sa.String(255), nullable=True),
    sa.Column("pgid", sa.Integer, nullable=True),
    sa.Column("start_ticks", sa.BigInteger, nullable=True),
    # Ray submission id or Kubernetes object name of the running attempt.
    sa.Column("backend_ref", sa.Text, nullable=True),
    sa.Column("cancel_requested", sa.Float, nullable=True),
    sa.Column("stop_sent_at", sa.Float, nullable=True),
    sa.Column("history_json", sa.Text, nullable=False, default="[]"),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("queued_at", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float, nullable=True),
    sa.Column("finished_at", sa.Float, nullable=True),
)
JOBS_BY_STATE = sa.Index("ix_hybridtrain_service_jobs_state", JOBS.c.state, JOBS.c.id)

LEADER = sa.Table(
    "hybridtrain_service_leader",
    METADATA,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("owner", sa.String(255), nullable=True),
    sa.Column("expires", sa.Float, nullable=False, default=0.0),
    sa.Column("url", sa.Text, nullable=True),
)

#: The reason of a running job being preempted starts with this (the leader that settles
#: its exit may be another one than the leader that preempted it).
PREEMPTING = "preempting:"
#: The reason of a running trial that is being cancelled because it was pruned starts so.
PRUNING = "pruning:"


@dataclass(frozen=True)
class JobRecord:
    """The stored row of one job (see the module docstring for the states)."""

    id: int
    name: str
    spec: JobSpec
    state: str
    reason: str
    priority: int
    kind: str
    experiment: str | None
    trial_number: int | None
    job_dir: str
    attempt: int
    restarts: int
    devices: tuple[int, ...]
    exit_code: int | None
    host: str | None
    pgid: int | None
    start_ticks: int | None
    backend_ref: str | None
    cancel_requested: float | None
    stop_sent_at: float | None
    history: list[dict[str, Any]] = field(default_factory=list)
    created_at: float = 0.0
    queued_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    submitter: str | None = None

    @property
    def preempting(self) -> bool:
        """Whether this running attempt is being preempted (SIGTERM sent, not yet ended)."""
        return self.state == "running" and self.reason.startswith(PREEMPTING)

    def as_dict(self) -> dict[str, Any]:
        """JSON form for the REST API and ``--json``."""
        return {
            "id": self.id, "name": self.name, "state": self.state, "reason": self.reason,
            "priority": self.priority, "kind": self.kind, "experiment": self.experiment,
            "trial_number": self.trial_number, "submitter": self.submitter,
            "backend": self.spec.backend,
            "devices_requested": self.spec.devices, "nodes": self.spec.nodes,
            "devices": list(self.devices), "attempt": self.attempt, "restarts": self.restarts,
            "max_restarts": self.spec.max_restarts, "preemptible": self.spec.preemptible,
            "preempting": self.preempting, "exit_code": self.exit_code,
            "host": self.host, "pid": self.pgid, "backend_ref": self.backend_ref,
            "cancel_requested": self.cancel_requested is not None,
            "program": self.spec.display(), "job_dir": self.job_dir,
            "history": self.history, "created_at": self.created_at,
            "queued_at": self.queued_at, "started_at": self.started_at,
            "finished_at": self.finished_at, "spec": self.spec.model_dump(mode="json"),
        }


def _record(row: sa.Row[Any]) -> JobRecord:
    return JobRecord(
        id=row.id, name=row.name, spec=JobSpec.model_validate_json(row.spec_json),
        state=row.state, reason=row.reason, priority=row.priority, kind=row.kind,
        experiment=row.experiment, trial_number=row.trial_number, job_dir=row.job_dir,
        attempt=row.attempt, restarts=row.restarts,
        devices=tuple(json.loads(row.devices_json)), exit_code=row.exit_code, host=row.host,
        pgid=row.pgid, start_ticks=row.start_ticks, backend_ref=row.backend_ref,
        cancel_requested=row.cancel_requested, stop_sent_at=row.stop_sent_at,
        history=json.loads(row.history_json), created_at=row.created_at,
        queued_at=row.queued_at, started_at=row.started_at, finished_at=row.finished_at,
        submitter=row.submitter)


class JobStore:
    """Submit, read and move jobs in one storage.

    Args:
        storage: storage URL (default ``$HYBRIDTRAIN_SERVICE_STORAGE``, else
            ``$HYBRIDTRAIN_HPO_STORAGE``, else ``sqlite:///hpo.db``).

    Raises:
        StorageError: the storage cannot be opened.
    """

    def __init__(self, storage: str | None = None) -> None:
        self.url = resolve_url(storage, STORAGE_ENVS)
        self.engine = open_with_tables(self.url, METADATA, "the job tables", _add_missing_columns)

    # -- users' side --------------------------------------------------------------------
    def submit(self, spec: JobSpec, job_dir: str, kind: str = "job",
               experiment: str | None = None, trial_number: int | None = None,
               submitter: str | None = None) -> JobRecord:
        """Queue a new job (``submitter``: the user who sent it).

        Raises:
            JobConflictError: a job of that name exists.
        """
        now = time.time()
        try:
            with self.engine.begin() as conn:
                conn.execute(JOBS.insert().values(
                    name=spec.name, spec_json=spec.model_dump_json(), state="queued",
                    reason="waiting for devices", priority=spec.priority, kind=kind,
                    experiment=experiment, trial_number=trial_number, job_dir=job_dir,
                    submitter=submitter,
                    attempt=0, restarts=0, devices_json="[]", history_json="[]",
                    created_at=now, queued_at=now))
        except sa.exc.IntegrityError:
            raise JobConflictError(f"a job named {spec.name!r} exists already; choose another "
                                   "--name, or `jobs resubmit` it") from None
        return self.get(spec.name)

    def get(self, key: str | int) -> JobRecord:
        """The job named ``key`` (or with id ``key``).

        Raises:
            JobNotFoundError: no such job.
        """
        cond = JOBS.c.name == str(key)
        if isinstance(key, int) or str(key).isdigit():
            cond = sa.or_(cond, JOBS.c.id == int(key))
        with self.engine.connect() as conn:
            row = conn.execute(JOBS.select().where(cond).order_by(JOBS.c.id)).first()
        if row is None:
            raise JobNotFoundError(f"job {str(key)!r} not found; `hybridtrain jobs list` "
                                   "shows the jobs")
        return _record(row)

    def jobs(self, states: tuple[str, ...] | None = None, kind: str | None = None
             ) -> list[JobRecord]:
        """Jobs (in ``states``, of ``kind`` if given), oldest first."""
        stmt = JOBS.select().order_by(JOBS.c.id)
        if states is not None:
            stmt = stmt.where(JOBS.c.state.in_(states))
        if kind is not None:
            stmt = stmt.where(JOBS.c.kind == kind)
        with self.engine.connect() as conn:
            return [_record(r) for r in conn.execute(stmt).all()]

    def cancel(self, key: str | int, reason: str = "cancelled on request",
               state: str = "cancelled") -> JobRecord:
        """Cancel a job: a waiting one at once, a running one by SIGTERM (the trainer saves
        a checkpoint and stops); the leader sends it. A finished job is left as it is.

        ``state``: ``pruned`` for an HPO trial that its pruner stopped (it ends so)."""
        job = self.get(key)
        now = time.time()
        with self.engine.begin() as conn:
            done = conn.execute(JOBS.update().where(
                JOBS.c.id == job.id, JOBS.c.state.in_(WAITING)).values(
                state=state, reason=reason, finished_at=now)).rowcount
            if not done:
                marked = {"reason": f"{PRUNING} {reason}"} if state == "pruned" else {}
                conn.execute(JOBS.update().where(
                    JOBS.c.id == job.id, JOBS.c.state == "running",
                    JOBS.c.cancel_requested.is_(None)).values(cancel_requested=now, **marked))
        return self.get(job.id)

    def resubmit(self, key: str | int, spec: JobSpec | None = None) -> JobRecord:
        """Queue a finished job again; a training job continues from its newest checkpoint.

        Args:
            key: the job's name or id.
            spec: its spec from now on (``None``: unchanged), e.g. with more overrides.

        Raises:
            JobConflictError: the job is still queued or running.
        """
        job = self.get(key)
        changed = {} if spec is None else {"spec_json": spec.model_dump_json()}
        with self.engine.begin() as conn:
            moved = conn.execute(JOBS.update().where(
                JOBS.c.id == job.id, JOBS.c.state.in_(TERMINAL)).values(
                **changed,
                state="queued", reason="resubmitted", restarts=0, exit_code=None,
                cancel_requested=None, stop_sent_at=None, queued_at=time.time(),
                finished_at=None, devices_json="[]")).rowcount
        if not moved:
            raise JobConflictError(f"job {job.name!r} is {job.state}; only a finished job "
                                   "can be resubmitted")
        return self.get(job.id)

    # -- the leader's side ---------------------------------------------------------------
    def mark_running(self, job: JobRecord, owner: str, devices: tuple[int, ...]) -> bool:
        """Claim a queued (or preempted) job for a new attempt (before anything is started)."""
        with self.engine.begin() as conn:
            return conn.execute(JOBS.update().where(
                JOBS.c.id == job.id, JOBS.c.state == job.state, JOBS.c.state.in_(WAITING),
                JOBS.c.attempt == job.attempt).values(
                state="running", attempt=job.attempt + 1, reason=f"starting ({owner})",
                devices_json=json.dumps(list(devices)), host=socket.gethostname(),
                pgid=None, start_ticks=None, backend_ref=None, exit_code=None,
                started_at=time.time())).rowcount == 1

    def set_process(self, job: JobRecord, pgid: int | None, start_ticks: int | None,
                    backend_ref: str | None, reason: str = "running") -> None:
        """Record where the running attempt runs."""
        with self.engine.begin() as conn:
            conn.execute(JOBS.update().where(
                JOBS.c.id == job.id, JOBS.c.state == "running",
                JOBS.c.attempt == job.attempt).values(
                pgid=pgid, start_ticks=start_ticks, backend_ref=backend_ref, reason=reason))

    def mark_stop_sent(self, job: JobRecord) -> None:
        """Note when SIGTERM went out (SIGKILL follows after ``kill_grace``)."""
        with self.engine.begin() as conn:
            conn.execute(JOBS.update().where(JOBS.c.id == job.id).values(
                stop_sent_at=time.time()))

    def mark_preempting(self, job: JobRecord, reason: str) -> bool:
        """Note that the running attempt is being preempted (SIGTERM goes out now; SIGKILL
        follows after ``kill_grace``); ``False`` when it ended or a cancel came first."""
        with self.engine.begin() as conn:
            return conn.execute(JOBS.update().where(
                JOBS.c.id == job.id, JOBS.c.state == "running", JOBS.c.attempt == job.attempt,
                JOBS.c.cancel_requested.is_(None), JOBS.c.stop_sent_at.is_(None)).values(
                reason=f"{PREEMPTING} {reason}", stop_sent_at=time.time())).rowcount == 1

    def end_attempt(self, job: JobRecord, state: str, reason: str, exit_code: int | None,
                    restart: bool = False, waiting: str = "queued") -> bool:
        """Close the running attempt: finish the job in ``state``, or queue it again.

        Args:
            job: the job as read while its attempt ran.
            state: ``succeeded``/``failed``/``cancelled`` (the attempt's outcome).
            reason: one line, kept in the job's history.
            exit_code: the attempt's exit code (``None``: unknown).
            restart: queue the job again (a restart after a failure, or an attempt that
                never started because its scheduler died first).
            waiting: the state it waits in after ``restart`` (``preempted``: it was).

        Returns:
            Whether the job was still in that attempt (compare-and-set).
        """
        now = time.time()
        entry = {"attempt": job.attempt, "devices": list(job.devices), "host": job.host,
                 "started_at": job.started_at, "ended_at": now, "exit_code": exit_code,
                 "outcome": state, "reason": reason}
        values: dict[str, Any] = {"exit_code": exit_code, "pgid": None,
                                  "history_json": json.dumps([*job.history, entry])}
        if restart:
            values |= {"state": waiting, "reason": reason, "queued_at": now,
                       "devices_json": "[]", "stop_sent_at": None}
            if state == "failed":
                values["restarts"] = job.restarts + 1
        else:
            values |= {"state": state, "reason": reason, "finished_at": now}
        with self.engine.begin() as conn:
            return conn.execute(JOBS.update().where(
                JOBS.c.id == job.id, JOBS.c.state == "running",
                JOBS.c.attempt == job.attempt).values(**values)).rowcount == 1

    # -- leadership ------------------------------------------------------------------------
    def lead(self, owner: str, duration: float, url: str | None) -> bool:
        """Take or renew the leader lease; ``True`` while ``owner`` leads.

        A lease expires ``duration`` seconds after its last renewal; one whose owner was a
        process of this host that is gone (``kill -9``) is taken at once.
        """
        now = time.time()
        with self.engine.connect() as conn:
            row = conn.execute(LEADER.select().where(LEADER.c.id == 1)).first()
        # Most ticks only read: a lease is renewed once half of it has run out, and a live
        # peer's lease is not touched (SQLite has one writer at a time).
        if row is not None and row.owner == owner and row.expires - now > duration / 2:
            return True
        if row is not None and row.owner not in (None, owner) and row.expires >= now \
                and not _dead_local_owner(row.owner):
            return False
        with self.engine.begin() as conn:
            if row is None:
                try:
                    conn.execute(LEADER.insert().values(id=1, owner=owner,
                                                        expires=now + duration, url=url))
                    return True
                except sa.exc.IntegrityError:
                    return False
            # Compare-and-set on the owner and expiry read: of two takers one wins.
            return conn.execute(LEADER.update().where(
                LEADER.c.id == 1, LEADER.c.expires == row.expires,
                LEADER.c.owner.is_(None) if row.owner is None else LEADER.c.owner == row.owner
            ).values(owner=owner, expires=now + duration, url=url)).rowcount == 1

    def leader(self) -> tuple[str | None, str | None]:
        """``(owner, url)`` of the live leader, or ``(None, None)``."""
        with self.engine.connect() as conn:
            row = conn.execute(LEADER.select().where(LEADER.c.id == 1)).first()
        if row is None or row.owner is None or row.expires < time.time() or _dead_local_owner(
                row.owner):
            return None, None
        return row.owner, row.url

    def resign(self, owner: str) -> None:
        """Give the lease up (a clean shutdown), so the next service leads at once."""
        with self.engine.begin() as conn:
            conn.execute(LEADER.update().where(LEADER.c.id == 1, LEADER.c.owner == owner)
                         .values(owner=None, expires=0.0, url=None))


def _add_missing_columns(engine: sa.engine.Engine) -> None:
    """Add the columns newer versions define to a jobs table an older version created
    (``create_all`` creates missing tables only), so an existing database keeps its jobs."""
    present = {c["name"] for c in sa.inspect(engine).get_columns(JOBS.name)}
    with engine.begin() as conn:
        for column in JOBS.columns:
            if column.name not in present and column.nullable:
                kind = column.type.compile(dialect=engine.dialect)
                conn.execute(sa.text(f'ALTER TABLE {JOBS.name} ADD COLUMN "{column.name}" {kind}'))


def _dead_local_owner(owner: str | None) -> bool:
    """Whether ``owner`` (``host:pid:random``) names a process of this host that is gone."""
    if not owner:
        return False
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False

