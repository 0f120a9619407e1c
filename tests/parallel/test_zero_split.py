"""ZeRO inside the data-parallel dimension of a split model: FSDP2 over dp on top of
tensor-parallel DTensors (2D), and per pipeline stage; same training as one process, full
``model_state_dict``, exact resume from a checkpoint. One spawn of 4 ranks runs it all."""

from __future__ import annotations

from typing import Any

import pytest

from tests.parallel.scenarios import (
    Scenario,
    assert_equivalent,
    assert_resumed_exactly,
    resume_round_trip,
    train_scenarios,
)
from tests.parallel.spawn import run_ranks


def _zero(stage: int, **extra: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage}, "data_parallel": {"size": 2}, **extra}


TP2: dict[str, Any] = {"tensor_parallel": {"size": 2}}
PP2_1F1B: dict[str, Any] = {"pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 2}}
PP2_GPIPE: dict[str, Any] = {"pipeline": {"stages": 2, "schedule": "gpipe", "micro_batches": 2}}
PP2_INTERLEAVED: dict[str, Any] = {"pipeline": {"stages": 2, "schedule": "interleaved_1f1b", "micro_batches": 2,
                                                "virtual_stages": 2}}
SCENARIOS: dict[str, Scenario] = {
    # Stage 1 reduce-scatters on the last micro-batch only; clipping needs the dp+tp norm.
    "zero1_tp2": ("gpt_deep", _zero(1, **TP2, gradient_accumulation_steps=2, gradient_clipping=10.0)),
    "zero3_tp2": ("gpt_deep", _zero(3, **TP2)),
    "zero1_pp2": ("gpt_deep", _zero(1, **PP2_1F1B, gradient_clipping=10.0)),
    "zero3_pp2": ("gpt_deep", _zero(3, **PP2_GPIPE)),
    "zero2_pp2_interleaved": ("gpt_deep", _zero(2, **PP2_INTERLEAVED)),
}
RESUMED = {"zero3_tp2": _zero(3, **TP2), "zero1_pp2": _zero(1, **PP2_1F1B)}
_RESULTS: dict[str, list[dict[str, Any]]] = {}


def _all_runs(ckpt_dir: str) -> dict[str, Any]:
    """On one rank: the equivalence scenarios, then the checkpoint round trips."""
    return {"train": train_scenarios(SCENARIOS),
            "resume": {name: resume_round_trip("gpt_deep", config, f"{ckpt_dir}/{name}")
                       for name, config in RESUMED.items()}}


def _results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if "ranks" not in _RESULTS:
        _RESULTS["ranks"] = run_ranks(_all_runs, 4, str(tmp_path_factory.mktemp("zero_split")), timeout=240)
    return _RESULTS["ranks"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_zero_on_split_model_matches_single_process(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    assert_equivalent([rank["train"][name] for rank in _results(tmp_path_factory)], "gpt_deep")


@pytest.mark.parametrize("name", list(RESUMED))
def test_zero_on_split_model_resumes_exactly(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    for rank in _results(tmp_path_factory):
        assert_resumed_exactly(rank["resume"][name])
