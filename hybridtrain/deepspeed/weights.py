"""The model's weights as DeepSpeed's engine hands them out: the consolidated 16-bit state
dict (``_zero3_consolidated_16bit_state_dict``, what Accelerate's ``get_state_dict`` and the
Trainer's ``save_model`` read under ZeRO-3) and ``save_16bit_model``'s file, which
``from_pretrained`` / ``load_state_dict`` load as a plain PyTorch state dict.

Unlike DeepSpeed (transformers#25368), the weights are gathered from hybridtrain's shards
by the engine itself, so the saved model is the trained one under every ZeRO stage.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from hybridtrain.config import Config
from hybridtrain.engine import Engine


def weights_dtype(config: Config) -> torch.dtype | None:
    """The 16-bit dtype DeepSpeed's module holds under ``fp16``/``bf16`` (None: as trained)."""
    if config.fp16.enabled:
        return torch.float16
    if config.bf16.enabled:
        return torch.bfloat16
    return None


def consolidated_state_dict(engine: Engine, config: Config,
                            exclude_frozen_parameters: bool = False) -> OrderedDict[str, torch.Tensor] | None:
    """The whole model's state dict on rank 0 (CPU tensors, 16-bit under fp16/bf16), None on
    the other ranks, as DeepSpeed. A collective: call it on every rank."""
    full = engine.model_state_dict()
    if engine.topology.rank != 0:
        return None
    frozen = {name for name, p in engine.module.named_parameters() if not p.requires_grad}
    dtype = weights_dtype(config)
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, value in full.items():
        if exclude_frozen_parameters and name in frozen:
            continue
        state[name] = value.to(dtype) if dtype is not None and value.is_floating_point() else value
    return state


def save_16bit_model(engine: Engine, config: Config, save_dir: str | os.PathLike[str],
                     save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False) -> bool:
    """``engine.save_16bit_model``: rank 0 writes ``save_dir/save_filename`` (``torch.save`` of
    the consolidated state dict). Under ZeRO-3 only with
    ``stage3_gather_16bit_weights_on_model_save: true``, as DeepSpeed; returns whether it saved.
    Call it on every rank."""
    zero = config.zero_optimization
    if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
        from hybridtrain.deepspeed.utils import logger

        logger.info(f"Did not save the model {os.path.join(save_dir, save_filename)} because "
                    "stage3_gather_16bit_weights_on_model_save is False")
        return False
    state = consolidated_state_dict(engine, config, exclude_frozen_parameters)
    if state is not None:
        os.makedirs(save_dir, exist_ok=True)
        torch.save(state, os.path.join(save_dir, save_filename))
    return True


def grad_norm(engine: Engine) -> float | None:
    """The global norm of the gradients now (unscaled by the fp16 loss scale), without changing
    them; None where no gradient is held to measure (an optimizer offload without clipping
    updates each bucket on the host as its gradients arrive)."""
    params = [p for group in engine.optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        return None
    norm = engine.parallel.clip_grad_norm(params, float("inf"))
    return float(norm) / engine.loss_scale

