"""Configuration: the typed schema, loading, and batch-size arithmetic."""

from hybridtrain.config.batch_sizes import BatchSizes, resolve_batch_sizes
from hybridtrain.config.loading import (
    ConfigError,
    ConfigSource,
    explain_config,
    load_config,
)
from hybridtrain.config.schema import Config

__all__ = [
    "BatchSizes",
    "Config",
    "ConfigError",
    "ConfigSource",
    "explain_config",
    "load_config",
    "resolve_batch_sizes",
]
