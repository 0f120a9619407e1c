"""Optimizers by name and learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch

from hybridtrain.runtime.optim import build_optimizer, build_scheduler, lr_factor_fn


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(2))]


@pytest.mark.parametrize(("name", "cls"), [("adamw", torch.optim.AdamW), ("SGD", torch.optim.SGD),
                                           ("RMSprop", torch.optim.RMSprop)])
def test_optimizers_by_name(name: str, cls: type) -> None:
    assert type(build_optimizer(_params(), name, {"lr": 0.1})) is cls


@pytest.mark.parametrize(("name", "params", "cls", "weight_decay"), [
    # DeepSpeed (deepspeed/runtime/engine.py, _configure_basic_optimizer): Adam's adam_w_mode
    # defaults to true, AdamW forces it; FusedAdam's weight_decay defaults to 0.
    ("Adam", {"lr": 0.1}, torch.optim.AdamW, 0.0),
    ("Adam", {"lr": 0.1, "weight_decay": 0.1}, torch.optim.AdamW, 0.1),
    ("Adam", {"lr": 0.1, "weight_decay": 0.1, "adam_w_mode": False}, torch.optim.Adam, 0.1),
    ("AdamW", {"lr": 0.1, "adam_w_mode": False}, torch.optim.AdamW, 0.0),
    # torch_adam: torch's class with torch's defaults.
    ("Adam", {"lr": 0.1, "torch_adam": True}, torch.optim.AdamW, 0.01),
    ("adam", {"lr": 0.1, "torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, 0.0),
])
def test_deepspeed_adam_rules(name: str, params: dict, cls: type, weight_decay: float) -> None:
    opt = build_optimizer(_params(), name, params)
    assert type(opt) is cls and opt.param_groups[0]["weight_decay"] == weight_decay


@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_without_bias_correction_follows_deepspeeds_kernel(decoupled: bool) -> None:
    # DeepSpeed's multi_tensor_adam with bias_correction 0 (csrc/adam/multi_tensor_adam.cu):
    # ADAMW mode p -= lr·(m/(√v+ε) + λp); L2 mode g += λp before the moments.
    torch.manual_seed(0)
    start = torch.randn(5)
    grads = [torch.randn(5) for _ in range(4)]
    lr, (b1, b2), eps, decay = 0.1, (0.8, 0.9), 1e-6, 0.05
    param = torch.nn.Parameter(start.clone())
    opt = build_optimizer([param], "Adam", {"lr": lr, "betas": [b1, b2], "eps": eps, "weight_decay": decay,
                                            "bias_correction": False, "adam_w_mode": decoupled})
    p, m, v = start.clone().double(), torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for g in grads:
        param.grad = g.clone()
        opt.step()
        g = g.double() if decoupled else g.double() + decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (v.sqrt() + eps) + (decay * p if decoupled else 0))
    torch.testing.assert_close(param.detach().double(), p, rtol=1e-6, atol=1e-7)


def test_bad_optimizers() -> None:
    with pytest.raises(ValueError, match=r"optimizer.params.betas = \[0.9\] must be two numbers"):
        build_optimizer(_params(), "AdamW", {"betas": [0.9]})
    with pytest.raises(ValueError, match="rejected by Adam without bias correction"):
        build_optimizer(_params(), "Adam", {"bias_correction": False, "amsgrad": True})
    with pytest.raises(ValueError, match="'OneBitAdam' .*1-bit Adam.* nearest is AdamW"):
        build_optimizer(_params(), "OneBitAdam", {})
    with pytest.raises(ValueError, match="optimizer.type = 'Adamm'"):
        build_optimizer(_params(), "Adamm", {})
    with pytest.raises(ValueError, match="optimizer.params"):
        build_optimizer(_params(), "SGD", {"lr": 0.1, "betas": (0.9, 0.9)})


def test_schedules() -> None:
    constant = lr_factor_fn("constant", {"warmup_num_steps": 4})
    assert [constant(s) for s in (0, 2, 4, 100)] == [0.0, 0.5, 1.0, 1.0]
    linear = lr_factor_fn("linear", {"warmup_num_steps": 2, "total_num_steps": 6})
    assert [linear(s) for s in (1, 2, 4, 6, 9)] == [0.5, 1.0, 0.5, 0.0, 0.0]
    cosine = lr_factor_fn("cosine", {"warmup_num_steps": 0, "total_num_steps": 10, "cos_min_ratio": 0.1})
    assert cosine(0) == 1.0 and cosine(5) == pytest.approx(0.55) and cosine(10) == pytest.approx(0.1)
    log = lr_factor_fn("constant", {"warmup_num_steps": 9, "warmup_type": "log"})
    assert log(0) == 0.0 and log(4) == pytest.approx(math.log(5) / math.log(10))


def test_warmup_sets_the_learning_rates() -> None:
    opt = build_optimizer(_params(), "SGD", {"lr": 1.0})
    sched = build_scheduler(opt, "constant", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10})
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    for _ in range(10):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize(("name", "params", "needle"), [
    ("bogus", {}, "scheduler.type = 'bogus'"),
    ("cosine", {"warmup_num_steps": 5}, "total_num_steps"),
    ("linear", {"total_num_steps": 10, "typo": 1}, "'typo'"),
    ("constant", {"warmup_type": "exp"}, "warmup_type"),
])
def test_bad_schedules(name: str, params: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        lr_factor_fn(name, params)
