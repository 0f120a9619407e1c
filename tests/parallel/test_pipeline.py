"""Pipeline parallel: every schedule trains like one process (tied embeddings on the end
stages, HF Llama's masks and rotary tables recomputed per stage), DP × PP, partitions."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hybridtrain as ht
from tests.parallel.scenarios import GroupRunner, assert_equivalent
from tests.parallel.spawn import run_ranks


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
        # The head is `h @ self.emb.weight.T` in forward: both end stages use the embedding.
        "inline_tied": ("inline_tied", _pp("1f1b", 2)),
        "inline_tied_interleaved": ("inline_tied", _pp("interleaved_1f1b", 4, virtual_stages=2)),
        # A parameter with two names: the state dict takes both from the stage that trains it.
        "1f1b_bert": ("hf_bert", _pp("1f1b", 2)),
        # Frozen parameters on both stages (a wholly frozen block among them): gradients
        # still flow back through them, and nothing steps them.
        "1f1b_frozen": ("gpt_frozen", _pp("1f1b", 2)),
    }),
    "pipeline4ranks": (4, {
        "dp2_pp2": ("gpt_tied", {"data_parallel": {"size": 2}, **_pp("1f1b", 2)}),
        "pp4_gpipe_time": ("gpt_deep", _pp("gpipe", 4, stages=4)),
        "dp2_pp2_inline_tied": ("inline_tied", {"data_parallel": {"size": 2}, **_pp("gpipe", 2)}),
    }),
}
RUNNER = GroupRunner(GROUPS)
CASES = [(name, case) for _, scenarios in GROUPS.values() for name, (case, _) in scenarios.items()]


@pytest.mark.parametrize(("name", "case"), CASES)
def test_pipeline_matches_single_process(name: str, case: str) -> None:
    if case.startswith("hf_"):
        pytest.importorskip("transformers")
    assert_equivalent(RUNNER.find(name), case)


def _refused(config: dict[str, Any], world: int, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # WORLD_SIZE without a process group: the error must come before any collective.
    from tests.parallel.scenarios import cases

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ht.ConfigError, match=match):
        case = cases()["gpt_tied"]
        ht.initialize(case.build(), {"device": "cpu", **config}, example_batch=case.batches(1)[0])


@pytest.mark.parametrize(("config", "world", "match"), [
    (_pp("1f1b", 4, stages=3), 4, "do not divide the world size 4"),
    (_pp("gpipe", 4, stages=4), 4, "4 stages .* but the model has 3 blocks"),
    (_pp("gpipe", 2, partition=[2, 2]), 2, r"partition \[2, 2\] must be positive block counts adding up"),
    (_pp("1f1b", 1), 2, "1f1b needs at least as many micro-batches as stages"),
    (_pp("gpipe", 2, virtual_stages=2), 2, "virtual_stages=2 needs schedule interleaved_1f1b"),
    ({**_pp("gpipe", 2), "layer_streaming": {"enabled": True}}, 2, "layer_streaming runs on one process"),
    ({**_pp("gpipe", 2), "device_map": {"blocks.0": "cpu"}}, 2, "device_map .* does not compose"),
    ({**_pp("gpipe", 2), "pipeline_model_parallel_size": 4}, 2, "they are the same setting"),
    ({**_pp("gpipe", 2), "gradient_accumulation_steps": 4}, 2, "micro_batches=2 but gradient_accumulation_steps=4"),
])
def test_bad_pipeline_input_is_refused_before_any_collective(config: dict[str, Any], world: int, match: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _refused(config, world, match, monkeypatch)


def test_engine_trio_is_refused_under_a_pipeline() -> None:
    ranks = run_ranks(_trio_error, 2, timeout=60)
    assert all("use engine.train_batch" in message for message in ranks)


def _trio_error() -> str:
    from tests.parallel.scenarios import cases

    case = cases()["gpt_tied"]
    engine = ht.initialize(case.build(), {"device": "cpu", **_pp("gpipe", 2)}, loss_fn=case.loss_fn,
                           example_batch=case.batches(1)[0])
    try:
        engine(case.batches(1)[0][0])
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_pipelined_evaluation_matches_one_process() -> None:
    from tests.parallel.scenarios import cases

    case = cases()["gpt_tied"]
    batch = case.batches(1)[0]
    torch.manual_seed(1234)
    model = case.build()
    with torch.no_grad():
        expected = float(case.plain_loss(model.eval(), batch))
    losses = run_ranks(_pipelined_eval, 2, timeout=60)
    assert losses[0] == losses[1]
    assert abs(losses[0] - expected) <= 1e-5 * abs(expected)


def _pipelined_eval() -> float:
    from tests.parallel.scenarios import cases

    case = cases()["gpt_tied"]
    batch = case.batches(1)[0]
    torch.manual_seed(1234)
    engine = ht.initialize(case.build(), {"device": "cpu", **_pp("1f1b", 2)}, loss_fn=case.loss_fn,
                           example_batch=batch)
    return engine.eval_batch(batch)


@pytest.mark.cuda
def test_cuda_block_times_are_device_time_not_launch_time() -> None:
    """``partition: time`` on CUDA: host clocks around a block measure how long its kernels
    took to *queue*; events measure the work. A block of 8 large matmuls must time far
    above a block of one small one (their launch times are alike)."""
    from hybridtrain.parallel.partition import time_blocks

    torch.manual_seed(0)
    small = torch.nn.Linear(64, 64)
    large = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)])
    model = torch.nn.Sequential(small, torch.nn.Linear(64, 4096), large).cuda()
    x = torch.randn(2048, 64, device="cuda")
    seconds = time_blocks(model, [small, large], lambda: model(x).square().mean())
    assert seconds[1] > 20 * seconds[0] > 0, seconds
