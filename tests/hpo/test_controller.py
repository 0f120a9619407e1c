"""End-to-end experiments in this process: search, pruning, failures, retries, goal."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hybridtrain.hpo.errors import HPOError, SpecError, StorageError
from hybridtrain.hpo.experiments import ExperimentStore, run_experiment
from tests.hpo.conftest import BRANIN, branin_command

pytestmark = pytest.mark.timeout(120)


def test_branin_experiment_finishes_exactly_max_trials(make_spec: Any, sqlite_url: str) -> None:
    events: list[str] = []
    status = run_experiment(make_spec(max_trials=8), sqlite_url, on_event=events.append)
    assert status["state"] == "succeeded"
    assert status["trials"] == {"complete": 8, "pruned": 0, "failed": 0, "running": 0,
                                "waiting": 0}
    store = ExperimentStore(sqlite_url)
    best = store.best("branin")
    assert best["value"] < 60  # far better than the mean of Branin over the box (~54-ish+)
    trials = store.trials("branin")
    assert sorted(t["slot"] for t in trials) == list(range(8))
    first = Path(trials[0]["trial_dir"])
    assert (first / "stdout.log").read_text().startswith("epoch 1/1")
    assert trials[0]["metrics"]["loss"] == trials[0]["value"]
    assert sum("started" in e for e in events) == 8


def test_a_trial_is_recorded_when_it_exits_not_at_the_next_poll(make_spec: Any,
                                                               sqlite_url: str) -> None:
    # Polling every 20 s, four sequential trials would take over a minute: the controller
    # sleeps on the trials' exits (pidfd), not on the poll interval.
    spec = make_spec(max_trials=4, parallel_trials=1,
                     durability={"poll_interval": 20.0, "heartbeat_interval": 20.0,
                                 "lease_duration": 60.0})
    t0 = time.monotonic()
    status = run_experiment(spec, sqlite_url)
    assert status["trials"]["complete"] == 4
    assert time.monotonic() - t0 < 20


def test_a_trial_directory_left_by_an_earlier_run_is_kept_aside(make_spec: Any,
                                                                 sqlite_url: str,
                                                                 tmp_path: Path) -> None:
    # Same output_dir, database deleted (or rolled back): trial 0's directory exists.
    stale = tmp_path / "runs" / "branin" / "trial-00000"
    stale.mkdir(parents=True)
    (stale / "stdout.log").write_text("loss=-999\n")
    run_experiment(make_spec(max_trials=1, parallel_trials=1), sqlite_url)
    trial = ExperimentStore(sqlite_url).trials("branin")[0]
    assert trial["value"] != -999 and trial["state"] == "complete"
    assert (stale.with_name("trial-00000.old-1") / "stdout.log").read_text() == "loss=-999\n"
    assert "-999" not in (stale / "stdout.log").read_text()


def test_pruning_stops_bad_trials_early(make_spec: Any, sqlite_url: str) -> None:
    # One trial at a time, so the startup trials are complete before any trial can be
    # pruned; a trial pruned at its last step would otherwise look unstopped.
    spec = make_spec(max_trials=8, parallel_trials=1,
                     early_stopping={"name": "median", "n_startup_trials": 2,
                                     "n_warmup_steps": 2},
                     trial={"command": branin_command(steps=30, sleep=0.02)})
    spec["algorithm"] = {"name": "random", "seed": 3}
    status = run_experiment(spec, sqlite_url)
    trials = ExperimentStore(sqlite_url).trials("branin")
    pruned = [t for t in trials if t["state"] == "pruned"]
    assert status["trials"]["pruned"] == len(pruned) >= 1
    assert status["trials"]["complete"] + len(pruned) == 8
    for t in pruned:
        log = (Path(t["trial_dir"]) / "stdout.log").read_text()
        assert "final loss" not in log, "a pruned trial ran to the end: it was not stopped"
        steps = [int(s) for s in t["intermediate"]]
        # It may print a step or two between the pruning decision and its SIGTERM.
        assert max(steps) <= log.count("step=") < 30
        assert t["value"] == t["intermediate"][str(max(steps))]  # Optuna: last report
    complete = [t for t in trials if t["state"] == "complete"]
    assert all(len(t["intermediate"]) == 31 for t in complete)  # 30 steps + the final line


def test_missing_command_fails_trials_then_the_experiment(make_spec: Any,
                                                           sqlite_url: str) -> None:
    spec = make_spec(trial={"command": "no-such-trainer-xyz ${x1}", "retries": 1},
                     max_failed_trials=1, parallel_trials=1)
    status = run_experiment(spec, sqlite_url)
    assert status["state"] == "failed"
    assert status["failed_trials"] == 2
    assert status["trials"]["failed"] == 4  # two trials, each tried twice
    assert "exceed max_failed_trials=1" in status["reason"]
    trials = ExperimentStore(sqlite_url).trials("branin")
    assert all("exit code 127" in t["fail_reason"] and "no-such-trainer-xyz" in t["fail_reason"]
               for t in trials)
    assert trials[0]["params"] == trials[1]["params"]  # the retry reused the parameters
    assert status["trials"]["waiting"] == 0


def test_metric_never_reported(make_spec: Any, sqlite_url: str) -> None:
    spec = make_spec(trial={"command": f"{sys.executable} -c \"print('training...')\""},
                     max_failed_trials=0, parallel_trials=1)
    status = run_experiment(spec, sqlite_url)
    assert status["state"] == "failed"
    reason = ExperimentStore(sqlite_url).trials("branin")[0]["fail_reason"]
    assert reason == "objective metric 'loss' never reported"


def test_retry_succeeds_with_same_params(make_spec: Any, sqlite_url: str,
                                         tmp_path: Path) -> None:
    flaky = tmp_path / "flaky.py"
    flaky.write_text(
        "import pathlib, sys\n"
        f"m = pathlib.Path({str(tmp_path)!r}) / ('seen-' + sys.argv[1])\n"
        "if not m.exists():\n    m.touch(); sys.exit('flaky failure')\n"
        "print('loss=' + sys.argv[1])\n")
    spec = make_spec(trial={"command": f"{sys.executable} {flaky} ${{x1}}", "retries": 1},
                     max_trials=3, max_failed_trials=0)
    status = run_experiment(spec, sqlite_url)
    assert status["state"] == "succeeded"
    assert status["trials"]["complete"] == 3 and status["trials"]["failed"] == 3
    trials = ExperimentStore(sqlite_url).trials("branin")
    done = [t for t in trials if t["state"] == "complete"]
    assert all(t["attempt"] == 1 for t in done)
    failed_params = sorted(t["params"]["x1"] for t in trials if t["state"] == "fail")
    assert failed_params == sorted(t["params"]["x1"] for t in done)


def test_goal_ends_the_experiment_early(make_spec: Any, sqlite_url: str) -> None:
    spec = make_spec(objective={"goal": 1000.0}, max_trials=20, parallel_trials=1)
    status = run_experiment(spec, sqlite_url)
    assert status["state"] == "succeeded"
    assert status["reason"].startswith("goal 1000.0 reached by trial 0")
    assert status["trials"]["complete"] == 1
    store = ExperimentStore(sqlite_url)
    assert store.records.slot_counts("branin")["cancelled"] == 19


def test_timeout_stops_and_fails(make_spec: Any, sqlite_url: str) -> None:
    spec = make_spec(trial={"command": f"{sys.executable} {BRANIN} ${{x1}} ${{x2}} --steps 100 "
                                       "--sleep 1", "timeout": 0.5, "kill_grace": 0.5},
                     max_trials=1, max_failed_trials=0)
    status = run_experiment(spec, sqlite_url)
    assert status["state"] == "failed"
    assert ExperimentStore(sqlite_url).trials("branin")[0]["fail_reason"] == \
        "timed out after 0.5 s"


def test_finished_experiment_rerun_and_conflicting_spec(make_spec: Any,
                                                        sqlite_url: str) -> None:
    run_experiment(make_spec(max_trials=2), sqlite_url)
    again = run_experiment(make_spec(max_trials=2, parallel_trials=1), sqlite_url)
    assert again["trials"]["complete"] == 2  # nothing re-run, nothing lost
    with pytest.raises(SpecError, match=r"different spec \(fields: max_trials\)"):
        run_experiment(make_spec(max_trials=3), sqlite_url)


def test_bad_storage_and_workdir_fail_before_work(make_spec: Any, tmp_path: Path) -> None:
    masked = r"cannot open storage 'postgresql\S*://nobody:\*\*\*@.*refused"
    with pytest.raises(StorageError, match=masked):
        run_experiment(make_spec(), "postgresql://nobody:secret@127.0.0.1:1/db")
    with pytest.raises(StorageError, match="backend 'mysql' is not supported"):
        run_experiment(make_spec(), "mysql://x@localhost/db")
    with pytest.raises(HPOError, match="trial.workdir"):
        run_experiment(make_spec(trial={"workdir": str(tmp_path / "nope")}),
                       f"sqlite:///{tmp_path / 'x.db'}")
    assert not (tmp_path / "runs").exists()


def test_gpu_pool_is_shared_without_overlap(make_spec: Any, sqlite_url: str) -> None:
    # Each trial reports its CUDA_VISIBLE_DEVICES as a metric and holds it for a while.
    spec = make_spec(resources={"gpus": [3, 5], "gpus_per_trial": 1}, parallel_trials=4,
                     max_trials=4, trial={"command": "sleep 0.3; echo loss=${x1} "
                                          '"gpu=$CUDA_VISIBLE_DEVICES"'})
    status = run_experiment(spec, sqlite_url)
    assert status["state"] == "succeeded"
    trials = ExperimentStore(sqlite_url).trials("branin")
    assert sorted(t["metrics"]["gpu"] for t in trials) == [3, 3, 5, 5]
    # Two GPUs, one per trial: never more than two trials at once, whatever parallel_trials.
    spans = [(t["started"], t["completed"]) for t in trials]
    for start, _ in spans:
        assert sum(s <= start < e for s, e in spans) <= 2


def test_trial_created_but_never_attached_is_interrupted_on_resume(make_spec: Any,
                                                               sqlite_url: str) -> None:
    from hybridtrain.hpo.leases import Leases
    from hybridtrain.hpo.spec import load_spec

    spec = load_spec(make_spec(max_trials=2, durability={"heartbeat_interval": 0.25,
                                                          "lease_duration": 1.0}))
    store = ExperimentStore(sqlite_url)
    store.create(spec)
    # A controller that claimed a slot and created its Optuna trial, then died (kill -9)
    # before attaching the trial to the slot.
    assert Leases(store.records.engine, "branin", "dead", 1.0).claim(True) is not None
    orphan = store.study("branin").ask().number
    time.sleep(1.1)
    status = run_experiment(spec, sqlite_url)
    assert status["state"] == "succeeded" and status["trials"]["complete"] == 2
    trials = {t["number"]: t for t in ExperimentStore(sqlite_url).trials("branin")}
    # The trial never ran: interrupted, not a failure of the trial.
    assert trials[orphan]["state"] == "interrupted"
    assert trials[orphan]["fail_reason"].startswith("abandoned")
    assert status["trials"]["failed"] == 0 and status["failed_trials"] == 0
