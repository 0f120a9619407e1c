"""What ``build`` decides from a plan without running it."""

from __future__ import annotations

import math

import pytest

from hybridtrain.plan.build import optimizer_params
from hybridtrain.plan.resolve import resolve
from tests.equivalence import gpt_case

ADAM = {"type": "AdamW", "params": {"lr": 1e-3}}


@pytest.mark.parametrize(("zero", "optimizer", "fused"), [
    ({"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}, ADAM, True),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, ADAM, True),
    ({"stage": 3}, ADAM, None),  # on the device: torch picks its own implementation
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {"type": "SGD", "params": {"lr": 0.1}}, None),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}},
     {"type": "AdamW", "params": {"lr": 1e-3, "fused": False}}, False),  # the user's choice stands
])
def test_zero_offload_steps_with_the_fused_host_adam(zero: dict, optimizer: dict, fused: bool | None) -> None:
    plan = resolve({"device": "cpu", "train_micro_batch_size_per_gpu": 2, "optimizer": optimizer,
                    "zero_optimization": zero}, gpt_case().build(), world_size=2)
    assert optimizer_params(plan).get("fused") == fused


def _build_on_meta_under_zero3(layers: int, width: int) -> dict[str, float]:
    """One rank: build a GPT on the meta device, initialize it under ZeRO-3, count the
    tensor bytes this rank held at most while building, then train a step."""
    import torch

    import hybridtrain as ht
    from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
    from hybridtrain.runtime.memory_limit import LiveTensorBytes

    cfg = GPTConfig(n_layer=layers, n_head=4, d_model=width, seq_len=16, vocab_size=256)
    with torch.device("meta"):
        model = GPT(cfg)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    torch.manual_seed(0)
    config = {"device": "cpu", "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3}}
    with LiveTensorBytes("cpu") as live:
        engine = ht.initialize(model, config, loss_fn=causal_lm_loss)
    held = sum(p.to_local().numel() * p.element_size() for p in engine.module.parameters())  # type: ignore[attr-defined]
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    first = engine.module.blocks[0].mlp.fc.weight.to_local()  # type: ignore[union-attr]
    shard = (float(first.mean()), float(first.std()))
    loss = engine.train_batch(engine.local_batch((tokens[:, :-1], tokens[:, 1:])))
    return {"full": full, "largest": largest, "peak": live.peak_bytes, "held": held, "loss": loss, "shard": shard}


def test_zero3_builds_a_meta_model_with_half_the_bytes_per_rank() -> None:
    """~100M parameters on 2 gloo ranks: each materializes and initializes its half only."""
    from tests.parallel.spawn import run_ranks

    ranks = run_ranks(_build_on_meta_under_zero3, 2, 14, 768, timeout=240)
    for r in ranks:
        assert 95e6 * 4 < r["full"] < 110e6 * 4
        # Its shards (half of every parameter, rounded up per tensor) and, at most, one
        # parameter more in flight; the full model would be twice that.
        assert r["held"] <= r["full"] / 2 + r["largest"]
        assert 0.45 * r["full"] <= r["peak"] <= r["full"] / 2 + 2 * r["largest"], r
    # Each rank drew its own shard (GPT-2's std 0.02), not a copy of the other's.
    assert ranks[0]["shard"] != ranks[1]["shard"] and all(abs(r["shard"][1] - 0.02) < 2e-3 for r in ranks)
    # GPT-2's init gives a loss near ln(vocab); both ranks report the same mean.
    assert ranks[0]["loss"] == ranks[1]["loss"] and abs(ranks[0]["loss"] - math.log(256)) < 0.5


def test_build_reads_the_plan_never_the_config() -> None:
    # Decide, then do: every knob build applies was decided by resolve and is a field of the
    # plan; build.py reads no `plan.config` (nor a config it was handed).
    import ast
    from pathlib import Path

    import hybridtrain.plan.build as build_module

    tree = ast.parse(Path(build_module.__file__).read_text())
    reads = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "config"
             and isinstance(node.value, ast.Name) and node.value.id == "plan"]
    names = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "cfg"]
    assert not reads and not names, f"build.py reads the config at lines {reads + names}"


def test_the_plan_carries_the_configs_knobs() -> None:
    config = {"device": "cpu", "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
              "nonfinite_loss": "skip", "wall_clock_breakdown": True,
              "fp16": {"enabled": True, "loss_scale_window": 7, "hysteresis": 3},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
              "activation_offload": {"enabled": True, "prefetch_blocks": 2, "min_bytes": 0},
              "distributed": {"timeout_s": 30}, "data_parallel": {"bucket_cap_mb": 5},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    one = resolve(config, gpt_case().build(), world_size=1)
    assert (one.step_rules.gradient_clipping, one.step_rules.nonfinite_loss, one.step_rules.wall_clock_breakdown) \
        == (0.5, "skip", True)
    assert one.loss_scaler is not None and (one.loss_scaler.window, one.loss_scaler.hysteresis) == (7, 3)
    assert one.scheduler is not None and (one.scheduler.type, dict(one.scheduler.params)) == (
        "WarmupLR", {"warmup_num_steps": 5})
    assert (one.swap.prefetch_blocks, one.swap.min_bytes, one.collective_timeout_s) == (2, 0, 30)
    assert one.data_parallel.bucket_cap_mb == 5 and one.state_by_name and not one.zero_offload
    two = resolve(config, gpt_case().build(), world_size=2)
    assert two.zero_offload and two.zero_stage == 2
    assert resolve({"device": "cpu"}, gpt_case().build(), world_size=1).loss_scaler is None
