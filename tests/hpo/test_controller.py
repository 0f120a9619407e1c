"""End-to-end experiments in this process: search, pruning, failures, retries, goal."""

from __future__ import annotations

import sys
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


def test_pruning_stops_bad_trials_early(make_spec: Any, sqlite_url: str) -> None:
    spec = make_spec(max_trials=10, parallel_trials=2,
                     early_stopping={"name": "median", "n_startup_trials": 3,
                                     "n_warmup_steps": 2},
                     algorithm={"name": "random", "seed": 3},
                     trial={"command": branin_command(steps=20, sleep=0.03)})
    spec["algorithm"] = {"name": "random", "seed": 3}
    status = run_experiment(spec, sqlite_url)
    pruned = [t for t in ExperimentStore(sqlite_url).trials("branin") if t["state"] == "pruned"]
    assert status["trials"]["pruned"] == len(pruned) >= 1
    assert status["trials"]["complete"] + len(pruned) == 10
    for t in pruned:
        lines = (Path(t["trial_dir"]) / "stdout.log").read_text().count("step=")
        assert lines < 20, "a pruned trial ran to the end: it was not stopped"
        assert t["value"] is not None


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
