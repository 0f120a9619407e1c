"""``deepspeed.initialize`` with a caller's optimizer: at ZeRO stage 0 with fp16, DeepSpeed's
fp16 wrapper holds it as it holds its own (deepspeed/runtime/engine.py ``_configure_optimizer``:
the client optimizer becomes the basic optimizer and goes through ``_configure_fp16_optimizer``),
and the wrapper's ``__init__`` steps it once with zero gradients
(``runtime/fp16/fused_optimizer.py`` / ``unfused_optimizer.py`` ``initialize_optimizer_states``),
before the LR scheduler from the config is built (``_configure_lr_scheduler`` comes after)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridtrain.deepspeed as deepspeed
from tests.deepspeed.fp16_reference import deepspeed_fp16_loop

LR, DECAY = 0.1, 0.1
# auto_cast: the engine casts the fp32 inputs to the fp16 model's dtype, as DeepSpeed's does.
FP16 = {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True, "hysteresis": 1, "auto_cast": True}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _start(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("offload", [False, True])
def test_a_callers_optimizer_is_stepped_once_with_zero_gradients_then_trains_as_deepspeed(offload: bool) -> None:
    # Layer streaming (hybridtrain's) updates on the host, taking the optimizer over: same math.
    config = {**FP16, "layer_streaming": {"enabled": True}} if offload else FP16
    model, reference = _model(), _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    engine, returned, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    # DeepSpeed's fp16 wrapper (fp32 masters) over the caller's optimizer; streaming: autocast.
    assert (getattr(returned, "inner", None) is optimizer) is not offload
    assert all(s["step"] == 1 for s in returned.state.values())

    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(3)]
    for x, y in batches:
        # The loss in fp32, as autocast computes it in the reference.
        engine.backward(F.cross_entropy(engine(x.to(engine.device)).float(), y.to(engine.device)))
        engine.step()
    if not offload:  # the reference: DeepSpeed's fp16 wrapper, its init step included, to the bit
        # clip 1.0: DeepSpeed's default gradient_clipping
        deepspeed_fp16_loop(reference, lambda masters: torch.optim.AdamW(masters, lr=LR, weight_decay=DECAY),
                            batches, F.cross_entropy, scale=2.0**16, clip=1.0, init_step=True)
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(mine, theirs)
        return
    # Layer streaming keeps autocast over fp32 weights: DeepSpeed's init step, then loss-scaled steps.
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=DECAY)
    for p in reference.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(reference(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        scaler.step(opt)
        scaler.update()
    eps = torch.finfo(torch.float16).eps  # one fp16 rounding per step may differ
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.detach().cpu(), theirs.detach(), rtol=3 * eps, atol=3 * LR * eps)


@pytest.mark.parametrize("scheduler", ["callers", "config"])
def test_the_fp16_init_step_uses_the_learning_rate_of_the_moment_deepspeed_takes_it(scheduler: str) -> None:
    model = _model()
    start = _start(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    extra: dict[str, Any] = {}
    if scheduler == "callers":
        # Built by the caller before initialize: its lr (LR / 2) is the optimizer's then.
        extra["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
        lr = LR / 2
    else:
        # Built by DeepSpeed after the wrapper: the optimizer's own lr, not the warm-up's 0.
        warmup = {**FP16, "scheduler": {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 10}}}
        extra["config"] = warmup
        lr = LR
    engine, returned, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, **{"config": FP16, **extra})
    masters = [m for group in returned.param_groups for m in group["params"]]  # DeepSpeed's fp32 masters
    for m, p, p0 in zip(masters, model.parameters(), start, strict=True):
        # DeepSpeed casts the module first: the masters start from the fp16 weights
        torch.testing.assert_close(m.detach(), p0.half().float() * (1 - lr * DECAY), rtol=0, atol=0)
        assert torch.equal(p.detach(), p0.half())  # the init step moves the masters only, as DeepSpeed's
    # The schedule's own rate is back in place afterwards.
    unstepped = _model()
    plain = torch.optim.AdamW(unstepped.parameters(), lr=LR, weight_decay=DECAY)
    twin = {"lr_scheduler": torch.optim.lr_scheduler.LambdaLR(plain, lambda step: 0.5)} if scheduler == "callers" \
        else {"config": {k: v for k, v in extra["config"].items() if k != "fp16"}}
    fp32_engine, _, _, _ = deepspeed.initialize(model=unstepped, optimizer=plain, **{"config": {
        k: v for k, v in FP16.items() if k != "fp16"}, **twin})
    assert engine.get_lr() == fp32_engine.get_lr()
    assert not plain.state  # without fp16 (or with ZeRO) DeepSpeed has no fp16 init step


@pytest.mark.parametrize(("zero", "steps"), [({}, True), ({"zero_optimization": {"stage": 1}}, False)])
def test_the_configs_own_optimizer_is_stepped_where_deepspeed_wraps_it(zero: dict, steps: bool) -> None:
    # DeepSpeed wraps its own optimizer as it wraps a caller's: at stage 0 with fp16 the wrapper
    # steps it once with zero gradients (weight decay acts once); at stage 1 it does not. A rule of
    # this layer, decided from the file: loading the file adds no key, and hybridtrain.initialize
    # of the same file trains with plain PyTorch math.
    import hybridtrain as ht
    from hybridtrain.config import load_config

    config = {**FP16, **zero, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY}}}
    model = _model()
    start = _start(model)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
    decayed = 1 - LR * DECAY if steps else 1.0
    masters = [m for group in optimizer.param_groups for m in group["params"]]  # DeepSpeed's fp32 masters
    for m, p0 in zip(masters, start, strict=True):
        torch.testing.assert_close(m.detach(), p0.half().float() * decayed, rtol=0, atol=0)
    assert all(s["step"] == 1 for s in optimizer.state.values()) if steps else not optimizer.state
    assert "fp16_init_step" not in load_config(config).optimizer.params
    native = _model()
    ht.initialize(native, config)
    for p, p0 in zip(native.parameters(), start, strict=True):
        torch.testing.assert_close(p.detach().cpu(), p0, rtol=0, atol=0)


def test_a_scheduler_on_the_callers_optimizer_does_not_warn_under_offload() -> None:
    """Under ZeRO-2 offload the host optimizer updates through the caller's groups; torch's
    scheduler built on the caller's optimizer (Accelerate's) must not warn that it stepped
    before the optimizer, as it does not under DeepSpeed."""
    import warnings

    model = _model()
    given = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(given, lambda step: 0.5 ** step)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=given, config=config)
    assert optimizer is not given
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.backward(engine(torch.ones(2, 6)).sum())
        engine.step()
        scheduler.step()
    assert engine.get_lr() == [0.05]


def test_gradient_clipping_defaults_to_deepspeeds_one() -> None:
    """A config without ``gradient_clipping`` clips at 1.0, as DeepSpeed 0.19.8 does: Adam's first
    step hides it (scale-invariant), the second does not."""
    model, reference = _model(), _model()
    config = {"train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.gradient_clipping() == 1.0
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=DECAY)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=gen) * 4, torch.randint(0, 3, (4,), generator=gen)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        F.cross_entropy(reference(x), y).backward()
        assert float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)) > 1.0  # the clip acts
        optimizer.step()
        optimizer.zero_grad()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-5, atol=1e-7)
