"""The job store's promises on both databases: one leader at a time, a job started once
per attempt whoever ticks, and a dead leader replaced."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from hybridtrain.service.devices import Want, parse_slots, plan_starts
from hybridtrain.service.local import LocalBackend
from hybridtrain.service.scheduler import Scheduler
from hybridtrain.service.spec import load_job_spec
from hybridtrain.service.store import JobStore
from tests.hpo.conftest import postgres_url  # noqa: F401 - the throwaway PostgreSQL fixture
from tests.service.conftest import wait_for


def test_priority_ages_and_a_long_blocked_job_reserves() -> None:
    now = 1000.0
    queued = [Want("big", 2, 0, now - 10), Want("small", 1, 0, now - 5),
              Want("urgent", 1, 5, now)]
    # Priority first; the big job does not fit on one free slot, the small one backfills.
    assert plan_starts(queued, [0, 1], now) == [("urgent", (0,)), ("small", (1,))]
    assert plan_starts(queued, [3], now) == [("urgent", (3,))]
    # Waiting raises priority: after 6 x aging_s the old job passes the urgent one.
    old = [Want("old", 1, 0, now - 6 * 300), Want("urgent", 1, 5, now)]
    assert plan_starts(old, [0], now) == [("old", (0,))]
    # A big job blocked for reserve_after_s holds back everything behind it.
    blocked = [Want("big", 2, 0, now - 700), Want("small", 1, 0, now - 1)]
    assert plan_starts(blocked, [0], now) == []
    assert plan_starts(blocked, [0, 1], now) == [("big", (0, 1))]


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_two_schedulers_one_leader_each_job_runs_once(database: str, tmp_path: Path,
                                                      request: pytest.FixtureRequest) -> None:
    url = (f"sqlite:///{tmp_path / 's.db'}" if database == "sqlite"
           else request.getfixturevalue("postgres_url"))
    slots = parse_slots("cpu:2")
    a, b = (Scheduler(JobStore(url), slots, {"local": LocalBackend(slots)}, lease=30.0)
            for _ in range(2))
    store = a.store
    prefix = f"{database}-{time.time_ns() % 10**9}"
    for i in range(4):
        store.submit(load_job_spec({"name": f"{prefix}-{i}", "command": [
            sys.executable, "-S", "-c", "import os; print(os.getpid())"]}),
            str(tmp_path / "jobs" / f"{prefix}-{i}"))
    assert a.tick() is True and b.tick() is False  # b waits: a's lease is live
    wait_for(lambda: all(j.state == "succeeded" for j in store.jobs()
                         if j.name.startswith(prefix)), 60, "the jobs", lambda: (a.tick(), b.tick()))
    for job in (j for j in store.jobs() if j.name.startswith(prefix)):
        assert job.attempt == 1 and len(job.history) == 1
        lines = (tmp_path / "jobs" / job.name / "output.log").read_text().splitlines()
        assert len([ln for ln in lines if ln.isdigit()]) == 1  # one process ran it
    # The leader resigns (a clean stop): the other leads at the next tick.
    store.resign(a.owner)
    assert b.tick() is True and a.tick() is False
    store.resign(b.owner)
