"""Adam without bias correction: DeepSpeed's ``Adam``/``AdamW`` with
``"bias_correction": false`` (its fused kernel with both corrections set to 1), which torch's
Adam cannot express::

    g ← g + λ·p                 (L2 mode: adam_w_mode false)
    m ← β₁·m + (1 − β₁)·g
    v ← β₂·v + (1 − β₂)·g²
    p ← p − lr·(m / (√v + ε) + λ·p)   (decoupled mode: adam_w_mode true; λ·p of the old p)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class AdamWithoutBiasCorrection(torch.optim.Optimizer):
    """See the module docstring.

    Args:
        params: parameters or parameter groups.
        lr / betas / eps / weight_decay: as torch's Adam.
        decoupled: weight decay applied to the parameter (AdamW) rather than the gradient.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "decoupled": decoupled})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                if decay and not group["decoupled"]:
                    grad = grad.add(p, alpha=decay)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if decay and group["decoupled"]:
                    p.mul_(1 - lr * decay)
                p.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(eps), value=-lr)
        return loss
