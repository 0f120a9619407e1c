"""A drop-in ``deepspeed`` module: run a script written for DeepSpeed on hybridtrain by
changing its imports only::

    import hybridtrain.deepspeed as deepspeed            # was: import deepspeed
    from hybridtrain.deepspeed.accelerator import get_accelerator
    import hybridtrain.deepspeed.comm as dist             # was: import deepspeed.comm as dist

``deepspeed.initialize(...)`` returns ``(engine, optimizer, training_dataloader,
lr_scheduler)`` with DeepSpeed's engine surface (:class:`DeepSpeedEngine`); the config is
DeepSpeed's JSON, read by hybridtrain's config (keys it cannot honour are refused in one
line). Start several processes with ``hybridtrain launch --num_gpus N script.py …``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridtrain.deepspeed import comm
from hybridtrain.deepspeed.comm import init_distributed
from hybridtrain.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "add_config_arguments", "comm", "init_distributed", "initialize"]

__version__ = "0.0.0+hybridtrain"
# Keys the data loader built here reads; the rest of the config goes to hybridtrain.
_LOADER_KEYS = ("dataloader_drop_last",)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed``, ``--deepspeed_config`` (and the legacy
    ``--deepscale``, ``--deepscale_config``) to ``parser``; returns it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: str | Mapping[str, Any] | None = None,
               mesh_param: Any = None, config_params: str | Mapping[str, Any] | None = None,
               ) -> tuple[DeepSpeedEngine, Any, torch.utils.data.DataLoader[Any] | None, Any]:
    """``deepspeed.initialize``: wrap ``model`` for training as the config describes.

    The config is ``config``, else ``config_params``, else ``args.deepspeed_config`` (or the
    legacy ``args.deepscale_config``); giving it both in ``args`` and as an argument is an
    error, as in DeepSpeed. ``optimizer`` (an optimizer, or a callable taking the parameters)
    overrides the config's; ``model_parameters`` (parameters or param-group dicts) is what
    the config's optimizer is built over. ``lr_scheduler`` (a scheduler, or a callable taking
    the optimizer) overrides the config's. ``training_data`` becomes a ``DataLoader`` of
    ``train_micro_batch_size_per_gpu`` samples (a ``DistributedSampler`` over the
    data-parallel ranks when there are several).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Raises:
        ValueError: no config, or two of them; ConfigError: a setting hybridtrain cannot run.
    """
    import hybridtrain as ht
    from hybridtrain.config import load_config
    from hybridtrain.config.deepspeed_keys import fp16_wrapper_steps
    from hybridtrain.runtime.optim import build_optimizer

    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if mpu is not None or mesh_param is not None:
        raise NotImplementedError("initialize(mpu=…/mesh_param=…): give the parallel sizes in the config instead "
                                  "(tensor_parallel.size, pipeline.stages)")
    if type(model).__name__ == "PipelineModule":
        raise NotImplementedError("DeepSpeed's PipelineModule is not supported; pass the plain model and set "
                                  "pipeline.stages in the config")
    raw = _raw_config(args, config, config_params)
    loader_options = {key: raw.pop(key) for key in _LOADER_KEYS if key in raw}
    wrapper_steps = fp16_wrapper_steps(raw)
    cfg = load_config(raw)
    if dist_init_required or (dist_init_required is None and int(os.environ.get("WORLD_SIZE", "1")) > 1):
        init_distributed(dist_init_required=True)

    params = list(model_parameters) if model_parameters is not None else None
    client = optimizer is not None
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(params if params is not None else model.parameters())
    elif optimizer is None and params is not None and _custom_groups(params, model):
        optimizer = build_optimizer(params, cfg.optimizer.type, cfg.optimizer.params)
    as_given = _hyperparameters(optimizer) if client else []
    engine = ht.initialize(model, cfg, optimizer=optimizer)
    if client and wrapper_steps:
        # DeepSpeed's fp16 wrapper holds a caller's optimizer too and steps it once with zero
        # gradients (see fp16_wrapper_steps); the config's optimizer got that step when built.
        _wrapper_step(engine.optimizer, as_given)
    if lr_scheduler is not None:
        engine.scheduler = lr_scheduler(engine.optimizer) if callable(lr_scheduler) and not hasattr(
            lr_scheduler, "step") else lr_scheduler
    loader = None
    if training_data is not None:
        loader = _data_loader(training_data, engine, collate_fn, bool(loader_options.get("dataloader_drop_last")))
    wrapped = DeepSpeedEngine(engine, cfg, loader)
    return wrapped, engine.optimizer, loader, engine.scheduler


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _wrapper_step(optimizer: torch.optim.Optimizer, as_given: list[dict[str, Any]]) -> None:
    """DeepSpeed's fp16-wrapper step on a caller's optimizer, after the engine placed it
    (its state lives where its parameters do), with the hyperparameters it was given:
    DeepSpeed steps before it builds the config's LR schedule, which ``initialize``
    here has already applied (a warm-up from 0 would otherwise hide the weight decay)."""
    from hybridtrain.runtime.optim import zero_grad_step

    scheduled = _hyperparameters(optimizer)
    for group, given in zip(optimizer.param_groups, as_given, strict=True):
        group.update(given)
    zero_grad_step(optimizer)
    for group, now in zip(optimizer.param_groups, scheduled, strict=True):
        group.update(now)


def _raw_config(args: Any, config: Any, config_params: Any) -> dict[str, Any]:
    """DeepSpeed's precedence: ``config``, else ``config_params``; ``args.deepspeed_config``
    (or ``args.deepscale_config``) only when neither is given."""
    from hybridtrain.config.loading import plain_copy, read_config_file

    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments "
                             "and deepspeed.initialize() function call")
        config = from_args
    if config is None:
        raise ValueError("DeepSpeed requires --deepspeed_config to specify configuration file")
    if isinstance(config, Mapping):
        return plain_copy(config)
    return read_config_file(Path(config))


def _custom_groups(params: list[Any], model: nn.Module) -> bool:
    """Whether ``model_parameters`` asks for more than the config optimizer over all the
    model's trainable parameters: param-group dicts, or a subset of the parameters."""
    if any(isinstance(p, Mapping) for p in params):
        return True
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return {id(p) for p in params} != trainable


def _data_loader(data: Any, engine: Any, collate_fn: Any, drop_last: bool) -> torch.utils.data.DataLoader[Any]:
    """DeepSpeed's training loader: micro-batches, a ``DistributedSampler`` over the
    data-parallel ranks when there are several, else a ``RandomSampler``."""
    from torch.utils.data import DataLoader, RandomSampler
    from torch.utils.data.distributed import DistributedSampler

    topology = engine.topology
    sampler: Any
    if topology.dp > 1:
        sampler = DistributedSampler(data, num_replicas=topology.dp, rank=topology.dp_rank)
    else:
        sampler = RandomSampler(data)
    return DataLoader(data, batch_size=engine.options.batch.micro_batch, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last)
