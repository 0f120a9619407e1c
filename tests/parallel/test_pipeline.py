"""Pipeline parallel: every schedule trains like one process (tied embeddings on the end
stages, HF Llama's masks and rotary tables recomputed per stage), DP × PP, partitions."""

from __future__ import annotations

from typing import Any

import pytest

from tests.parallel.scenarios import GroupRunner, assert_equivalent


def _pp(schedule: str, micro: int, stages: int = 2, **extra: Any) -> dict[str, Any]:
    return {"pipeline": {"stages": stages, "schedule": schedule, "micro_batches": micro, **extra}}


GROUPS = {
    "pipeline2ranks": (2, {
        "gpipe": ("gpt_tied", _pp("gpipe", 2, partition="params")),
        "1f1b": ("gpt_tied", {"pipeline_model_parallel_size": 2, "gradient_accumulation_steps": 4,
                              "pipeline": {"schedule": "1f1b"}}),
        "interleaved": ("gpt_deep", _pp("interleaved_1f1b", 4, virtual_stages=2, partition="uniform")),
        "zero_bubble": ("gpt_deep", _pp("zero_bubble", 4, virtual_stages=2, partition=[1, 1, 1, 1])),
        "1f1b_llama": ("hf_llama", _pp("1f1b", 2)),
    }),
    "pipeline4ranks": (4, {
        "dp2_pp2": ("gpt_tied", {"data_parallel": {"size": 2}, **_pp("1f1b", 2)}),
        "pp4_gpipe_time": ("gpt_deep", _pp("gpipe", 4, stages=4)),
    }),
}
RUNNER = GroupRunner(GROUPS)
CASES = [(name, case) for _, scenarios in GROUPS.values() for name, (case, _) in scenarios.items()]


@pytest.mark.parametrize(("name", "case"), CASES)
def test_pipeline_matches_single_process(name: str, case: str) -> None:
    if case.startswith("hf_"):
        pytest.importorskip("transformers")
    assert_equivalent(RUNNER.find(name), case)
