"""``deepspeed.runtime.base_optimizer``: the base class DeepSpeed's wrapped optimizers share
(for ``isinstance`` checks; hybridtrain hands out torch optimizers, which are not)."""

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]


class DeepSpeedOptimizer:
    """Marker base class, as DeepSpeed's."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """Marker base class, as DeepSpeed's."""
