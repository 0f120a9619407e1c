"""LAMB as DeepSpeed computes it. The reference is DeepSpeed's own ``FusedLamb`` python class
(``deepspeed/ops/lamb/fused_lamb.py``: its defaults, step counting and per-tensor calls) with
its CUDA op, which cannot build here, replaced by a float64 transcription of the kernel
(``deepspeed/ops/csrc/lamb/fused_lamb_cuda_kernel.cu``: ``fused_lamb_cuda`` for the step
size, ``lamb_cuda_kernel_part1`` for the moments and the two squared norms,
``lamb_cuda_kernel_part3`` for the trust ratio's clamp and the update)."""

from __future__ import annotations

import math
import types
from typing import Any

import pytest
import torch
from deepspeed.ops.lamb import fused_lamb
from torch import nn

import hybridtrain as ht
from hybridtrain.config import explain_config
from hybridtrain.deepspeed.building import takes_fp16_init_step, with_fp16_init_step
from hybridtrain.optim import build_optimizer, take_fp16_init_step
from hybridtrain.optim.deepspeed.lamb import Lamb
from hybridtrain.plan.resolve import optimizer_settings


def _kernel(p: torch.Tensor, p_copy: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, lr: float,
            beta1: float, beta2: float, max_coeff: float, min_coeff: float, eps: float, grad_scale: float,
            step: int, mode: int, bias_correction: int, decay: float) -> torch.Tensor:
    """fused_lamb_cuda_kernel.cu, element by element, in float64."""
    step_size = lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step) if bias_correction == 1 else lr
    P, G = p.double(), g.double() / grad_scale
    M = beta1 * m.double() + (1 - beta1) * G
    V = beta2 * v.double() + (1 - beta2) * G * G
    denom = (V + eps).sqrt() if mode == 0 else V.sqrt() + eps  # ADAM_MODE_0: eps under the root
    update = M / denom + decay * P
    reg_w, reg_u = P.pow(2).sum().sqrt(), update.pow(2).sum().sqrt()
    coeff = 1.0
    if reg_w != 0 and reg_u != 0:
        coeff = (reg_w / reg_u).item()
        if coeff > max_coeff:
            coeff = max_coeff
        if coeff < min_coeff:
            coeff = min_coeff
    p.copy_(P - step_size * coeff * update)
    m.copy_(M)
    v.copy_(V)
    return torch.tensor([coeff])


@pytest.fixture
def deepspeed_fused_lamb(monkeypatch: pytest.MonkeyPatch) -> type:
    class Builder:
        def load(self) -> Any:
            return types.SimpleNamespace(lamb=_kernel)

    monkeypatch.setattr(fused_lamb, "FusedLambBuilder", Builder)
    return fused_lamb.FusedLamb  # type: ignore[no-any-return]


SHAPES = [(6, 4), (4,), (3, 2, 2)]


def _start() -> list[torch.Tensor]:
    torch.manual_seed(0)
    start = [torch.randn(shape) for shape in SHAPES]
    start[1].zero_()  # a zero tensor: ‖p‖ = 0, so the trust ratio is 1
    return start


@pytest.mark.parametrize("kwargs", [
    {},  # FusedLamb's defaults
    {"lr": 1e-2, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01},
    {"lr": 5e-3, "betas": (0.8, 0.95), "eps": 1e-4, "eps_inside_sqrt": True, "weight_decay": 0.1},
    {"lr": 1e-2, "max_coeff": 0.5, "min_coeff": 0.6},  # crossed bounds: min_coeff wins, as in the kernel
])
@pytest.mark.parametrize("init", [False, True], ids=["fp32", "fp16-wrapper"])
def test_matches_deepspeeds_fused_lamb(deepspeed_fused_lamb: type, kwargs: dict[str, Any], init: bool) -> None:
    theirs = [nn.Parameter(t.clone()) for t in _start()]
    ours = [nn.Parameter(t.clone()) for t in _start()]
    reference, optimizer = deepspeed_fused_lamb(theirs, **kwargs), Lamb(ours, **kwargs)
    if init:  # FP16_UnfusedOptimizer.initialize_optimizer_states: step() with zero gradients
        take_fp16_init_step(reference)
        take_fp16_init_step(optimizer)
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        grads = [torch.randn(shape, generator=gen) for shape in SHAPES]
        for params in (theirs, ours):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
        reference.step()
        optimizer.step()
    for a, b in zip(theirs, ours, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert reference.state[theirs[0]]["step"] == optimizer.state[ours[0]]["step"] == 8 + init


def test_engine_trains_deepspeeds_lamb_config() -> None:
    # bing_bert's LAMB settings (DeepSpeedExamples, deepspeed_bsz64k_lamb_config_seq128.json):
    # the engine's steps equal a plain loop with DeepSpeed's clipping and FusedLamb's math.
    params = {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01}
    config = {"train_batch_size": 4, "optimizer": {"type": "Lamb", "params": params}, "gradient_clipping": 1.0,
              "device": "cpu"}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    plain.load_state_dict(model.state_dict())
    loss_fn = nn.MSELoss()
    engine = ht.initialize(model, config, loss_fn=lambda out, batch: loss_fn(out, batch[1]))
    reference = Lamb(plain.parameters(), **params)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
        engine.train_batch((x, y))
        reference.zero_grad()
        loss_fn(plain(x), y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        reference.step()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_fp16_config_takes_deepspeeds_construction_step() -> None:
    # At ZeRO stage 0 with fp16, DeepSpeed's FP16_UnfusedOptimizer steps FusedLamb once with
    # zero gradients when built: m = v = 0, so u = λ·p and c = clamp(1/λ) = max_coeff here.
    lr, decay, max_coeff = 2e-3, 0.01, 0.3
    config = {"optimizer": {"type": "Lamb", "params": {"lr": lr, "weight_decay": decay, "max_coeff": max_coeff}},
              "fp16": {"enabled": True}}
    cfg, _ = explain_config(config)
    assert takes_fp16_init_step(config, client=False)  # the DeepSpeed drop-in asks for it
    weight = nn.Parameter(torch.randn(5, 3))
    start = weight.detach().clone()
    settings = optimizer_settings(with_fp16_init_step(cfg, True))  # what plan.build makes of it
    optimizer = build_optimizer([weight], settings.type, dict(settings.params))
    if settings.fp16_init_step:
        take_fp16_init_step(optimizer)
    torch.testing.assert_close(weight.detach(), start - lr * max_coeff * decay * start)
    assert optimizer.state[weight]["step"] == 1
    # Without fp16 (or with ZeRO, where DeepSpeed's ZeRO optimizer has no such step) nothing moves.
    assert not takes_fp16_init_step({**config, "fp16": {"enabled": False}}, client=False)
