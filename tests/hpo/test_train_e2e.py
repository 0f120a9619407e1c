"""An experiment whose trials are real ``hybridtrain train`` runs of the tiny GPT."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridtrain.hpo.experiments import ExperimentStore, run_experiment

pytestmark = pytest.mark.timeout(300)


def test_lr_search_on_tiny_gpt(make_spec: Any, sqlite_url: str, tmp_path: Path) -> None:
    pytest.importorskip("hybridtrain.commands.train")
    config = tmp_path / "cfg.json"  # JSON is YAML, so the trainer's YAML loader reads it
    config.write_text(json.dumps({"model": {"name": "gpt-tiny"}, "train": {"steps": 3}}))
    spec = make_spec(
        name="gpt-lr",
        parameters={"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        trial={"command": f"{sys.executable} -m hybridtrain train {config} "
                          "--set optimizer.params.lr=${lr} --set train.output_dir=${trial_dir}",
               "timeout": 240},
        algorithm={"name": "random", "seed": 1}, max_trials=2, parallel_trials=1,
        max_failed_trials=0)
    spec["algorithm"] = {"name": "random", "seed": 1}
    status = run_experiment(spec, sqlite_url)
    trials = ExperimentStore(sqlite_url).trials("gpt-lr")
    assert status["state"] == "succeeded", [t["fail_reason"] for t in trials]
    assert status["trials"]["complete"] == 2
    for t in trials:
        assert t["value"] is not None and t["value"] > 0
        # Metrics arrived from the JSONL file as well as stdout, without double counting.
        assert (Path(t["trial_dir"]) / "metrics.jsonl").is_file()
        steps = [int(s) for s in t["intermediate"]]
        assert len(steps) == len(set(steps)) and max(steps) >= 3
