"""``initialize``: THE public way to an engine, the caller's model on the one road.

Everything beneath it (:func:`hybridtrain.prepare.prepare`: auto-plan, ``resolve``, ``build``) is
internal and may change; users and scripts call ``hybridtrain.initialize`` (or the DeepSpeed drop-in's
``deepspeed.initialize``, which takes the same road). Named ``compose`` so that the submodule does not
shadow the ``hybridtrain.initialize`` function.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridtrain.config import Config, ConfigError, ConfigSource, load_config
from hybridtrain.engine import Engine
from hybridtrain.prepare import prepare
from hybridtrain.runtime.batch import Batch, LossFn
from hybridtrain.runtime.device import resolve_device


def initialize(model: nn.Module, config: ConfigSource | None = None, loss_fn: LossFn | None = None,
               optimizer: torch.optim.Optimizer | None = None, example_batch: Batch | None = None) -> Engine:
    """Prepare ``model`` for training as ``config`` describes: the one public way to an engine.

    Args:
        model: any ``nn.Module`` (including Hugging Face models).
        config: a ``Config``, a dict, or a JSON/YAML path (DeepSpeed keys load as they are).
        loss_fn: ``loss_fn(outputs, batch) -> loss``; without it the output's ``.loss`` or a
            scalar output is the loss.
        optimizer: an optimizer over ``model``'s parameters; built from ``config.optimizer``
            when absent. Either trains with plain PyTorch math: DeepSpeed's fp16 init step
            (one step with zero gradients when built) is the DeepSpeed drop-in's
            (:mod:`hybridtrain.deepspeed`), taken here only where the config's
            ``optimizer.params.fp16_init_step`` is true.
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
            :func:`~hybridtrain.recovery.oom.initialize_guarded`.
    """
    cfg = load_config(config)
    check_autocast_math(cfg, "hybridtrain.compose.initialize")
    check_plain_initialize(cfg)
    return prepare(cfg, model, loss_fn, optimizer, example_batch).engine


def asks_deepspeed_math(config: Config) -> bool:
    """Whether ``config`` asks for DeepSpeed's bf16/fp16 math (``precision_math: deepspeed`` with
    ``bf16`` or ``fp16`` enabled)."""
    return config.precision_math == "deepspeed" and (config.bf16.enabled or config.fp16.enabled)


def check_autocast_math(config: Config, road: str) -> None:
    """Refuse ``precision_math: deepspeed`` with bf16/fp16 on a ``road`` that trains them under
    autocast only (DeepSpeed's math is built above the one road, by ``hybridtrain.initialize``
    and the DeepSpeed drop-in).

    Raises:
        ConfigError: one line naming the field, its value and what this road allows.
    """
    if asks_deepspeed_math(config):
        raise ConfigError(f"precision_math = 'deepspeed' is not available in {road}, which trains bf16/fp16 "
                          "under autocast; allowed here: 'autocast' or unset (hybridtrain.initialize and the "
                          "DeepSpeed drop-in train DeepSpeed's math)")


def check_plain_initialize(config: Config) -> None:
    """What :func:`initialize` (which keeps the caller's model) cannot honour.

    Raises:
        ConfigError: one line pointing to :func:`~hybridtrain.recovery.oom.initialize_guarded`.
    """
    if config.oom_recovery.enabled:
        raise ConfigError("oom_recovery.enabled: initialize(model, ...) cannot rebuild the model it was given under "
                          "another plan; use hybridtrain.recovery.oom.initialize_guarded(model_factory, "
                          "config) or hybridtrain train")
    if config.device_memory_limit is not None and resolve_device(config.device).type == "cpu":
        raise ConfigError(f"device_memory_limit = {config.device_memory_limit} on cpu is counted around each "
                          "training step; use hybridtrain.recovery.oom.initialize_guarded(model_factory, "
                          "config) and guard.train_batch, or hybridtrain train")
