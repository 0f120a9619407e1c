"""Leases on trial slots and the heartbeat that keeps them alive.

A controller that starts a trial first *claims* a slot: it becomes the slot's owner with
a lease that expires ``lease_duration`` seconds later unless the :class:`Heartbeat`
renews it. If the controller dies (kill -9, machine lost), the lease expires and any
controller of the experiment may claim the slot again; it then learns which trial the
dead owner was running (:attr:`Claim.abandoned_trial`) and settles it.

Leases compare wall-clock times written by different machines: keep their clocks in
sync (NTP) to well under ``lease_duration``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa

from hybridtrain.hpo.records import SLOTS, TRIAL_RUNS, TrialRun

log = logging.getLogger(__name__)


class RenewalCounter:
    """Lease renewals made in this process, by experiment (for ``/metrics``).

    Counted where :meth:`Leases.renew` extends leases, so it covers the controllers that
    run inside this process only; each process has its own count from 0.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, experiment: str, n: int) -> None:
        """Count ``n`` leases of ``experiment`` renewed."""
        if n > 0:
            with self._lock:
                self._counts[experiment] = self._counts.get(experiment, 0) + n

    def snapshot(self) -> dict[str, int]:
        """Renewals so far by experiment."""
        with self._lock:
            return dict(self._counts)


#: Renewals of every :class:`Leases` of this process.
RENEWALS = RenewalCounter()


@dataclass(frozen=True)
class Claim:
    """A slot this controller now holds.

    Attributes:
        slot: the slot index.
        attempt: how many failed attempts came before (0 for a first run).
        params: parameters to run again, or ``None`` to sample new ones.
        taken_over: the slot was running under a controller whose lease expired.
        abandoned_trial: for a takeover, the Optuna number of the trial that controller
            was running (``None`` if it died before starting one).
        host, pgid, start_ticks: where that abandoned trial's processes run.
    """

    slot: int
    attempt: int
    params: dict[str, Any] | None
    taken_over: bool = False
    abandoned_trial: int | None = None
    host: str | None = None
    pgid: int | None = None
    start_ticks: int | None = None


