"""Slot leases: compare-and-set claims, expiry, takeover, renewal."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from hybridtrain.hpo.leases import Heartbeat, Leases
from hybridtrain.hpo.records import Records, TrialRun
from hybridtrain.hpo.spec import load_spec
from hybridtrain.server.storage import open_engine


@pytest.fixture
def records(sqlite_url: str, make_spec: Any) -> Records:
    recs = Records(open_engine(sqlite_url))
    recs.ensure_experiment(load_spec(make_spec(max_trials=3)))
    return recs


def test_claims_are_exclusive_and_run_out(records: Records) -> None:
    a = Leases(records.engine, "branin", "a", 30)
    b = Leases(records.engine, "branin", "b", 30)
    got = [a.claim(True), b.claim(True), a.claim(True)]
    assert sorted(c.slot for c in got if c) == [0, 1, 2]
    assert b.claim(True) is None
    assert records.slot_counts("branin")["running"] == 3


def test_concurrent_claims_never_share_a_slot(sqlite_url: str, make_spec: Any) -> None:
    recs = Records(open_engine(sqlite_url))
    recs.ensure_experiment(load_spec(make_spec(name="many", max_trials=40)))
    claimed: list[int] = []
    lock = threading.Lock()

    def worker(owner: str) -> None:
        leases = Leases(recs.engine, "many", owner, 30)
        while (claim := leases.claim(True)) is not None:
            with lock:
                claimed.append(claim.slot)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(claimed) == list(range(40))


def test_expired_lease_is_taken_over_with_its_trial(records: Records) -> None:
    # Long enough to still be valid at the first check on a loaded machine; waiting past
    # it can only be late, never early.
    dead = Leases(records.engine, "branin", "dead", 1.0)
    claim = dead.claim(True)
    assert claim is not None
    assert dead.attach(claim.slot, 7, {"x1": 1.0, "x2": 2.0}, pgid=12345, start_ticks=99)
    alive = Leases(records.engine, "branin", "alive", 30)
    assert alive.claim(allow_pending=False) is None  # lease still valid
    time.sleep(1.1)
    takeover = alive.claim(allow_pending=False)
    assert takeover is not None and takeover.taken_over
    assert (takeover.slot, takeover.abandoned_trial, takeover.pgid) == (claim.slot, 7, 12345)
    # The dead owner can neither renew nor release any more.
    assert dead.renew([claim.slot]) == {claim.slot}
    assert not dead.release(claim.slot, "done", 0, None)
    assert alive.release(claim.slot, "pending", 1, {"x1": 1.0, "x2": 2.0})
    again = alive.claim(True)
    assert again is not None and again.params == {"x1": 1.0, "x2": 2.0}
    assert again.attempt == 1 and not again.taken_over


def test_heartbeat_keeps_a_short_lease_alive(records: Records) -> None:
    # The lease is renewed ten times per lifetime, so a heartbeat delayed by a loaded
    # machine still keeps it; without renewal it would expire well before the check.
    leases = Leases(records.engine, "branin", "hb", 1.0)
    claim = leases.claim(True)
    assert claim is not None
    beat = Heartbeat(leases, 0.1)
    beat.track(claim.slot)
    beat.start()
    try:
        time.sleep(2.0)
        other = Leases(records.engine, "branin", "other", 30)
        assert other.claim(allow_pending=False) is None
        assert beat.take_lost() == set()
        assert leases.holds(claim.slot) and not other.holds(claim.slot)
    finally:
        beat.stop()


def test_finish_cancels_pending_slots(records: Records) -> None:
    leases = Leases(records.engine, "branin", "x", 30)
    claim = leases.claim(True)
    assert claim is not None
    records.finish("branin", "succeeded", "goal")
    counts = records.slot_counts("branin")
    assert counts == {"pending": 0, "running": 1, "done": 0, "cancelled": 2}
    assert leases.claim(True) is None
    # A trial still running when the goal was reached fails and is queued for a retry:
    # settling the finished experiment cancels it instead of leaving it waiting forever.
    assert leases.release(claim.slot, "pending", 1, {"x1": 0.0, "x2": 0.0})
    records.settle("branin")
    assert records.slot_counts("branin")["cancelled"] == 3


def test_abandoned_slots_come_first_and_each_trial_run_is_recorded(records: Records) -> None:
    dead = Leases(records.engine, "branin", "dead", 0.5)
    claim = dead.claim(True)
    assert claim is not None and claim.slot == 0
    run = TrialRun(0, 0, "host-a", "train --lr 0.1", "/runs/trial-00007")
    assert dead.attach(0, 7, {"x1": 1.0}, run=run)
    time.sleep(0.6)
    alive = Leases(records.engine, "branin", "alive", 30)
    first = alive.claim(True)  # slots 1 and 2 are pending, slot 0 abandoned: settle it first
    assert first is not None and first.taken_over and first.abandoned_trial == 7
    # A controller that no longer holds the slot records nothing.
    assert not dead.attach(0, 8, {"x1": 2.0}, run=TrialRun(0, 0, "host-a", "x", "y"))
    assert records.trial_runs("branin") == {7: run}


def test_claims_read_an_index_range_and_old_databases_get_it(records: Records) -> None:
    with records.engine.begin() as conn:
        conn.exec_driver_sql("DROP INDEX ix_hybridtrain_hpo_slots_state")
        conn.exec_driver_sql("DROP TABLE hybridtrain_hpo_trial_runs")
    upgraded = Records(records.engine)  # what a controller of the new version does first
    names = sa.inspect(upgraded.engine)
    assert "hybridtrain_hpo_trial_runs" in names.get_table_names()
    assert [i["name"] for i in names.get_indexes("hybridtrain_hpo_slots")] == [
        "ix_hybridtrain_hpo_slots_state"]
    query = Leases(records.engine, "branin", "x", 30)._takeable[True]
    with records.engine.connect() as conn:
        sql = str(query.compile(records.engine))
        plan = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}",
                                    tuple([time.time()] + [8] * (sql.count("?") - 1))).all()
    # Two ranges of the index (abandoned, pending), never a scan of every slot.
    assert sum("USING INDEX ix_hybridtrain_hpo_slots_state" in str(r) for r in plan) == 2
    assert not any(" SCAN hybridtrain_hpo_slots" in f" {r[-1]}" for r in plan)
