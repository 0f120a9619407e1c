"""DeepSpeed's ZeRO-0 fp16 rules (``FP16_UnfusedOptimizer``) written out as a plain loop: the
reference in-process tests compare the drop-in's fp16 math with."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


def deepspeed_fp16_loop(model: nn.Module, make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                        batches: list[Batch], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                        scale: float, clip: float = 0.0, init_step: bool = False,
                        lr_factor: Callable[[int], float] = lambda step: 1.0) -> int:
    """Train ``model`` on ``batches`` (one per step): its weights cast to fp16, fp32 masters of
    those stepped by ``make_optimizer(masters)`` (once with zero gradients first with ``init_step``), each loss
    in fp32 times the scale; a step with inf/NaN gradients skipped, halving the scale and holding
    the schedule (``lr_factor(applied steps)`` times the initial rate); else the gradients
    multiplied by ``1 / combined`` (the scale, times the clip factor above ``clip``), the
    masters stepped and copied into the weights. Returns the number of skipped steps."""
    params = list(model.parameters())
    for p in params:  # DeepSpeed casts the module before it builds its optimizer wrapper
        p.data = p.data.half()
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = make_optimizer(masters)
    base = [group["lr"] for group in optimizer.param_groups]
    if init_step:
        for m in masters:
            m.grad = torch.zeros_like(m)
        optimizer.step()  # the masters only, as DeepSpeed's initialize_optimizer_states
    applied = skipped = 0
    for inputs, targets in batches:
        (loss_fn(model(inputs.half()).float(), targets) * scale).backward()
        grads = [p.grad.float() for p in params]
        for p in params:
            p.grad = None
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            scale, skipped = scale / 2, skipped + 1
            continue
        norm = math.sqrt(sum(float(g.norm()) ** 2 for g in grads))
        combined = max((norm / scale + 1e-6) / clip, 1.0) * scale if clip > 0 else scale
        for m, g in zip(masters, grads, strict=True):
            m.grad = g * (1.0 / combined)
        for group, lr in zip(optimizer.param_groups, base, strict=True):
            group["lr"] = lr * lr_factor(applied)
        optimizer.step()
        applied += 1
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
    return skipped
