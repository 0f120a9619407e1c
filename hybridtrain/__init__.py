"""hybridtrain: train PyTorch models larger than one GPU's memory, with plain-PyTorch math.

>>> import hybridtrain as ht
>>> engine = ht.initialize(model, {"train_batch_size": 8, "bf16": {"enabled": True}})
>>> loss = engine.train_batch((inputs, targets))
"""

from __future__ import annotations

__version__ = "0.1.0"

from hybridtrain.config import Config, ConfigError, load_config  # noqa: E402
from hybridtrain.engine import Engine, NonFiniteLossError  # noqa: E402
from hybridtrain.initialize import initialize  # noqa: E402

__all__ = ["Config", "ConfigError", "Engine", "NonFiniteLossError", "__version__", "initialize", "load_config"]
