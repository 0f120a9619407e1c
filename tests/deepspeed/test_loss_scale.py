"""DeepSpeed's fp16 loss scale under the drop-in (:mod:`hybridtrain.deepspeed.loss_scale`): the two
update rules step by step, and fp16 training with a caller's SGD against DeepSpeed's ZeRO-0 rules
written out as a plain loop (side by side with the real DeepSpeed:
``test_master_weights.test_fp16_side_by_side_with_the_real_deepspeed_overflows_and_resume_included``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridtrain.deepspeed as deepspeed
from hybridtrain.config import ConfigError
from hybridtrain.deepspeed.loss_scale import DeepSpeedLossScale, LossScaleAtMinimumError, ScaleRule
from tests.deepspeed.fp16_reference import deepspeed_fp16_loop


def _scales(rule: ScaleRule, overflows: list[bool], consecutive: bool = False, power: int = 4,
            hysteresis: int = 2) -> list[float]:
    fp16 = SimpleNamespace(loss_scale=0.0, initial_scale_power=power, loss_scale_window=2, hysteresis=hysteresis,
                           min_loss_scale=1)
    scale = DeepSpeedLossScale.from_config(rule, fp16, consecutive)
    after = []
    for overflow in overflows:
        scale.update(overflow)
        after.append(scale.scale)
    return after


def test_zero_uses_up_the_hysteresis_first_and_grows_after_a_window() -> None:
    # 16 → (hysteresis 2→1) 16 → halve 8 → clean, clean → grows at the 2nd clean step after the next → 16
    assert _scales("zero", [True, True, False, False, False, True, False]) == [16, 8, 8, 8, 16, 16, 16]
    # without consecutive_hysteresis a clean step does not refill it: the next overflow halves again
    assert _scales("zero", [True, True, False, True]) == [16, 8, 8, 4]
    assert _scales("zero", [True, True, False, True], consecutive=True) == [16, 8, 8, 8]


def test_stage0_halves_at_every_overflow_and_stops_at_the_floor() -> None:
    assert _scales("stage0", [True, True, False, True]) == [8, 4, 4, 2]  # hysteresis is not read
    assert _scales("stage0", [True, True, True], power=1) == [1, 1, 1]  # at min_loss_scale it stays


def test_zero_ends_the_run_at_the_floor_as_deepspeed() -> None:
    with pytest.raises(LossScaleAtMinimumError, match="min_loss_scale = 1"):
        _scales("zero", [True, True], power=1, hysteresis=1)


def test_a_static_scale_never_changes() -> None:
    fp16 = SimpleNamespace(loss_scale=128.0, initial_scale_power=16, loss_scale_window=1, hysteresis=1,
                           min_loss_scale=1)
    scale = DeepSpeedLossScale.from_config("zero", fp16, False)
    for overflow in (True, False, False, True):
        scale.update(overflow)
    assert scale.scale == 128.0 and not scale.dynamic


def test_fp16_with_a_callers_sgd_trains_as_deepspeeds_stage0_rules() -> None:
    """SGD shows the scale is undone exactly (Adam would hide a wrong one): fp16 weights, fp32
    masters, the loss scaled by 2**18 (the first steps overflow and halve it, holding the schedule
    back), clipping on the unscaled norm."""
    torch.manual_seed(0)
    model, reference = nn.Linear(6, 3), nn.Linear(6, 3)
    reference.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)) for _ in range(6)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
              "fp16": {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 100}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=config)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    norms = []
    for inputs, targets in batches:
        engine.backward(F.mse_loss(engine(inputs.half()).float(), targets))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    skipped = deepspeed_fp16_loop(reference, lambda masters: torch.optim.SGD(masters, lr=0.1), batches,
                                  F.mse_loss, scale=2.0**18, clip=0.5, lr_factor=lambda step: 1.0 / (1 + step))
    assert engine.skipped_steps == skipped > 0 and engine.loss_scale == 2.0 ** (18 - skipped)
    assert norms[0] == math.inf and norms.count(math.inf) == skipped
    assert all(0 < n < 10 for n in norms if n != math.inf)  # the unscaled norm
    applied = len(batches) - skipped
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / (1 + applied))  # held at every skip
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_consecutive_hysteresis_is_refused_where_the_engines_own_scaler_runs() -> None:
    config = {"train_micro_batch_size_per_gpu": 2,  # fp32 accumulation: autocast, the engine's scaler
              "zero_optimization": {"stage": 3}, "data_types": {"grad_accum_dtype": "fp32"},
              "fp16": {"enabled": True, "consecutive_hysteresis": True}}
    with pytest.raises(ConfigError, match="consecutive_hysteresis"):
        deepspeed.initialize(model=nn.Linear(2, 2), config=config)
