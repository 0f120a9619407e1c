"""Our own tables next to Optuna's: one row per experiment, one row per trial slot.

An experiment has exactly ``max_trials`` slots. A slot is the unit of the experiment's
promise: it ends ``done`` when one of its trials finished (complete or pruned), so the
experiment ends with exactly ``max_trials`` finished trials however often controllers
crash. Slot states::

    pending --claim--> running --trial finished--> done
       ^                  |
       +--failed/stopped--+        pending --goal reached / experiment failed--> cancelled

Every slot update is a compare-and-set on ``version`` (or on the lease owner), so two
controllers can never both take a slot, whatever the database (SQLite or PostgreSQL).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from hybridtrain.hpo.errors import ExperimentConflictError, ExperimentNotFoundError, StorageError
from hybridtrain.hpo.spec import ExperimentSpec
from hybridtrain.server.errors import first_line
from hybridtrain.server.storage import create_tables_racing, safe_url, setup_lock

METADATA = sa.MetaData()

EXPERIMENTS = sa.Table(
    "hybridtrain_hpo_experiments",
    METADATA,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("spec_json", sa.Text, nullable=False),
    sa.Column("search_json", sa.Text, nullable=False),
    # running | stopping | stopped | interrupted | succeeded | failed
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text, nullable=False, default=""),
    sa.Column("failed_trials", sa.Integer, nullable=False, default=0),
    # Controllers that have joined so far; each seeds its sampler differently.
    sa.Column("controllers", sa.Integer, nullable=False, default=0),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

SLOTS = sa.Table(
    "hybridtrain_hpo_slots",
    METADATA,
    sa.Column("experiment", sa.String(128), primary_key=True),
    sa.Column("slot", sa.Integer, primary_key=True),
    # pending | running | done | cancelled
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("version", sa.Integer, nullable=False, default=0),
    sa.Column("attempt", sa.Integer, nullable=False, default=0),
    # Parameters to run again (a retry or an interrupted trial); NULL: sample new ones.
    sa.Column("params_json", sa.Text, nullable=True),
    sa.Column("trial_number", sa.Integer, nullable=True),
    sa.Column("owner", sa.String(255), nullable=True),
    sa.Column("lease_expires", sa.Float, nullable=True),
    sa.Column("host", sa.String(255), nullable=True),
    sa.Column("pgid", sa.Integer, nullable=True),
    sa.Column("start_ticks", sa.BigInteger, nullable=True),
)

# One row per trial the service started: where and how it runs (a slot's row holds only
# its latest attempt). Kept here rather than as Optuna user attributes, which cost a query
# and an upsert each; written in the same transaction that attaches the trial to its slot.
TRIAL_RUNS = sa.Table(
    "hybridtrain_hpo_trial_runs",
    METADATA,
    sa.Column("experiment", sa.String(128), primary_key=True),
    sa.Column("trial_number", sa.Integer, primary_key=True),
    sa.Column("slot", sa.Integer, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("command", sa.Text, nullable=False),
    sa.Column("trial_dir", sa.Text, nullable=False),
)

# Claims look for the pending (or abandoned running) slots of an experiment: a range of
# this index, however many slots are done.
SLOTS_BY_STATE = sa.Index("ix_hybridtrain_hpo_slots_state", SLOTS.c.experiment,
                          SLOTS.c.state, SLOTS.c.slot)
_GET = EXPERIMENTS.select().where(EXPERIMENTS.c.name == sa.bindparam("b_name"))

ACTIVE_STATES = ("running", "stopping")
TERMINAL_STATES = ("succeeded", "failed")


@dataclass(frozen=True)
class ExperimentRecord:
    """The stored row of one experiment."""

    name: str
    spec: dict[str, Any]
    state: str
    reason: str
    failed_trials: int
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class TrialRun:
    """Where and how one trial runs.

    Attributes:
        slot: its slot.
        attempt: failed attempts of the slot before it.
        host: the machine of its controller.
        command: its shell command, placeholders substituted.
        trial_dir: its directory (logs, metrics file).
    """

    slot: int
    attempt: int
    host: str
    command: str
    trial_dir: str


def _record(row: sa.Row[Any]) -> ExperimentRecord:
    return ExperimentRecord(
        name=row.name,
        spec=json.loads(row.spec_json),
        state=row.state,
        reason=row.reason,
        failed_trials=row.failed_trials,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def _diff(stored: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    keys = sorted(set(stored) | set(new))
    out: list[str] = []
    for key in keys:
        a, b = stored.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


class Records:
    """Experiment and slot rows in the storage database.

    Args:
        engine: a SQLAlchemy engine on the storage URL; tables are created if missing.
    """

    def __init__(self, engine: sa.engine.Engine) -> None:
        self.engine = engine
        try:
            with setup_lock(engine.url.render_as_string(hide_password=False)):
                create_tables_racing(lambda: METADATA.create_all(engine, checkfirst=True))
                # Databases created before the index existed get it now.
                create_tables_racing(lambda: SLOTS_BY_STATE.create(engine, checkfirst=True))
        except (sa.exc.SQLAlchemyError, OSError) as exc:
            raise StorageError(f"cannot create the HPO tables in {safe_url(str(engine.url))!r}: "
                               f"{first_line(exc)}") from None

    # -- experiments ---------------------------------------------------------------
    def ensure_experiment(self, spec: ExperimentSpec, exact: bool = False) -> ExperimentRecord:
        """Create the experiment and its slots, or resume the stored one.

        A resumed experiment in a paused state (stopping, stopped, interrupted) becomes
        ``running`` again; a finished one (succeeded, failed) is returned as is.

        Raises:
            ExperimentConflictError: an experiment of that name exists with a different
                search definition (parameters, objective, algorithm, …); with ``exact``,
                with any other field different (a second caller's command would never run).
        """
        search = spec.search_fields()
        now = time.time()
        try:
            with self.engine.begin() as conn:
                conn.execute(EXPERIMENTS.insert().values(
                    name=spec.name, spec_json=spec.model_dump_json(),
                    search_json=json.dumps(search, sort_keys=True), state="running",
                    reason="", failed_trials=0, controllers=0, created_at=now,
                    updated_at=now))
                conn.execute(SLOTS.insert(), [
                    {"experiment": spec.name, "slot": i, "state": "pending", "version": 0,
                     "attempt": 0} for i in range(spec.max_trials)])
        except sa.exc.IntegrityError:
            pass  # it exists already (maybe created this instant by another worker)
        with self.engine.connect() as conn:
            row = conn.execute(EXPERIMENTS.select().where(EXPERIMENTS.c.name == spec.name)).one()
        changed = _diff(json.loads(row.search_json), search)
        if exact and not changed:
            changed = _diff(json.loads(row.spec_json), json.loads(spec.model_dump_json()))
        if changed:
            raise ExperimentConflictError(
                f"experiment {spec.name!r} already exists with a different spec "
                f"(fields: {', '.join(changed)}); use a new name or the original spec"
            )
        if row.state in ("stopping", "stopped", "interrupted"):
            self.set_state(spec.name, "running", "resumed", only_from=(row.state,))
            return self.get(spec.name)
        return _record(row)

    def get(self, name: str) -> ExperimentRecord:
        """The experiment row.

        Raises:
            ExperimentNotFoundError: no experiment of that name.
        """
        with self.engine.connect() as conn:
            row = conn.execute(_GET, {"b_name": name}).first()
        if row is None:
            known = ", ".join(r.name for r in self.experiments()[:10]) or "none"
            raise ExperimentNotFoundError(f"experiment {name!r} not found; known: {known}")
        return _record(row)

    def experiments(self) -> list[ExperimentRecord]:
        """All experiments, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(EXPERIMENTS.select().order_by(EXPERIMENTS.c.created_at)).all()
        return [_record(r) for r in rows]

    def set_state(
        self, name: str, state: str, reason: str, only_from: tuple[str, ...] | None = None
    ) -> bool:
        """Move the experiment to ``state``, only from one of ``only_from`` if given.

        Returns:
            Whether the row changed (``False``: it was in another state).
        """
        stmt = EXPERIMENTS.update().where(EXPERIMENTS.c.name == name)
        if only_from is not None:
            stmt = stmt.where(EXPERIMENTS.c.state.in_(only_from))
        with self.engine.begin() as conn:
            res = conn.execute(stmt.values(state=state, reason=reason, updated_at=time.time()))
        return res.rowcount > 0

    def join(self, name: str) -> int:
        """Register one more controller of experiment ``name``.

        Returns:
            How many controllers joined before this one (0 for the first).
        """
        with self.engine.begin() as conn:
            conn.execute(EXPERIMENTS.update().where(EXPERIMENTS.c.name == name).values(
                controllers=EXPERIMENTS.c.controllers + 1))
            count = conn.execute(sa.select(EXPERIMENTS.c.controllers).where(
                EXPERIMENTS.c.name == name)).scalar_one()
        return int(count) - 1

    def add_failure(self, name: str, max_failed: int, reason: str) -> int:
        """Count one permanently failed trial; fail the experiment past ``max_failed``.

        Returns:
            The new number of failed trials.
        """
        with self.engine.begin() as conn:
            conn.execute(EXPERIMENTS.update().where(EXPERIMENTS.c.name == name).values(
                failed_trials=EXPERIMENTS.c.failed_trials + 1, updated_at=time.time()))
            count = conn.execute(sa.select(EXPERIMENTS.c.failed_trials).where(
                EXPERIMENTS.c.name == name)).scalar_one()
        if count > max_failed:
            self.finish(name, "failed",
                        f"{count} failed trials exceed max_failed_trials={max_failed}; last: "
                        f"{reason}")
        return int(count)

    def finish(self, name: str, state: str, reason: str) -> None:
        """End the experiment (``succeeded``/``failed``); slots not yet started are cancelled."""
        if self.set_state(name, state, reason, only_from=ACTIVE_STATES + ("stopped",
                                                                         "interrupted")):
            self._cancel_pending(name)

    def _cancel_pending(self, name: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(SLOTS.update().where(
                SLOTS.c.experiment == name, SLOTS.c.state == "pending").values(
                state="cancelled", version=SLOTS.c.version + 1))

    # -- slot summaries --------------------------------------------------------------
    def slot_counts(self, name: str) -> dict[str, int]:
        """Number of slots per state (``pending``, ``running``, ``done``, ``cancelled``)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(SLOTS.c.state, sa.func.count()).where(SLOTS.c.experiment == name)
                .group_by(SLOTS.c.state)).all()
        counts = dict.fromkeys(("pending", "running", "done", "cancelled"), 0)
        counts.update({state: int(n) for state, n in rows})
        return counts

    def trial_runs(self, name: str) -> dict[int, TrialRun]:
        """Where each trial of experiment ``name`` ran, by Optuna trial number."""
        with self.engine.connect() as conn:
            rows = conn.execute(TRIAL_RUNS.select().where(TRIAL_RUNS.c.experiment == name)).all()
        return {r.trial_number: TrialRun(r.slot, r.attempt, r.host, r.command, r.trial_dir)
                for r in rows}

    def running_slots(self, name: str) -> list[sa.Row[Any]]:
        """Rows of the slots that are running (lease valid or not)."""
        with self.engine.connect() as conn:
            return list(conn.execute(SLOTS.select().where(
                SLOTS.c.experiment == name, SLOTS.c.state == "running")).all())

    def settle(self, name: str) -> None:
        """Give the experiment its final state once no slot can run any more.

        ``running`` with every slot done becomes ``succeeded``; ``stopping`` with nothing
        running becomes ``stopped``. In a finished experiment, slots that went back to
        ``pending`` after it ended (a trial of another controller failing a moment after
        the goal was reached) are cancelled, so nothing shows as waiting.
        """
        if self.get(name).state in TERMINAL_STATES:
            self._cancel_pending(name)
            return
        counts = self.slot_counts(name)
        if counts["pending"] == 0 and counts["running"] == 0:
            self.set_state(name, "succeeded", f"{counts['done']} trials finished",
                           only_from=("running",))
        # A slot whose lease expired has no live controller left to stop it (a worker that
        # died): it does not hold a stop back; the next controller settles the slot itself.
        if counts["running"] == 0 or not self._live_slots(name):
            self.set_state(name, "stopped", "stopped on request", only_from=("stopping",))

    def _live_slots(self, name: str) -> int:
        """Running slots of ``name`` whose lease has not expired."""
        with self.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).where(
                SLOTS.c.experiment == name, SLOTS.c.state == "running",
                SLOTS.c.lease_expires >= time.time())).scalar_one())
