"""``deepspeed.runtime``: the parts scripts reach through the ``deepspeed`` name
(``deepspeed.runtime.utils.set_random_seed``)."""

from hybridtrain.deepspeed.runtime import utils

__all__ = ["utils"]