class Leases:
    """Claim, renew and release slot leases of one experiment for one controller.

    Args:
        engine: engine on the storage database.
        experiment: experiment name.
        owner: this controller's id (:func:`hybridtrain.server.owners.new_owner_id`).
        lease_duration: seconds a lease lives without renewal.
    """

    def __init__(
        self, engine: sa.engine.Engine, experiment: str, owner: str, lease_duration: float
    ) -> None:
        self.engine = engine
        self.experiment = experiment
        self.owner = owner
        self.lease_duration = lease_duration
        # Every statement of a trial's path is built once, with bound parameters: building
        # a SQLAlchemy statement costs several times what SQLite takes to run it.
        slot = sa.bindparam("b_slot", type_=sa.Integer)
        now = sa.bindparam("b_now", type_=sa.Float)
        ours = SLOTS.c.experiment == experiment
        mine = sa.and_(ours, SLOTS.c.slot == slot, SLOTS.c.owner == owner,
                       SLOTS.c.state == "running")
        # Abandoned slots first, then pending ones; each part a range of the state index
        # (one query with "OR" would scan every slot of the experiment: 40 ms at 100,000).
        expired = SLOTS.select().where(ours, SLOTS.c.state == "running",
                                       SLOTS.c.lease_expires < now)
        pending = SLOTS.select().where(ours, SLOTS.c.state == "pending")
        parts = [q.order_by(SLOTS.c.slot).limit(8).subquery() for q in (expired, pending)]
        both = sa.union_all(*(sa.select(part) for part in parts)).subquery()
        self._takeable = {
            False: sa.select(parts[0]),
            True: sa.select(both).order_by(both.c.state.desc(), both.c.slot).limit(8)}
        # Compare-and-set on the version read: of two controllers racing for the same row
        # exactly one updates it.
        self._take = SLOTS.update().where(
            ours, SLOTS.c.slot == slot, SLOTS.c.version == sa.bindparam("b_version"),
            sa.or_(SLOTS.c.state == "pending", SLOTS.c.lease_expires < now),
        ).values(state="running", owner=owner, version=SLOTS.c.version + 1,
                 lease_expires=sa.bindparam("b_expires"))
        self._attach = SLOTS.update().where(mine).values(
            trial_number=sa.bindparam("b_trial"), params_json=sa.bindparam("b_params"),
            host=sa.bindparam("b_host"), pgid=sa.bindparam("b_pgid"),
            start_ticks=sa.bindparam("b_ticks"))
        self._holds = sa.select(SLOTS.c.slot).where(mine)
        self._insert_run = TRIAL_RUNS.insert().values(experiment=experiment)
        # A done slot keeps its trial number; any other forgets it, so a later takeover
        # never mistakes an old attempt for the abandoned one.
        self._release = {
            keep: SLOTS.update().where(mine).values(
                state=sa.bindparam("b_state"), attempt=sa.bindparam("b_attempt"), owner=None,
                lease_expires=None, params_json=sa.bindparam("b_params"),
                trial_number=SLOTS.c.trial_number if keep else None,
                pgid=SLOTS.c.pgid if keep else None, version=SLOTS.c.version + 1)
            for keep in (False, True)}
        self._host = socket.gethostname()

    def claim(self, allow_pending: bool) -> Claim | None:
        """Take one slot: an abandoned one (expired lease) first, else a pending one.

        Args:
            allow_pending: whether new trials may start (``False`` once the experiment is
                stopping or over, when only abandoned slots still need settling).

        Returns:
            The claim, or ``None`` when no slot is available.
        """
        now = time.time()
        with self.engine.connect() as conn:
            rows = conn.execute(self._takeable[allow_pending], {"b_now": now}).all()
        for row in rows:
            with self.engine.begin() as conn:
                taken = conn.execute(self._take, {
                    "b_slot": row.slot, "b_version": row.version, "b_now": now,
                    "b_expires": time.time() + self.lease_duration}).rowcount
            if taken != 1:
                continue
            params = json.loads(row.params_json) if row.params_json else None
            if row.state == "pending":
                return Claim(row.slot, row.attempt, params)
            return Claim(row.slot, row.attempt, params, taken_over=True,
                         abandoned_trial=row.trial_number,
                         host=row.host, pgid=row.pgid, start_ticks=row.start_ticks)
        return None

    def attach(self, slot: int, trial_number: int, params: dict[str, Any],
               pgid: int | None = None, start_ticks: int | None = None,
               run: TrialRun | None = None) -> bool:
        """Record the trial (and its process group) running in a slot we hold.

        Args:
            slot: the slot.
            trial_number: the Optuna trial running in it.
            params: its parameters (what a takeover runs again).
            pgid, start_ticks: its process group, once started.
            run: where and how the trial runs, recorded with the first attach.

        Returns:
            Whether we still held the slot.
        """
        with self.engine.begin() as conn:
            held = conn.execute(self._attach, {
                "b_slot": slot, "b_trial": trial_number, "b_params": json.dumps(params),
                "b_host": self._host, "b_pgid": pgid, "b_ticks": start_ticks}).rowcount == 1
            if held and run is not None:
                conn.execute(self._insert_run, {"trial_number": trial_number} | asdict(run))
        return held

    def holds(self, slot: int) -> bool:
        """Whether this controller still holds ``slot`` (it may have been taken over)."""
        with self.engine.connect() as conn:
            return conn.execute(self._holds, {"b_slot": slot}).first() is not None

    def renew(self, slots: Iterable[int]) -> set[int]:
        """Extend the leases of ``slots``.

        Returns:
            The slots whose lease was lost (taken over after it expired).
        """
        wanted = set(slots)
        if not wanted:
            return set()
        cond = sa.and_(SLOTS.c.experiment == self.experiment, SLOTS.c.slot.in_(wanted),
                       SLOTS.c.owner == self.owner, SLOTS.c.state == "running")
        with self.engine.begin() as conn:
            updated = conn.execute(SLOTS.update().where(cond).values(
                lease_expires=time.time() + self.lease_duration)).rowcount
            held = None if updated == len(wanted) else set(
                conn.execute(sa.select(SLOTS.c.slot).where(cond)).scalars())
        RENEWALS.add(self.experiment, updated)  # once committed (a failed commit raises)
        return set() if held is None else wanted - held

    def release(self, slot: int, state: str, attempt: int,
                params: dict[str, Any] | None) -> bool:
        """Give up a slot we hold, leaving it in ``state`` (``done``/``pending``/``cancelled``).

        Args:
            slot: the slot.
            state: its new state.
            attempt: the attempt count to store (for the next claim).
            params: parameters the next claim must rerun, or ``None`` for new ones.

        Returns:
            Whether we still held the slot (``False``: another controller took it over,
            and settles it instead).
        """
        with self.engine.begin() as conn:
            return conn.execute(self._release[state == "done"], {
                "b_slot": slot, "b_state": state, "b_attempt": attempt,
                "b_params": None if params is None else json.dumps(params)}).rowcount == 1


class Heartbeat(threading.Thread):
    """Renews the leases of the tracked slots every ``interval`` seconds.

    A thread, so leases stay alive while the controller's loop is busy (sampling, a slow
    database). Slots whose lease was lost are collected in :meth:`take_lost`.

    Args:
        leases: lease operations of this controller.
        interval: seconds between renewals.
    """

    def __init__(self, leases: Leases, interval: float) -> None:
        super().__init__(name="hpo-heartbeat", daemon=True)
        self.leases = leases
        self.interval = interval
        self._slots: set[int] = set()
        self._lost: set[int] = set()
        self._lock = threading.Lock()
        self._stop_event = threading.Event()

    def track(self, slot: int) -> None:
        """Start renewing ``slot``."""
        with self._lock:
            self._slots.add(slot)

    def untrack(self, slot: int) -> None:
        """Stop renewing ``slot`` (before releasing it)."""
        with self._lock:
            self._slots.discard(slot)
            self._lost.discard(slot)

    def take_lost(self) -> set[int]:
        """Slots found lost since the last call.

        A slot released and claimed again by this controller while a renewal was in
        flight can show up here although it is held: confirm with :meth:`Leases.holds`.
        """
        with self._lock:
            lost, self._lost = self._lost, set()
        return lost

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            with self._lock:
                slots = set(self._slots)
            try:
                lost = self.leases.renew(slots)
            except sa.exc.SQLAlchemyError as exc:
                # The database is unreachable for a moment; the lease has slack for this.
                log.warning("heartbeat failed (will retry): %s", exc)
                continue
            if lost:
                with self._lock:
                    self._lost |= lost & self._slots

    def stop(self) -> None:
        """Stop the thread and wait for it."""
        self._stop_event.set()
        if self.is_alive():
            self.join()
