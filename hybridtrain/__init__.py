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
    "initialize": "hybridtrain.compose",
}

if TYPE_CHECKING:
    from hybridtrain.compose import initialize
    from hybridtrain.config import Config, ConfigError, load_config
    from hybridtrain.engine import Engine, NonFiniteLossError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["Config", "ConfigError", "Engine", "NonFiniteLossError", "__version__", "initialize", "load_config"]
