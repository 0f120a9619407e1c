"""The engine behind ``deepspeed.initialize`` (:mod:`hybridtrain.deepspeed.building`): ZeRO-3
parameter offload of a model without repeated blocks trains (transformers' DeepSpeed tests
offload the parameters of their two-scalar ``RegressionPreTrainedModel``), the same math as a
plain loop; and ``hybridtrain.initialize`` with ``precision_math: deepspeed`` is the drop-in's
run bit for bit."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridtrain
import hybridtrain.deepspeed as deepspeed
from hybridtrain import compose
from hybridtrain.config import ConfigError, load_config
from hybridtrain.deepspeed.building import master_weights, without_unstreamable_param_offload
from tests.deepspeed.test_master_weights import _Scaled

OFFLOAD = {"train_micro_batch_size_per_gpu": 4, "zero_force_ds_cpu_optimizer": False,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"}}}


class _Regression(nn.Module):
    """``y = a·x + b`` with two scalar parameters and no blocks, as transformers' test model."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.tensor(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + self.b


def test_zero3_parameter_offload_of_a_model_without_blocks_trains_as_a_plain_loop() -> None:
    engine, *_ = deepspeed.initialize(model=_Regression(), config=OFFLOAD)
    reference = _Regression()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(4, generator=generator)
        loss = (engine(x) - 2 * x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        (reference(x) - 2 * x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        optimizer.step()
        optimizer.zero_grad()
    engine.engine.wait_for_updates()
    for mine, theirs in zip(engine.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-5, atol=0)


def test_parameter_offload_stays_where_the_blocks_can_stream() -> None:
    cfg = load_config(dict(OFFLOAD))
    blocks = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert without_unstreamable_param_offload(cfg, blocks) is cfg
    dropped = without_unstreamable_param_offload(cfg, _Regression())
    assert dropped.zero_optimization.offload_param.device == "none"
    assert dropped.zero_optimization.offload_optimizer.device == "cpu"


# ---------------------------------------------------------------- precision_math: deepspeed
def _math_config(precision: str, stage: int) -> dict[str, Any]:
    """Accumulation 2, clipping, a warm-up, and (fp16) a window of 2 that grows the scale until
    the half gradients overflow (a skip), then shrinks it."""
    half = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2} if precision == "fp16" else \
        {"enabled": True}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01}},
            precision: half, "zero_optimization": {"stage": stage}, "precision_math": "deepspeed"}


def _math_batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """8 steps of 8 samples; step 3's targets hold a NaN (a non-finite loss: the engine skips, the
    wrapper counts an overflow), step 5's inputs an infinity (a finite loss, infinite gradients: the
    wrapper's overflow check skips)."""
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)) for _ in range(8)]
    batches[3][1][0, 0] = float("nan")
    batches[5][0][2, 1] = float("inf")
    return [(x.to(dtype), y) for x, y in batches]


def _mse(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(outputs.float(), batch[1])


@pytest.mark.parametrize(("precision", "stage"), [("fp16", 0), ("fp16", 2), ("bf16", 1)])
def test_initialize_with_deepspeed_math_is_the_drop_ins_run_bit_for_bit(precision: str, stage: int) -> None:
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    torch.manual_seed(0)
    theirs_model = _Scaled()
    ours_model = copy.deepcopy(theirs_model)
    theirs, *_ = deepspeed.initialize(model=theirs_model, config=_math_config(precision, stage))
    ours = hybridtrain.initialize(ours_model, _math_config(precision, stage), loss_fn=_mse)
    assert all(p.dtype == dtype for p in ours.module.parameters())
    rows: tuple[list[Any], list[Any]] = ([], [])
    for inputs, targets in _math_batches(dtype):
        for half in (slice(0, 4), slice(4, 8)):
            theirs.backward(_mse(theirs(inputs[half]), (inputs[half], targets[half])))
            theirs.step()
        loss = ours.train_batch((inputs, targets))
        rows[0].append((theirs.get_lr(), theirs.loss_scale, theirs.skipped_steps))
        rows[1].append((ours.get_lr(), ours.optimizer.cur_scale, ours.skipped_steps))
        assert math.isfinite(loss) == (len(rows[1]) != 4)
    assert rows[0] == rows[1]
    assert rows[1][-1][2] >= 2  # the NaN loss and the infinite gradients (fp16: and overflows)
    assert (len({scale for _, scale, _ in rows[1]}) > 1) == (precision == "fp16")  # fp16's scale moved
    for mine, reference in zip(ours.module.parameters(), theirs.module.parameters(), strict=True):
        assert torch.equal(mine, reference)


def test_deepspeed_math_is_refused_in_one_line_where_it_cannot_run() -> None:
    config = {**_math_config("bf16", 0), "layer_streaming": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"^precision_math = 'deepspeed' cannot run with layer_streaming\.enabled "
                                          r"= true; allowed there: 'autocast'"):
        hybridtrain.initialize(_Scaled(), config)
    with pytest.raises(ConfigError, match=r"^precision_math = 'deepspeed' is not available in "
                                          r"hybridtrain\.compose\.initialize"):
        compose.initialize(_Scaled(), _math_config("bf16", 0))


def test_autocast_math_is_a_choice_under_the_drop_in_too() -> None:
    engine, *_ = deepspeed.initialize(model=_Scaled(), config={**_math_config("bf16", 0), "precision_math": "autocast"})
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())


@pytest.mark.parametrize(("world", "stage", "expected"), [("2", 1, True), ("2", 2, True), ("1", 2, False),
                                                          ("2", 0, False), ("2", 3, False)])
def test_fp32_takes_deepspeeds_zero_wrapper_where_deepspeed_keeps_whole_parameters(
        monkeypatch: pytest.MonkeyPatch, world: str, stage: int, expected: bool) -> None:
    """ZeRO-1/2 on several processes: whole fp32 parameters on every rank, fp32 masters partitioned
    (checkpoint/test_real_deepspeed.py trains it on 2 ranks against the real DeepSpeed)."""
    monkeypatch.setenv("WORLD_SIZE", world)
    raw = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    assert master_weights(raw, load_config(dict(raw))) is expected
