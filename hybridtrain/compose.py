"""``initialize``: :func:`~hybridtrain.plan.resolve.resolve` then
:func:`~hybridtrain.plan.build.build`. (Named ``compose`` so that the submodule does not
shadow the ``hybridtrain.initialize`` function.)"""

from __future__ import annotations

import torch
from torch import nn

from hybridtrain.config import ConfigSource
from hybridtrain.engine import Engine
from hybridtrain.plan.build import build
from hybridtrain.plan.resolve import resolve
from hybridtrain.planner.auto import planned_config
from hybridtrain.runtime.batch import Batch, LossFn
from hybridtrain.runtime.memory_limit import cap_cuda_memory
from hybridtrain.runtime.oom_recovery import check_plain_initialize


def initialize(model: nn.Module, config: ConfigSource | None = None, loss_fn: LossFn | None = None,
               optimizer: torch.optim.Optimizer | None = None, example_batch: Batch | None = None) -> Engine:
    """Prepare ``model`` for training as ``config`` describes.

    Args:
        model: any ``nn.Module`` (including Hugging Face models).
        config: a ``Config``, a dict, or a JSON/YAML path (DeepSpeed keys load as they are).
        loss_fn: ``loss_fn(outputs, batch) -> loss``; without it the output's ``.loss`` or a
            scalar output is the loss.
        optimizer: an optimizer over ``model``'s parameters; built from ``config.optimizer``
            when absent.
        example_batch: one batch shaped like those ``train_batch`` receives. Pipeline
            parallel needs it (the model is split into stages here, from one traced forward);
            layer streaming uses it to find parameters used outside their block.

    Returns:
        The engine; ``engine.train_batch(batch)`` runs one optimizer step.

    Raises:
        ConfigError: any invalid or unsupported setting, before the model is changed (a
            pipeline's or streaming's example forward runs, leaving parameters, buffers and
            random generators as they were); ``oom_recovery`` and a CPU
            ``device_memory_limit``, which need
            :func:`~hybridtrain.runtime.oom_recovery.initialize_guarded`.
    """
    config = planned_config(config, model, loss_fn, example_batch)  # "auto": the planner chooses
    plan = resolve(config, model, example_batch=example_batch, optimizer=optimizer)
    check_plain_initialize(plan.config, plan.device)
    if plan.config.device_memory_limit is not None:  # CUDA here: the CPU count needs a guard
        cap_cuda_memory(plan.config.device_memory_limit, plan.device)
    return build(plan, model, loss_fn, optimizer, example_batch)
