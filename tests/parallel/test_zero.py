"""ZeRO 1/2/3 on FSDP2: same training as one process (± offload, ± activation
checkpointing, with accumulation), full state from ``model_state_dict``, exact resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hybridtrain as ht
from tests.parallel.scenarios import (
    GroupRunner,
    assert_equivalent,
    assert_resumed_exactly,
    resume_round_trip,
)
from tests.parallel.spawn import run_ranks


def _zero(stage: int, **extra: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage, **extra}}


GROUPS = {
    "zero2ranks": (2, {
        "stage1": ("gpt_tied", {**_zero(1), "gradient_accumulation_steps": 2}),
        "stage2": ("gpt_tied", {**_zero(2), "gradient_accumulation_steps": 2}),
        "stage3": ("gpt_tied", _zero(3)),
        "stage3_offload": ("gpt_tied", _zero(3, offload_param={"device": "cpu"},
                                               offload_optimizer={"device": "cpu"})),
        "stage3_checkpointing": ("gpt_tied", {**_zero(3), "activation_checkpointing": {"enabled": True},
                                              "gradient_clipping": 10.0}),
        "stage3_llama": ("hf_llama", {**_zero(3), "gradient_accumulation_steps": 2}),
        "stage3_swap": ("gpt_tied", {**_zero(3), "activation_offload": {"enabled": True},
                                     "gradient_accumulation_steps": 2}),
        "stage2_swap_checkpointing": ("gpt_tied", {**_zero(2), "activation_checkpointing": {
            "enabled": True, "cpu_checkpointing": True}}),
        # A fine-tune's frozen parameters: sharded like the rest, never stepped.
        "stage1_frozen": ("gpt_frozen", {**_zero(1), "gradient_accumulation_steps": 2}),
        "stage2_frozen": ("gpt_frozen", _zero(2)),
        "stage3_frozen_offload": ("gpt_frozen", _zero(3, offload_param={"device": "cpu"},
                                                      offload_optimizer={"device": "cpu"})),
    }),
    "zero4ranks": (4, {"stage3_4": ("gpt_tied", _zero(3))}),
}
RUNNER = GroupRunner(GROUPS)


@pytest.mark.parametrize(("name", "case"), [
    ("stage1", "gpt_tied"), ("stage2", "gpt_tied"), ("stage3", "gpt_tied"), ("stage3_offload", "gpt_tied"),
    ("stage3_checkpointing", "gpt_tied"), ("stage3_llama", "hf_llama"), ("stage3_4", "gpt_tied"),
    ("stage3_swap", "gpt_tied"), ("stage2_swap_checkpointing", "gpt_tied"), ("stage1_frozen", "gpt_frozen"),
    ("stage2_frozen", "gpt_frozen"), ("stage3_frozen_offload", "gpt_frozen"),
])
def test_zero_matches_single_process(name: str, case: str) -> None:
    if case.startswith("hf_"):
        pytest.importorskip("transformers")
    assert_equivalent(RUNNER.find(name), case)


def _optimizer_shard_rows(engine: ht.Engine) -> dict[str, Any]:
    # A shard-local view of the optimizer state: ZeRO keeps 1/N of it per rank.
    state = engine.optimizer.state[next(iter(engine.optimizer.state))]
    return {"local_rows": state["exp_avg"].to_local().shape[0], "full_rows": state["exp_avg"].shape[0]}


def _resume_runs(ckpt_dir: str) -> dict[int, dict[str, Any]]:
    return {stage: resume_round_trip("gpt_tied", _zero(stage), f"{ckpt_dir}/stage{stage}", _optimizer_shard_rows)
            for stage in (1, 3)}


def test_zero_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    ranks = run_ranks(_resume_runs, 2, str(tmp_path), timeout=150)
    for out in (rank[stage] for rank in ranks for stage in (1, 3)):
        assert_resumed_exactly(out)
        assert out["local_rows"] * 2 == out["full_rows"]
    assert (tmp_path / "stage3" / "ckpt" / "meta.json").exists()


def test_user_optimizer_with_zero_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ht.ConfigError, match="pass optimizer=None"):
        ht.initialize(model, {"device": "cpu", **_zero(2)}, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_offload_a_stage_does_not_use_is_ignored_as_deepspeed_ignores_it() -> None:
    from hybridtrain.plan import resolve

    for stage, offload in ((0, "offload_optimizer"), (0, "offload_param"), (2, "offload_param")):
        plan = resolve({"device": "cpu", **_zero(stage, **{offload: {"device": "cpu"}})}, torch.nn.Linear(2, 2),
                       world_size=1)
        assert plan.optimizer.placement == "device" and not plan.blocks_where("stream")
