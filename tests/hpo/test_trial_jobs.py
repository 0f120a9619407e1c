"""HPO trials run as training-service jobs: they queue with the other jobs, get devices
from the same allocator, and an experiment file runs unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridtrain.hpo.experiments import ExperimentStore, run_experiment
from hybridtrain.service.store import JobStore
from tests.hpo.conftest import branin_command

pytestmark = pytest.mark.timeout(180)


def test_trials_are_jobs_with_devices_of_the_service(make_spec: Any, sqlite_url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Two device slots named as GPUs (each trial reads its CUDA_VISIBLE_DEVICES only), and
    # three trials allowed at once by the experiment: the service's gang holds them to two.
    monkeypatch.setenv("HYBRIDTRAIN_SERVICE_DEVICES", "gpu:0,1")
    spec = make_spec(resources={"gpus": [0, 1, 2], "gpus_per_trial": 1}, parallel_trials=3,
                     max_trials=5, trial={"command": "sleep 0.3; echo loss=${x1} "
                                          '"gpu=$CUDA_VISIBLE_DEVICES"'})
    status = run_experiment(spec, sqlite_url)
    assert status["state"] == "succeeded" and status["trials"]["complete"] == 5
    trials = {t["number"]: t for t in ExperimentStore(sqlite_url).trials("branin")}
    jobs = JobStore(sqlite_url).jobs(kind="trial")
    assert sorted(j.trial_number for j in jobs) == sorted(trials)
    for job in jobs:
        assert job.state == "succeeded" and job.experiment == "branin"
        assert len(job.devices) == 1 and job.devices[0] in (0, 1)
        # The trial saw the device the service gave its job.
        assert trials[job.trial_number]["metrics"]["gpu"] == job.devices[0]
        assert Path(job.job_dir) == Path(trials[job.trial_number]["trial_dir"])
    for job in jobs:
        overlapping = [o for o in jobs if o is not job and o.devices == job.devices
                       and (o.started_at or 0) < (job.finished_at or 0)
                       and (job.started_at or 0) < (o.finished_at or 0)]
        assert not overlapping, (job.name, [o.name for o in overlapping])


def test_trials_their_pruner_stopped_are_pruned_jobs(make_spec: Any, sqlite_url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDTRAIN_SERVICE_DEVICES", "cpu:1")
    # One trial at a time: the startup trials complete before any can be pruned.
    spec = make_spec(max_trials=6, parallel_trials=1,
                     early_stopping={"name": "median", "n_startup_trials": 2,
                                     "n_warmup_steps": 2},
                     trial={"command": branin_command(steps=30, sleep=0.02)})
    spec["algorithm"] = {"name": "random", "seed": 3}
    run_experiment(spec, sqlite_url)
    trials = {t["number"]: t["state"] for t in ExperimentStore(sqlite_url).trials("branin")}
    jobs = {j.trial_number: j for j in JobStore(sqlite_url).jobs(kind="trial")}
    assert "pruned" in trials.values()
    for number, state in trials.items():
        job = jobs[number]
        assert job.state == {"pruned": "pruned", "complete": "succeeded"}[state], job.reason
        if state == "pruned":
            assert job.reason.startswith("pruned by its HPO pruner: "), job.reason


def test_on_a_machine_without_gpus_a_trial_takes_a_core_like_any_job(
        make_spec: Any, sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # One core, two trials allowed at once by the experiment: the service runs one at a time.
    monkeypatch.setenv("HYBRIDTRAIN_SERVICE_DEVICES", "cpu:1")
    spec = make_spec(parallel_trials=2, max_trials=3, trial={"command": "sleep 0.2; echo loss=${x1}"})
    assert run_experiment(spec, sqlite_url)["state"] == "succeeded"
    jobs = JobStore(sqlite_url).jobs(kind="trial")
    assert [(j.spec.devices, j.devices) for j in jobs] == [(1, (0,))] * 3
    spans = sorted((j.started_at or 0.0, j.finished_at or 0.0) for j in jobs)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False)), spans
