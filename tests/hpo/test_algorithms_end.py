"""Every algorithm and early-stopping rule ends an experiment with exactly ``max_trials``
finished trials and a final state (issue 11, item 1)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hybridtrain.hpo.experiments import ExperimentStore, run_experiment
from tests.hpo.conftest import branin_command

pytestmark = pytest.mark.timeout(120)

# A grid of exactly 6 points: x1 in {-5, 2.5, 10}, x2 in {0, 15}.
GRID_PARAMS = {"x1": {"type": "float", "low": -5.0, "high": 10.0, "step": 7.5},
               "x2": {"type": "int", "low": 0, "high": 15, "step": 15}}


def _assert_ended_with_exactly(status: dict[str, Any], store: ExperimentStore,
                               max_trials: int) -> None:
    assert status["state"] == "succeeded", status
    counts = status["trials"]
    assert counts["complete"] + counts["pruned"] == max_trials, counts
    assert counts["failed"] == counts["running"] == counts["waiting"] == 0, counts
    assert store.records.slot_counts(status["name"])["done"] == max_trials


@pytest.mark.parametrize("algorithm", ["random", "grid", "tpe", "cmaes", "qmc", "gp"])
def test_algorithm_ends_with_exactly_max_trials(algorithm: str, make_spec: Any,
                                                sqlite_url: str) -> None:
    # max_trials equals the grid size: the grid sampler is exhausted by the last trial,
    # which used to crash the controller in Optuna's study.stop().
    spec = make_spec(parameters=GRID_PARAMS, max_trials=6, parallel_trials=2)
    spec["algorithm"] = {"name": algorithm, "seed": 0}  # replace, not merge, TPE's options
    status = run_experiment(spec, sqlite_url)
    store = ExperimentStore(sqlite_url)
    _assert_ended_with_exactly(status, store, 6)
    if algorithm == "grid":
        points = {json.dumps(t["params"], sort_keys=True) for t in store.trials("branin")}
        assert len(points) == 6, points  # every grid point exactly once


@pytest.mark.parametrize("rule", [{"name": "median", "n_startup_trials": 2},
                                  {"name": "percentile", "percentile": 25.0},
                                  {"name": "asha", "min_resource": 1},
                                  {"name": "hyperband", "min_resource": 1, "max_resource": 4}],
                         ids=lambda r: r["name"])
def test_early_stopping_ends_with_exactly_max_trials(rule: dict[str, Any], make_spec: Any,
                                                     sqlite_url: str) -> None:
    spec = make_spec(early_stopping=rule, trial={"command": branin_command(steps=4)},
                     max_trials=6)
    status = run_experiment(spec, sqlite_url)
    _assert_ended_with_exactly(status, ExperimentStore(sqlite_url), 6)
