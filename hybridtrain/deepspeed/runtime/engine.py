"""``deepspeed.runtime.engine``: the engine class, for ``isinstance`` checks."""

from hybridtrain.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
