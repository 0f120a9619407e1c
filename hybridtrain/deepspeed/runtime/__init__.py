"""``deepspeed.runtime``: the parts scripts and frameworks reach through the ``deepspeed``
name (``runtime.utils``, ``runtime.lr_schedules``, ``runtime.zero``, ``runtime.engine``)."""

from hybridtrain.deepspeed.runtime import base_optimizer, engine, lr_schedules, utils, zero

__all__ = ["base_optimizer", "engine", "lr_schedules", "utils", "zero"]
