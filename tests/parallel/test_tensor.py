"""Tensor parallel (DTensor): GPT with fused qkv and HF Llama train like one process;
DP × TP, TP × PP; plans and bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hybridtrain as ht
from tests.parallel.scenarios import GroupRunner, assert_equivalent


def _tp(size: int, **extra: Any) -> dict[str, Any]:
    return {"tensor_parallel": {"size": size}, **extra}


GROUPS = {
    "tensor2ranks": (2, {
        "tp2": ("gpt_tied", {"tensor_model_parallel_size": 2, "gradient_accumulation_steps": 2,
                             "gradient_clipping": 10.0}),
        "tp2_llama": ("hf_llama", _tp(2)),
        "tp2_frozen": ("gpt_frozen", _tp(2)),
    }),
    "tensor4ranks": (4, {
        "dp2_tp2": ("gpt_deep", _tp(2, data_parallel={"size": 2})),
        "tp2_pp2": ("gpt_deep", _tp(2, pipeline={"stages": 2, "schedule": "1f1b", "micro_batches": 2})),
        "tp4_llama_plan": ("hf_llama", {"tensor_parallel": {"size": 2, "plan": {
            "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.gate_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise"}}, "data_parallel": {"size": 2}}),
    }),
}
RUNNER = GroupRunner(GROUPS)
CASES = [(name, case) for _, scenarios in GROUPS.values() for name, (case, _) in scenarios.items()]


@pytest.mark.parametrize(("name", "case"), CASES)
def test_tensor_parallel_matches_single_process(name: str, case: str) -> None:
    if case.startswith("hf_"):
        pytest.importorskip("transformers")
    assert_equivalent(RUNNER.find(name), case)


@pytest.mark.parametrize(("build", "config", "match"), [
    ("gpt_tied", _tp(4), "n_head=2 not divisible by tensor parallel size 4"),
    ("sequential", _tp(2), "tensor parallel has no plan for MLPStack"),
    ("sequential", _tp(2, tensor_parallel={"size": 2, "plan": {"9": "colwise"}}), "matches no module"),
    ("sequential", _tp(2, tensor_parallel={"size": 2, "plan": {"1": "colwise"}}), "shards nn.Linear layers"),
    ("gpt_tied", {"tensor_model_parallel_size": 2, "data_parallel": {"gradient_compression": "fp16"}},
     "gradient_compression needs DDP"),
    ("gpt_deep", {"pipeline": {"stages": 2, "schedule": "zero_bubble", "micro_batches": 2},
                  "zero_optimization": {"stage": 2}, "data_parallel": {"size": 2}},
     "does not compose with pipeline schedule zero_bubble"),
])
def test_bad_tensor_parallel_input_is_refused_before_any_collective(
        build: str, config: dict[str, Any], match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.parallel.scenarios import cases

    world = config.get("tensor_parallel", {}).get("size", 2) * config.get("data_parallel", {}).get("size", 1)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ht.ConfigError, match=match):
        case = cases()[build]
        ht.initialize(case.build(), {"device": "cpu", **config}, example_batch=case.batches(1)[0])


def test_user_plan_expands_patterns_to_linear_layers() -> None:
    from hybridtrain.parallel.tensor import qkv_from_user, qkv_to_user, resolve_plan
    from tests.parallel.scenarios import cases

    model = cases()["gpt_tied"].build()
    plan = resolve_plan(model, {}, 2)
    assert plan["blocks.2.attn.qkv"] == "colwise" and plan["blocks.0.mlp.proj"] == "rowwise"
    assert len(plan) == 12
    weight = torch.arange(12.0).reshape(6, 2)  # rows Q0 Q1 K0 K1 V0 V1 (d_model 2, 2 ranks)
    interleaved = qkv_from_user(weight, 2)
    assert interleaved[:, 0].tolist() == [0.0, 4.0, 8.0, 2.0, 6.0, 10.0]  # rank 0: Q0 K0 V0
    assert torch.equal(qkv_to_user(interleaved, 2), weight)


class _OwnPlan(torch.nn.Module):
    """A model outside hybridtrain bringing its plan through the discovery methods."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(4, 12), torch.nn.Linear(4, 4)

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"qkv": "colwise", "out": "rowwise"}

    def tensor_parallel_heads(self) -> dict[str, int]:
        return {"heads": 2}

    def tensor_parallel_fused_qkv(self) -> list[str]:
        return ["qkv"]


def test_any_model_brings_its_plan_heads_and_fused_qkv() -> None:
    from hybridtrain.parallel.tensor import fused_qkv, resolve_plan

    model = _OwnPlan()
    plan = resolve_plan(model, {}, 2)
    assert plan == {"qkv": "colwise", "out": "rowwise"}
    assert fused_qkv(model, plan) == ["qkv"]
    assert fused_qkv(torch.nn.Sequential(torch.nn.Linear(4, 12)), {"0": "colwise"}) == []
    with pytest.raises(ValueError, match="heads=2 not divisible by tensor parallel size 4"):
        resolve_plan(model, {}, 4)
