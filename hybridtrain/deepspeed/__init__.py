"""A drop-in ``deepspeed`` module: run a script written for DeepSpeed on hybridtrain by
changing its imports only::

    import hybridtrain.deepspeed as deepspeed            # was: import deepspeed
    from hybridtrain.deepspeed.accelerator import get_accelerator
    import hybridtrain.deepspeed.comm as dist             # was: import deepspeed.comm as dist

A pipeline script keeps ``from hybridtrain.deepspeed.pipe import PipelineModule, LayerSpec``
(was ``deepspeed.pipe``) and its ``engine.train_batch()`` loop.

``deepspeed.initialize(...)`` returns ``(engine, optimizer, training_dataloader,
lr_scheduler)`` with DeepSpeed's engine surface (:class:`DeepSpeedEngine`); the config is
DeepSpeed's JSON, read by hybridtrain's config (keys it cannot honour are refused in one
line). Start several processes with ``hybridtrain launch --num_gpus N script.py …``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridtrain.deepspeed import checkpointing, comm, ops, pipe, runtime, utils
from hybridtrain.deepspeed.building import (
    build_engine,
    master_weights,
    takes_fp16_init_step,
    without_unstreamable_param_offload,
)
from hybridtrain.deepspeed.comm import init_distributed
from hybridtrain.deepspeed.dropin import VERSION
from hybridtrain.deepspeed.engine import DeepSpeedEngine
from hybridtrain.deepspeed.pipe import PipelineEngine, PipelineModule
from hybridtrain.deepspeed.runtime import zero
from hybridtrain.deepspeed.runtime.zero import partitioning

__all__ = ["DeepSpeedEngine", "PipelineEngine", "PipelineModule", "add_config_arguments", "checkpointing", "comm",
           "init_distributed", "initialize", "ops", "pipe", "runtime", "utils", "zero"]

__version__ = VERSION
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
               ) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """``deepspeed.initialize``: wrap ``model`` for training as the config describes.

    The config is ``config``, else ``config_params``, else ``args.deepspeed_config`` (or the
    legacy ``args.deepscale_config``); giving it both in ``args`` and as an argument is an
    error, as in DeepSpeed. ``optimizer`` (an optimizer, or a callable taking the parameters)
    overrides the config's; ``model_parameters`` (parameters or param-group dicts) is what
    the config's optimizer is built over. ``lr_scheduler`` (a scheduler, or a callable taking
    the optimizer) overrides the config's. ``training_data`` becomes a ``DataLoader`` of
    ``train_micro_batch_size_per_gpu`` samples (a ``DistributedSampler`` over the
    data-parallel ranks when there are several).

    A :class:`~hybridtrain.deepspeed.pipe.PipelineModule` gets a
    :class:`~hybridtrain.deepspeed.pipe.PipelineEngine` (``train_batch``/``eval_batch``),
    see :func:`hybridtrain.deepspeed.pipe.setup.initialize_pipeline`.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Raises:
        ValueError: no config, or two of them; ConfigError: a setting hybridtrain cannot run.
    """
    from hybridtrain.config import load_config
    from hybridtrain.config.loading import plain_copy

    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if mpu is not None or mesh_param is not None:
        raise NotImplementedError("initialize(mpu=…/mesh_param=…): give the parallel sizes in the config instead "
                                  "(tensor_parallel.size, pipeline.stages)")
    raw = _raw_config(args, config, config_params)
    raw_config = plain_copy(raw)
    # DeepSpeed 0.19.8 clips at 1.0 when the config says nothing (GRADIENT_CLIPPING_DEFAULT);
    # hybridtrain's own default is no clipping.
    raw.setdefault("gradient_clipping", DEFAULT_GRADIENT_CLIPPING)
    _never_print(raw)
    # DeepSpeed's first engine log line; users and transformers' tests look for it.
    utils.log_dist(f"DeepSpeed info: version={VERSION}, git-hash=unknown, git-branch=unknown", ranks=[0])
    loader_options = {key: raw.pop(key) for key in _LOADER_KEYS if key in raw}
    drop_last = bool(loader_options.get("dataloader_drop_last"))
    params = list(model_parameters) if model_parameters is not None else None
    if type(model).__name__ == "PipelineModule" and not isinstance(model, PipelineModule):
        raise TypeError("deepspeed.initialize: this PipelineModule is DeepSpeed's own; build it from "
                        "hybridtrain.deepspeed.pipe (from hybridtrain.deepspeed.pipe import PipelineModule)")
    if isinstance(model, PipelineModule):
        from hybridtrain.deepspeed.pipe.setup import initialize_pipeline

        return initialize_pipeline(model, raw, optimizer, params, training_data, lr_scheduler,
                                   dist_init_required, collate_fn, drop_last)
    init_step = takes_fp16_init_step(raw, client=optimizer is not None)
    raw, consecutive_hysteresis = _without_consecutive_hysteresis(raw)
    # Parameter offload of a model with no blocks to stream stays on the device (same math), so
    # DeepSpeed's half math decides over that (ZeRO-3 on one process; building keeps it).
    cfg = without_unstreamable_param_offload(load_config(raw), model)
    half_weights = master_weights(raw, cfg)
    if consecutive_hysteresis and not half_weights:
        load_config({**raw, "fp16": {**raw["fp16"], "consecutive_hysteresis": True}})  # refused there, with why
    # As DeepSpeed's engine: join the group a launcher describes (one process too, as under
    # `deepspeed script.py` or `python -m hybridtrain.deepspeed`, so a framework's collectives run).
    if dist_init_required or (dist_init_required is None and (int(os.environ.get("WORLD_SIZE", "1")) > 1
                                                              or comm.launched())):
        init_distributed(dist_init_required=True)
    # A model built under zero.Init (transformers' from_pretrained with a live ZeRO-3 config) holds
    # DeepSpeed's partitions: gathered whole here, the engine then shards it its own way; under
    # ZeRO-3's own bf16/fp16 math the partitions go straight into the engine's shards (building).
    if not (half_weights and cfg.zero_optimization.stage == 3):
        partitioning.make_whole(model)
    engine = build_engine(model, cfg, init_step, optimizer, params, lr_scheduler, half_weights=half_weights,
                          consecutive_hysteresis=consecutive_hysteresis, raw=raw)
    loader = None
    if training_data is not None:
        loader = _data_loader(training_data, engine, collate_fn, drop_last)
    wrapped = DeepSpeedEngine(engine, cfg, loader, raw_config=raw_config)
    if isinstance(optimizer, torch.optim.Optimizer) and optimizer is not engine.optimizer:
        wrapped.callers_optimizer = optimizer
    return wrapped, engine.optimizer, loader, engine.scheduler


DEFAULT_GRADIENT_CLIPPING = 1.0
"""DeepSpeed 0.19.8's ``gradient_clipping`` when a config does not set it."""


