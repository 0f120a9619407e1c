"""Optimizers by name and learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch

from hybridtrain.optim import (
    build_optimizer,
    build_scheduler,
    lr_factor_fn,
    optimizer_state_bytes,
    take_fp16_init_step,
)


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
    with pytest.raises(ValueError, match="'Lion' .*the Lion optimizer.* nearest is AdamW"):
        build_optimizer(_params(), "Lion", {})
    # deepspeed/runtime/engine.py, _configure_basic_optimizer: max_grad_norm is refused whatever the optimizer.
    refused = r"^optimizer.params.max_grad_norm = 1.0: DeepSpeed refuses it .*use gradient_clipping$"
    with pytest.raises(ValueError, match=refused):
        build_optimizer(_params(), "Adam", {"lr": 0.1, "max_grad_norm": 1.0})
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


# DeepSpeed's optimizer for each config, as a torch class of the same math
# (deepspeed/runtime/engine.py, _configure_basic_optimizer: FusedAdam with adam_w_mode, which
# Adam defaults to and AdamW forces; adam_w_mode false is Adam with L2 decay, grad += λ·p).
WRAPPED = [
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}, torch.optim.AdamW),
    ("AdamW", {"lr": 1e-2}, torch.optim.AdamW),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1}, torch.optim.AdamW),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}, torch.optim.Adam),
    ("Adam", {"lr": 1e-2, "adam_w_mode": False}, torch.optim.Adam),
]


@pytest.fixture(scope="module")
def deepspeed_wrappers() -> dict[str, type]:
    from deepspeed.runtime.fp16 import unfused_optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    # FP16_UnfusedOptimizer only logs with the rank; one process here.
    unfused_optimizer.dist.get_rank = lambda *args, **kwargs: 0
    return {"fused": FP16_Optimizer, "unfused": unfused_optimizer.FP16_UnfusedOptimizer}


@pytest.mark.parametrize(("name", "params", "theirs"), WRAPPED, ids=lambda v: str(v) if isinstance(v, dict) else None)
@pytest.mark.parametrize("wrapper", ["fused", "unfused"])
def test_fp16_init_step_is_deepspeeds_fp16_init_step(deepspeed_wrappers: dict[str, type], name: str,
                                                   params: dict, theirs: type, wrapper: str) -> None:
    # DeepSpeed's own wrapper (deepspeed/runtime/fp16/fused_optimizer.py FP16_Optimizer, for
    # FusedAdam; unfused_optimizer.py FP16_UnfusedOptimizer, for any other optimizer) steps
    # its optimizer once with zero gradients in __init__ (initialize_optimizer_states); then
    # both train on the same gradients.
    torch.manual_seed(0)
    half = [torch.nn.Parameter(torch.randn(shape).half()) for shape in [(4, 3), (3,)]]
    ours = [torch.nn.Parameter(p.detach().float()) for p in half]
    # FusedAdam's weight_decay defaults to 0 (torch's AdamW to 0.01).
    inner = theirs(half, **{"weight_decay": 0.0, **{k: v for k, v in params.items() if k != "adam_w_mode"}})
    wrapped = deepspeed_wrappers[wrapper](inner, static_loss_scale=1.0)
    masters = [wrapped.fp32_groups_flat[0]] if wrapper == "fused" else wrapped.fp32_groups[0]
    optimizer = build_optimizer(ours, name, params)
    take_fp16_init_step(optimizer)
    assert all(s["step"] == 1 for s in optimizer.state.values())
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for p, g in zip(ours, grads, strict=True):
            p.grad = g
        flat = torch.cat([g.flatten() for g in grads])
        for m, g in zip(masters, [flat] if wrapper == "fused" else grads, strict=True):
            m.grad = g.clone()
        inner.step()
        optimizer.step()
    torch.testing.assert_close(torch.cat([p.detach().flatten() for p in ours]),
                               torch.cat([m.detach().flatten() for m in masters]), rtol=1e-6, atol=1e-7)
    assert all(s["step"] == 5 for s in inner.state.values())


def test_after_the_init_step_adams_first_update_is_three_quarters_of_lr() -> None:
    # Bias corrections at t = 2: (0.1/(1 − 0.9²)) / √(0.001/(1 − 0.999²)) ≈ 0.744.
    lr = 1e-3
    for init, factor in ((False, 1.0), (True, 0.1 / 0.19 / math.sqrt(0.001 / (1 - 0.999**2)))):
        p = torch.nn.Parameter(torch.zeros(3))
        opt = build_optimizer([p], "Adam", {"lr": lr})
        if init:
            take_fp16_init_step(opt)
        p.grad = torch.tensor([1.0, -2.0, 3.0])
        opt.step()
        torch.testing.assert_close(p.detach(), -lr * factor * p.grad.sign(), rtol=1e-5, atol=0)


@pytest.mark.parametrize(("name", "params"), [("Adam", {}), ("AdamW", {"amsgrad": True}), ("SGD", {"momentum": 0.9}),
                                              ("SGD", {}), ("Adagrad", {}), ("RMSprop", {}), ("Lamb", {})])
def test_optimizer_state_bytes_is_what_the_optimizer_allocates(name: str, params: dict) -> None:
    p = torch.nn.Parameter(torch.ones(100))
    optimizer = build_optimizer([p], name, {"lr": 0.1, **params})
    p.grad = torch.ones(100)
    optimizer.step()
    held = sum(t.numel() * t.element_size() for t in optimizer.state[p].values()
               if isinstance(t, torch.Tensor) and t.numel() == p.numel())
    assert optimizer_state_bytes(name, params) * p.numel() == held
    assert optimizer_state_bytes(type(optimizer).__name__, optimizer.defaults) * p.numel() == held
