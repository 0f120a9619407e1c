"""Tensor and pipeline parallel with bf16 / fp16 mixed precision and activation
checkpointing train like one process; an fp16 overflow found on one rank's shard makes
every rank skip the step (``ParallelRuntime.all_finite``, here ``SplitRuntime``'s)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hybridtrain as ht
from tests.equivalence import SEED, Mode, engine_config
from tests.parallel.scenarios import GroupRunner, assert_equivalent, cases
from tests.parallel.spawn import run_ranks

TP2: dict[str, Any] = {"tensor_parallel": {"size": 2}}
PP2: dict[str, Any] = {"pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 2}}
BF16 = {"bf16": {"enabled": True}}
FP16 = {"fp16": {"enabled": True}}
CHECKPOINT = {"activation_checkpointing": {"enabled": True}}
GROUPS = {
    "split_precision": (2, {
        "tp2_bf16": ("gpt_tied", {**TP2, **BF16}),
        "pp2_bf16": ("gpt_tied", {**PP2, **BF16}),
        "tp2_fp16": ("gpt_tied", {**TP2, **FP16}),
        "pp2_fp16": ("gpt_tied", {**PP2, **FP16}),
        "tp2_checkpoint": ("gpt_tied", {**TP2, **CHECKPOINT, "gradient_accumulation_steps": 2}),
        "pp2_checkpoint": ("gpt_tied", {**PP2, **CHECKPOINT}),
    }),
}
RUNNER = GroupRunner(GROUPS)


@pytest.mark.parametrize(("name", "mode", "rtol", "atol"), [
    # Half-precision matmuls round differently once the batch (pipeline micro-batches) or
    # the reduction (row-parallel partial sums, all-reduced after rounding) is split: the
    # single process's own precision mode is matched within a few of that dtype's epsilons
    # (bf16 eps 7.8e-3, fp16 eps 9.8e-4). Without half precision the split is exact.
    ("pp2_bf16", "bf16", 2e-2, 2e-3),
    ("tp2_bf16", "bf16", 2e-2, 2e-3),
    ("pp2_fp16", "fp16", 2e-3, 1e-3),
    ("tp2_fp16", "fp16", 2e-3, 1e-3),
    ("tp2_checkpoint", "plain", 1e-4, 1e-5),
    ("pp2_checkpoint", "plain", 1e-4, 1e-5),
])
def test_split_model_with_precision_or_checkpointing_matches_single_process(
        name: str, mode: str, rtol: float, atol: float) -> None:
    assert_equivalent(RUNNER.find(name), "gpt_tied", rtol=rtol, atol=atol, mode=mode)


def _overflow_runs() -> dict[str, dict[str, Any]]:
    return {name: _overflow_run(config) for name, config in (("tp2", TP2), ("pp2", PP2))}


def _overflow_run(config: dict[str, Any]) -> dict[str, Any]:
    """Three fp16 steps; at the second, rank 0 alone turns one of its gradients to inf."""
    case = cases()["gpt_tied"]
    torch.manual_seed(SEED)
    batches = case.batches(3)
    engine = ht.initialize(case.build(), engine_config(Mode("fp16", {**config, **FP16})), loss_fn=case.loss_fn,
                           example_batch=batches[0])
    engine.train_batch(engine.local_batch(batches[0]))
    scale = engine.loss_scale * 2  # after the skip it may not shrink yet (hysteresis), never grow
    rank = torch.distributed.get_rank()
    param = next(p for group in engine.optimizer.param_groups for p in group["params"])
    handle = param.register_hook(lambda grad: grad * float("inf")) if rank == 0 else None
    before = engine.model_state_dict()
    engine.train_batch(engine.local_batch(batches[1]))
    after = engine.model_state_dict()
    if handle is not None:
        handle.remove()
    engine.train_batch(engine.local_batch(batches[2]))
    return {"skipped": engine.skipped_steps, "scale_not_grown": engine.loss_scale < scale,
            "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    ranks = run_ranks(_overflow_runs, 2, timeout=150)
    for name in ("tp2", "pp2"):
        outs = [rank[name] for rank in ranks]
        assert all(out == {"skipped": 1, "scale_not_grown": True, "unchanged": True} for out in outs), (name, outs)
