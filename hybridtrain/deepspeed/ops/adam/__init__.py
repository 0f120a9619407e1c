"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam`` with DeepSpeed's
signatures and math, on torch's Adam (its fused CPU kernel where it has one).

``adamw_mode``/``adam_w_mode`` (default true) is decoupled weight decay (AdamW); false is
Adam with L2 weight decay added to the gradient, as in DeepSpeed's kernels. What torch's
Adam cannot do is refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _check(name: str, bias_correction: bool, amsgrad: bool) -> None:
    if not bias_correction:
        raise NotImplementedError(f"{name}(bias_correction=False) is not supported by hybridtrain.deepspeed; give "
                                  "the config optimizer {type: Adam, params: {bias_correction: false}} instead")
    if amsgrad:
        raise RuntimeError(f"{name} does not support the AMSGrad variant.")


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's CPU Adam (ZeRO-Offload's host optimizer): Adam/AdamW on the parameters'
    device with torch's kernels. ``fp32_optimizer_states`` is always true (states in fp32)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _check("DeepSpeedCPUAdam", bias_correction, amsgrad)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode)
        self.adam_w_mode = adamw_mode


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's fused (multi-tensor) Adam: Adam/AdamW with torch's foreach kernels.
    ``set_grad_none`` is torch's ``zero_grad(set_to_none=True)`` default."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        _check("FusedAdam", bias_correction, amsgrad)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)
        self.adam_w_mode = adam_w_mode
