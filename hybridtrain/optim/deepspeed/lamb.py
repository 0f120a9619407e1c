"""LAMB as DeepSpeed's ``"type": "Lamb"`` computes it: ``deepspeed.ops.lamb.FusedLamb`` and
its kernel (``csrc/lamb/fused_lamb_cuda_kernel.cu``), which only build for CUDA. Per
parameter tensor, at step ``t`` (the tensor's own count)::

    m ← β₁·m + (1 − β₁)·g
    v ← β₂·v + (1 − β₂)·g²
    d = √(v + ε)  if eps_inside_sqrt  else  √v + ε          (v is not bias-corrected)
    u = m / d + λ·p                                          (weight decay inside the update)
    c = clamp(‖p‖ / ‖u‖, then ≤ max_coeff, then ≥ min_coeff), or 1 when ‖p‖ or ‖u‖ is 0
    p ← p − s·c·u,   s = lr·√(1 − β₂ᵗ)/(1 − β₁ᵗ) with bias_correction, else lr

The bias correction is folded into the step size only, so the trust ratio ``c`` is taken
over the uncorrected update, as the kernel does. ``max_grad_norm`` never reaches FusedLamb
through DeepSpeed's engine (it refuses the key; ``gradient_clipping`` clips instead).

One difference stays, for every optimizer here: a tensor that gets no gradient in a step is
left alone, while DeepSpeed's fp16 wrappers step it with a zero gradient (its moments decay
and weight decay moves it). The wrappers' step with zero gradients when they are built is
reproduced for every optimizer (:func:`hybridtrain.optim.take_fp16_init_step`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


def lamb_coefficient(weight_norm: torch.Tensor, update_norm: torch.Tensor, min_coeff: float,
                     max_coeff: float) -> torch.Tensor:
    """LAMB's trust ratio as DeepSpeed clamps it: ``‖p‖/‖u‖`` capped at ``max_coeff``, then
    raised to ``min_coeff`` (so ``min_coeff`` wins if they cross); 1 when either norm is 0."""
    ratio = (weight_norm / update_norm).clamp(max=max_coeff).clamp(min=min_coeff)
    usable = (weight_norm != 0) & (update_norm != 0)
    return torch.where(usable, ratio, torch.ones_like(ratio))


class Lamb(torch.optim.Optimizer):
    """DeepSpeed's FusedLamb (see the module docstring).

    Args:
        params: parameters or parameter groups.
        lr / betas / eps / weight_decay: as in the formulas above (DeepSpeed's defaults).
        bias_correction: fold Adam's bias corrections into the step size.
        eps_inside_sqrt: ``√(v + ε)`` instead of ``√v + ε``.
        max_coeff / min_coeff: bounds of the trust ratio.
        amsgrad: not supported (FusedLamb raises too).

    Raises:
        ValueError: ``amsgrad`` true, or a negative rate or a beta outside [0, 1).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("optimizer.params.amsgrad = True: DeepSpeed's FusedLamb does not support AMSGrad")
        beta1, beta2 = betas
        if lr < 0 or not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"optimizer.params lr = {lr}, betas = {list(betas)}: lr must be ≥ 0 and each beta "
                             "in [0, 1)")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": (beta1, beta2),
                                  "eps": eps, "eps_inside_sqrt": eps_inside_sqrt, "weight_decay": weight_decay,
                                  "max_coeff": max_coeff, "min_coeff": min_coeff})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = exp_avg_sq.add(group["eps"]).sqrt_() if group["eps_inside_sqrt"] \
                    else exp_avg_sq.sqrt().add_(group["eps"])
                update = (exp_avg / denom).add_(p, alpha=group["weight_decay"])
                coeff = lamb_coefficient(torch.linalg.vector_norm(p), torch.linalg.vector_norm(update),
                                         group["min_coeff"], group["max_coeff"])
                p.sub_(update.mul_(coeff * _step_size(group, state["step"])))
        return loss


def _step_size(group: dict[str, Any], step: int) -> float:
    if not group["bias_correction"]:
        return float(group["lr"])
    beta1, beta2 = group["betas"]
    return float(group["lr"]) * math.sqrt(1 - beta2**step) / (1 - beta1**step)
