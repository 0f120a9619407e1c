"""The engine behind ``deepspeed.initialize``: the caller's optimizer and scheduler
arguments read as DeepSpeed reads them, and DeepSpeed's fp16 init step decided
(:func:`takes_fp16_init_step`) and stated in the config handed down the one road
(:func:`hybridtrain.prepare.prepare`).

Shared by plain models (built at ``initialize``) and pipeline modules (built once the
first micro-batch shows the activation shapes, when ``initialize`` had no data).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridtrain.compose import check_plain_initialize
from hybridtrain.config import Config
from hybridtrain.config.deepspeed_keys import deepspeed_takes_fp16_init_step
from hybridtrain.deepspeed.client_optimizer import describe, lay_groups, with_optimizer
from hybridtrain.engine import Engine
from hybridtrain.optim import FP16_INIT_STEP
from hybridtrain.prepare import prepare
from hybridtrain.runtime.batch import Batch, LossFn


def takes_fp16_init_step(raw: Mapping[str, Any], client: bool) -> bool:
    """Whether DeepSpeed's fp16 wrapper takes the fp16 init step (one step with zero gradients
    when it is built; :func:`hybridtrain.config.deepspeed_keys.deepspeed_takes_fp16_init_step`)
    on the config's own optimizer section or a caller's optimizer (without either DeepSpeed
    has no optimizer; hybridtrain's default one takes no such step). A DeepSpeed rule,
    applied here and stated in the config handed down the one road (:func:`build_engine`);
    loading a config adds nothing.

    Args:
        raw: the DeepSpeed config as written (after this layer's own rewrites).
        client: the caller gave ``deepspeed.initialize`` an optimizer.
    """
    return deepspeed_takes_fp16_init_step(dict(raw)) and (client or isinstance(raw.get("optimizer"), Mapping))


def build_engine(model: nn.Module, cfg: Config, init_step: bool, optimizer: Any, params: list[Any] | None,
                 lr_scheduler: Any, loss_fn: LossFn | None = None, example_batch: Batch | None = None) -> Engine:
    """:func:`hybridtrain.initialize` with ``deepspeed.initialize``'s optimizer arguments.

    Args:
        init_step: DeepSpeed's fp16 wrapper takes the fp16 init step
            (:func:`takes_fp16_init_step`); written into ``cfg`` unless it already says.
        optimizer: an optimizer, a callable taking the parameters, or None (the config's).
        params: ``model_parameters`` (parameters or param-group dicts), or None.
        lr_scheduler: a scheduler, a callable taking the optimizer, or None (the config's).
        loss_fn / example_batch: as :func:`hybridtrain.initialize`.
    """
    from hybridtrain.optim import build_optimizer, build_scheduler
    from hybridtrain.plan.resolve import optimizer_settings

    cfg = with_fp16_init_step(cfg, init_step)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(params if params is not None else model.parameters())
    elif optimizer is None and params is not None and _custom_groups(params, model):
        settings = optimizer_settings(cfg)
        optimizer = build_optimizer(params, settings.type, dict(settings.params))
    spec = None
    if isinstance(optimizer, torch.optim.Optimizer) and _replaces_parameters(cfg):
        # The engine shards the parameters before it builds its optimizer: the caller's is
        # rebuilt over the shards (DeepSpeed wraps it instead; same math).
        spec = describe(optimizer, model)
        asked_step = {k: v for k, v in cfg.optimizer.params.items() if k == FP16_INIT_STEP}
        cfg = with_optimizer(cfg, spec, asked_step)
    check_plain_initialize(cfg)
    # The one road; the config states DeepSpeed's fp16 init step (the plan carries it, build
    # takes it before the LR schedule, as DeepSpeed does).
    engine = prepare(cfg, model, loss_fn, None if spec else optimizer, example_batch).engine
    if spec is not None and lay_groups(engine.optimizer, engine.module, spec) and cfg.scheduler is not None:
        # The config's schedule was built over the one group; it drives the caller's groups.
        engine.scheduler = build_scheduler(engine.optimizer, cfg.scheduler.type, cfg.scheduler.params)
    if isinstance(optimizer, torch.optim.Optimizer) and optimizer is not engine.optimizer:
        # DeepSpeed's ZeRO optimizer updates through the caller's own param_groups, so a
        # scheduler built on the caller's optimizer before initialize (Accelerate's, a
        # Trainer's) sets the rates the update uses; the engine's optimizer (e.g. the host
        # optimizer of an offload) has groups of its own, which the caller's now are.
        optimizer.param_groups = engine.optimizer.param_groups
    if lr_scheduler is not None:
        engine.scheduler = lr_scheduler(engine.optimizer) if callable(lr_scheduler) and not hasattr(
            lr_scheduler, "step") else lr_scheduler
    return engine


def with_fp16_init_step(cfg: Config, init_step: bool) -> Config:
    """``cfg`` stating DeepSpeed's fp16 init step in ``optimizer.params.fp16_init_step``; a
    value the user wrote there decides instead."""
    if not init_step or FP16_INIT_STEP in cfg.optimizer.params:
        return cfg
    params = {**cfg.optimizer.params, FP16_INIT_STEP: True}
    return cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"params": params})})


def _replaces_parameters(cfg: Config) -> bool:
    """Whether this run's engine replaces the model's parameters (ZeRO over several
    processes, tensor parallel), so that it must build the optimizer itself."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    tensor_parallel = max(cfg.tensor_parallel.size, cfg.tensor_model_parallel_size or 1)
    return world > 1 and (cfg.zero_optimization.stage > 0 or tensor_parallel > 1)


def _custom_groups(params: list[Any], model: nn.Module) -> bool:
    """Whether ``model_parameters`` asks for more than the config optimizer over all the
    model's trainable parameters: param-group dicts, or a subset of the parameters."""
    if any(isinstance(p, Mapping) for p in params):
        return True
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return {id(p) for p in params} != trainable
