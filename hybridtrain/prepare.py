"""``prepare``: the one road from a config to an engine.

Every engine is built here, whoever asks for it — :func:`hybridtrain.initialize`, the
trainer behind ``hybridtrain train``, out-of-memory recovery's rebuilds, the guarded
initialize and the DeepSpeed drop-in — so they cannot disagree about what a config means::

    config ─► planned_config   "auto": true lets the planner choose (planner/auto.py)
           ─► resolve          every decision and every ConfigError (plan/resolve.py)
           ─► memory cap       a CUDA device_memory_limit caps this process's share
           ─► build            the plan applied to the model (plan/build.py)
           ─► Engine

What differs between callers stays with them: ``initialize`` refuses what only a guard
can honour, the guard and the trainer run steps under the limit, the DeepSpeed layer
applies DeepSpeed's own rules to the engine it gets back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridtrain.config import ConfigSource
from hybridtrain.engine import Engine
from hybridtrain.plan.build import build
from hybridtrain.plan.resolve import resolve
from hybridtrain.plan.types import TrainingPlan
from hybridtrain.planner.auto import planned_config
from hybridtrain.runtime.batch import Batch, LossFn
from hybridtrain.runtime.memory_limit import cap_cuda_memory


@dataclass(frozen=True)
class Prepared:
    """An engine and the plan it was built from (``plan.config`` is the config in force:
    with ``auto`` the planner's choice)."""

    engine: Engine
    plan: TrainingPlan


def prepare(config: ConfigSource | None, model: nn.Module, loss_fn: LossFn | None = None,
            optimizer: torch.optim.Optimizer | None = None, example_batch: Batch | None = None,
            world_size: int | None = None) -> Prepared:
    """Turn ``config`` and ``model`` into an engine: plan (``auto``), resolve, cap, build.

    Args:
        config: a ``Config``, a dict, or a JSON/YAML path.
        model: the model (changed in place by the build).
        loss_fn / optimizer / example_batch: as :func:`hybridtrain.initialize`.
        world_size: processes (default: ``WORLD_SIZE`` from the environment).

    Returns:
        The engine and its plan.

    Raises:
        ConfigError: any invalid or unsupported setting, or with ``auto`` no plan that fits,
            before the model is changed.
    """
    cfg = planned_config(config, model, loss_fn, example_batch)
    plan = resolve(cfg, model, world_size, example_batch=example_batch, optimizer=optimizer)
    limit = plan.config.device_memory_limit
    if limit is not None and plan.device.type == "cuda":  # on CPU a guard counts live bytes per step
        cap_cuda_memory(limit, plan.device)
    return Prepared(build(plan, model, loss_fn, optimizer, example_batch), plan)
