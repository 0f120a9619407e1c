"""Crashes and concurrency: kill -9 and resume, Ctrl-C, stop, two workers on one storage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hybridtrain.hpo.errors import ExperimentNotFoundError
from hybridtrain.hpo.experiments import ExperimentStore
from hybridtrain.hpo.records import SLOTS
from tests.hpo.conftest import REPO, branin_command, wait_for

pytestmark = pytest.mark.timeout(180)


def _spawn(command: str, spec: dict[str, Any] | str, storage: str, tmp_path: Path,
           tag: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    if isinstance(spec, dict):
        path = tmp_path / f"{spec['name']}.json"
        path.write_text(json.dumps(spec))
        arg = str(path)
    else:
        arg = spec
    log = tmp_path / f"{tag}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hybridtrain.hpo", command, arg,
                                 "--storage", storage], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env=os.environ | (env or {}))
    return proc, log


def _slot_groups(store: ExperimentStore, name: str) -> list[int]:
    return [r.pgid for r in store.records.running_slots(name) if r.pgid]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _held_spec(make_spec: Any, hold: Path, free_trials: int = 0, retries: int = 1,
               **overrides: Any) -> dict[str, Any]:
    """Trials that print their curve, then wait while the file ``hold`` exists.

    The test decides when trials end instead of racing them: a trial it is about to
    interrupt or orphan cannot finish first, however slow the machine. Trials numbered
    below ``free_trials`` never wait.
    """
    command = (f"{branin_command(steps=3, sleep=0.05)} && while [ ${{trial_number}} -ge "
               f"{free_trials} ] && [ -e {hold} ]; do sleep 0.05; done")
    return make_spec(trial={"command": command, "retries": retries}, **overrides)


def _assert_exactly_finished(store: ExperimentStore, name: str, max_trials: int) -> None:
    status = store.status(name)
    assert status["state"] == "succeeded", status
    assert status["trials"]["complete"] + status["trials"]["pruned"] == max_trials
    assert status["trials"]["running"] == status["trials"]["waiting"] == 0
    done = [t for t in store.trials(name) if t["state"] in ("complete", "pruned")]
    assert sorted(t["slot"] for t in done) == list(range(max_trials))


def test_kill9_then_resume_loses_and_double_counts_nothing(make_spec: Any, sqlite_url: str,
                                                            tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    spec = _held_spec(make_spec, hold, free_trials=2, max_trials=8)
    proc, _ = _spawn("run", spec, sqlite_url, tmp_path, "first")
    store = ExperimentStore(sqlite_url)
    # Trials 0 and 1 complete; 2 and 3 then wait for the hold file to go.
    wait_for(lambda: store.records.slot_counts("branin")["done"] == 2
             and len(_slot_groups(store, "branin")) == 2, 60, "two done, two running trials")
    orphans = _slot_groups(store, "branin")
    done_before = {t["number"] for t in store.trials("branin") if t["state"] == "complete"}
    proc.kill()  # SIGKILL: no cleanup at all
    proc.wait(30)
    assert all(_group_alive(g) for g in orphans), "trials should outlive the controller"

    resumed, log = _spawn("run", spec, sqlite_url, tmp_path, "second")
    wait_for(lambda: _count(store, "interrupted") == 2, 60,
             "the resumed controller to settle the two abandoned trials")
    assert not any(_group_alive(g) for g in orphans), "orphaned trials were not stopped"
    hold.unlink()
    assert resumed.wait(120) == 0, log.read_text()
    _assert_exactly_finished(store, "branin", 8)
    trials = store.trials("branin")
    done_after = {t["number"] for t in trials if t["state"] == "complete"}
    assert done_before <= done_after
    _assert_abandoned_were_rerun(trials, 2)


def _count(store: ExperimentStore, state: str) -> int:
    """Trials of ``branin`` in ``state``; -1 while the experiment is not created yet."""
    try:
        return sum(t["state"] == state for t in store.trials("branin"))
    except ExperimentNotFoundError:
        return -1


def _assert_abandoned_were_rerun(trials: list[dict[str, Any]], abandoned: int) -> None:
    """The controller's death is not the trials' failure: each abandoned trial is
    interrupted and its parameters completed later, without using up a retry."""
    interrupted = [t for t in trials if t["state"] == "interrupted"]
    assert len(interrupted) == abandoned
    assert all(t["fail_reason"].startswith("lease expired") for t in interrupted)
    assert not any(t["state"] == "fail" for t in trials)
    completed = {json.dumps(t["params"], sort_keys=True) for t in trials
                 if t["state"] == "complete"}
    assert {json.dumps(t["params"], sort_keys=True) for t in interrupted} <= completed
    assert all(t["attempt"] == 0 for t in trials)


def test_three_kill9_with_no_retries_fail_nothing(make_spec: Any, sqlite_url: str,
                                                  tmp_path: Path) -> None:
    """Issue 11: a controller killed three times used to fail the experiment, its lease
    expiries counted as trial failures (``retries: 0``, ``max_failed_trials: 2``)."""
    hold = tmp_path / "hold"
    hold.touch()
    spec = _held_spec(make_spec, hold, retries=0, max_trials=6)
    store = ExperimentStore(sqlite_url)
    killed: set[int] = set()
    for round_ in range(4):
        proc, log = _spawn("run", spec, sqlite_url, tmp_path, f"run{round_}")
        if round_ == 3:
            break
        # Two trials of this controller run (those of the killed ones were settled).
        wait_for(lambda n=2 * round_, old=frozenset(killed): _count(store, "interrupted") == n
                 and len(set(_slot_groups(store, "branin")) - old) == 2, 60,
                 f"controller {round_} to run two trials")
        groups = set(_slot_groups(store, "branin"))
        proc.kill()
        proc.wait(30)
        killed |= groups
    wait_for(lambda: _count(store, "interrupted") == 6, 60, "the last kill to be settled")
    assert not any(_group_alive(g) for g in killed), "orphaned trials were not stopped"
    hold.unlink()
    assert proc.wait(120) == 0, log.read_text()
    _assert_exactly_finished(store, "branin", 6)
    status = store.status("branin")
    assert status["trials"]["complete"] == 6 and status["trials"]["failed"] == 0
    assert status["failed_trials"] == 0
    _assert_abandoned_were_rerun(store.trials("branin"), 6)


def _run_until_two_running(spec: dict[str, Any], storage: str, tmp_path: Path
                           ) -> tuple[subprocess.Popen[bytes], Path, ExperimentStore, list[int]]:
    """Start ``hpo run`` on a held spec; return once its first two trials hold."""
    (tmp_path / "hold").touch()
    proc, log = _spawn("run", spec, storage, tmp_path, "first")
    store = ExperimentStore(storage)
    wait_for(lambda: len(_slot_groups(store, spec["name"])) == 2, 60, "two running trials")
    return proc, log, store, _slot_groups(store, spec["name"])


def _assert_interrupted(store: ExperimentStore, name: str, reason: str) -> None:
    status = store.status(name)
    stopped = [t for t in store.trials(name) if t["state"] == "interrupted"]
    assert len(stopped) == 2 and all(reason in t["fail_reason"] for t in stopped)
    assert status["trials"] == {"complete": 0, "pruned": 0, "failed": 0, "running": 0,
                                "waiting": status["max_trials"]}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sigint_stops_trials_and_rerun_resumes(make_spec: Any, sqlite_url: str,
                                               tmp_path: Path, sig: signal.Signals) -> None:
    spec = _held_spec(make_spec, tmp_path / "hold", max_trials=5)
    proc, log, store, groups = _run_until_two_running(spec, sqlite_url, tmp_path)
    proc.send_signal(sig)
    assert proc.wait(60) == 130, log.read_text()
    assert not any(_group_alive(g) for g in groups)
    assert store.status("branin")["state"] == "interrupted"
    _assert_interrupted(store, "branin", "interrupted (Ctrl-C)")
    if sig == signal.SIGTERM:
        return  # the same clean stop; resuming is the same as after SIGINT

    (tmp_path / "hold").unlink()
    resumed, log = _spawn("run", spec, sqlite_url, tmp_path, "second")
    assert resumed.wait(120) == 0, log.read_text()
    _assert_exactly_finished(store, "branin", 5)
    assert store.status("branin")["failed_trials"] == 0  # interruptions are not failures


def test_stop_request_reaches_the_controller(make_spec: Any, sqlite_url: str,
                                             tmp_path: Path) -> None:
    spec = _held_spec(make_spec, tmp_path / "hold", max_trials=6)
    proc, log, store, groups = _run_until_two_running(spec, sqlite_url, tmp_path)
    assert store.stop("branin")["state"] == "stopping"
    assert proc.wait(60) == 0, log.read_text()
    assert not any(_group_alive(g) for g in groups)
    assert store.status("branin")["state"] == "stopped"
    _assert_interrupted(store, "branin", "stop requested")


def _two_workers(make_spec: Any, storage: str, tmp_path: Path, name: str = "branin") -> None:
    hold = tmp_path / "hold"
    hold.touch()
    spec = _held_spec(make_spec, hold, name=name, max_trials=8)
    store = ExperimentStore(storage)
    # A trial takes a core like any job: four trials at once need four slots (they only
    # wait on a file, so four slots on fewer cores cost nothing here).
    slots = {"HYBRIDTRAIN_SERVICE_DEVICES": "cpu:4"}
    workers = [_spawn("worker", spec, storage, tmp_path, f"w{i}", slots) for i in range(2)]
    # Both workers hold two trials each before any trial may end: each takes part.
    wait_for(lambda: len({r.owner for r in store.records.running_slots(name) if r.pgid}) == 2
             and len(_slot_groups(store, name)) == 4, 90, "both workers running two trials")
    hold.unlink()
    for proc, log in workers:
        assert proc.wait(150) == 0, log.read_text()
    _assert_exactly_finished(store, name, 8)
    with store.records.engine.connect() as conn:
        rows = conn.execute(SLOTS.select().where(SLOTS.c.experiment == name)).all()
    assert [r.state for r in rows] == ["done"] * 8


def test_two_workers_share_sqlite(make_spec: Any, sqlite_url: str, tmp_path: Path) -> None:
    _two_workers(make_spec, sqlite_url, tmp_path)


def test_two_workers_share_postgresql(make_spec: Any, postgres_url: str,
                                      tmp_path: Path) -> None:
    _two_workers(make_spec, postgres_url, tmp_path,
                 name=f"pg-{os.getpid()}-{time.time_ns() % 10**6}")
