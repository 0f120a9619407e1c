"""hybridtrain: train PyTorch models larger than one GPU's memory, with plain-PyTorch math.

>>> import hybridtrain as ht
>>> engine = ht.initialize(model, {"train_batch_size": 8, "bf16": {"enabled": True}})
>>> loss = engine.train_batch((inputs, targets))

:func:`initialize` is the one public way to an engine. ``hybridtrain.prepare.prepare`` and the
``resolve``/``build`` of ``hybridtrain.plan`` beneath it are internals (the road every engine takes,
described in docs/architecture.md): importable, but not part of the public API.

The public names are imported on first use, so ``import hybridtrain`` (and the CLI, and
hyperparameter-search trial scripts) does not pay for importing torch until it needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "hybridtrain.config",
    "ConfigError": "hybridtrain.config",
    "load_config": "hybridtrain.config",
    "Engine": "hybridtrain.engine",
    "NonFiniteLossError": "hybridtrain.engine",
}

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hybridtrain.config import Config, ConfigError, ConfigSource, load_config
    from hybridtrain.engine import Engine, NonFiniteLossError
    from hybridtrain.runtime.batch import Batch, LossFn


def initialize(model: nn.Module, config: ConfigSource | None = None, loss_fn: LossFn | None = None,
               optimizer: torch.optim.Optimizer | None = None, example_batch: Batch | None = None) -> Engine:
    """Prepare ``model`` for training as ``config`` describes: the one public way to an engine
    (:func:`hybridtrain.compose.initialize` documents the arguments).

    With ``precision_math: deepspeed`` (and ``bf16``/``fp16`` enabled) the engine trains with
    DeepSpeed's bf16/fp16 math, decided and built as the DeepSpeed drop-in does
    (:func:`hybridtrain.deepspeed.building.initialize_with_deepspeed_math`); otherwise with
    autocast over fp32 weights (:func:`hybridtrain.compose.initialize`).
    """
    from hybridtrain.compose import initialize as plain_initialize
    from hybridtrain.config import load_config
    from hybridtrain.config.loading import config_as_written

    cfg = load_config(config)
    if cfg.precision_math != "deepspeed":
        return plain_initialize(model, cfg, loss_fn, optimizer, example_batch)
    from hybridtrain.deepspeed.building import initialize_with_deepspeed_math

    # DeepSpeed's rules read what the user wrote, not the schema's defaults.
    return initialize_with_deepspeed_math(model, cfg, config_as_written(config), loss_fn, optimizer, example_batch)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["Config", "ConfigError", "Engine", "NonFiniteLossError", "__version__", "initialize", "load_config"]