def _without_consecutive_hysteresis(raw: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``raw`` without ``fp16.consecutive_hysteresis: true``, and whether it was there: DeepSpeed's
    fp16 math (:mod:`hybridtrain.deepspeed.loss_scale`) keeps that rule; the engine's own loss
    scaler, which the config describes, does not."""
    fp16 = raw.get("fp16")
    if not isinstance(fp16, Mapping) or fp16.get("consecutive_hysteresis") is not True:
        return raw, False
    return {**raw, "fp16": {k: v for k, v in fp16.items() if k != "consecutive_hysteresis"}}, True


def _never_print(raw: dict[str, Any]) -> None:
    """``steps_per_print: inf`` (Accelerate always writes it) means never print, as in
    DeepSpeed; hybridtrain's config takes a step count, so it gets one no run reaches."""
    value = raw.get("steps_per_print")
    if isinstance(value, float) and math.isinf(value) and value > 0:
        raw["steps_per_print"] = sys.maxsize


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


def __getattr__(name: str) -> Any:
    # `deepspeed.init_inference`, `deepspeed.tp_model_init`, …: one line naming what is missing.
    raise AttributeError(f"deepspeed.{name} is not provided by hybridtrain's DeepSpeed drop-in "
                         "(hybridtrain.deepspeed); see the README's DeepSpeed section for what is")
