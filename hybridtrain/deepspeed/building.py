"""The engine behind ``deepspeed.initialize``: the caller's optimizer and scheduler
arguments read as DeepSpeed reads them, then :func:`hybridtrain.initialize`.

Shared by plain models (built at ``initialize``) and pipeline modules (built once the
first micro-batch shows the activation shapes, when ``initialize`` had no data).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridtrain.config import Config
from hybridtrain.config.deepspeed_keys import FP16_INIT_STEP
from hybridtrain.engine import Engine
from hybridtrain.runtime.batch import Batch, LossFn


def build_engine(model: nn.Module, cfg: Config, wrapper_steps: bool, optimizer: Any, params: list[Any] | None,
                 lr_scheduler: Any, loss_fn: LossFn | None = None, example_batch: Batch | None = None) -> Engine:
    """:func:`hybridtrain.initialize` with ``deepspeed.initialize``'s optimizer arguments.

    Args:
        wrapper_steps: DeepSpeed's fp16 wrapper steps a caller's optimizer once with zero
            gradients (see :func:`hybridtrain.config.deepspeed_keys.fp16_wrapper_steps`).
        optimizer: an optimizer, a callable taking the parameters, or None (the config's).
        params: ``model_parameters`` (parameters or param-group dicts), or None.
        lr_scheduler: a scheduler, a callable taking the optimizer, or None (the config's).
        loss_fn / example_batch: as :func:`hybridtrain.initialize`.
    """
    import hybridtrain as ht
    from hybridtrain.plan.resolve import optimizer_settings
    from hybridtrain.runtime.optim import build_optimizer

    client = optimizer is not None
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(params if params is not None else model.parameters())
    elif optimizer is None and params is not None and _custom_groups(params, model):
        settings = optimizer_settings(cfg)
        optimizer = build_optimizer(params, settings.type, dict(settings.params))
    if client and wrapper_steps and FP16_INIT_STEP not in cfg.optimizer.params:
        # DeepSpeed's fp16 wrapper holds a caller's optimizer too and steps it once with zero
        # gradients (see fp16_wrapper_steps): a DeepSpeed rule, asked for here; the plan
        # carries it and the build takes the step before the LR schedule, as DeepSpeed does.
        asked = {**cfg.optimizer.params, FP16_INIT_STEP: True}
        cfg = cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"params": asked})})
    engine = ht.initialize(model, cfg, loss_fn=loss_fn, optimizer=optimizer, example_batch=example_batch)
    if lr_scheduler is not None:
        engine.scheduler = lr_scheduler(engine.optimizer) if callable(lr_scheduler) and not hasattr(
            lr_scheduler, "step") else lr_scheduler
    return engine


def _custom_groups(params: list[Any], model: nn.Module) -> bool:
    """Whether ``model_parameters`` asks for more than the config optimizer over all the
    model's trainable parameters: param-group dicts, or a subset of the parameters."""
    if any(isinstance(p, Mapping) for p in params):
        return True
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return {id(p) for p in params} != trainable
