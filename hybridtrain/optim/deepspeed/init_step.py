"""DeepSpeed's fp16 init step: one optimizer step with every gradient zero, taken when
DeepSpeed's fp16 wrapper is built (ZeRO stage 0 under fp16, or bf16 unless pipelined).

One name for this quirk everywhere: the config key ``optimizer.params.fp16_init_step``
(:data:`FP16_INIT_STEP`; ``true`` takes the step, ``false`` skips it), the plan's
:attr:`hybridtrain.plan.types.OptimizerSettings.fp16_init_step`, the step itself
(:func:`take_fp16_init_step`) and the rule saying where DeepSpeed takes it
(:func:`hybridtrain.config.deepspeed_keys.deepspeed_takes_fp16_init_step`). The DeepSpeed
drop-in writes the key into the config it hands down; hybridtrain's own road never takes
the step unless a config asks.
"""

from __future__ import annotations

import torch

FP16_INIT_STEP = "fp16_init_step"
"""The ``optimizer.params`` key that asks for (``true``) or skips (``false``) the fp16 init
step. It is no optimizer argument: :func:`hybridtrain.plan.resolve.optimizer_settings`
reads it out of the parameters into the plan."""


def take_fp16_init_step(optimizer: torch.optim.Optimizer) -> None:
    """One ``step()`` with every trained parameter's gradient zero, as DeepSpeed's fp16
    wrappers do when built (``deepspeed/runtime/fp16/fused_optimizer.py`` and
    ``unfused_optimizer.py``, ``initialize_optimizer_states``; for Adam the step count
    becomes 1 and weight decay acts once), at the learning rate the groups hold then.

    Frozen parameters (``requires_grad`` False) get none and stay as they are: the
    wrappers hold only ``p.requires_grad`` ones (``fused_optimizer.py``, ``unfused_optimizer.py``:
    ``trainable = [p for p in param_group['params'] if p.requires_grad]``). The zero gradients
    are made where each parameter lives (host masters stay in host memory); ``zero_grad``
    clears them afterwards, so the next step starts clean."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
