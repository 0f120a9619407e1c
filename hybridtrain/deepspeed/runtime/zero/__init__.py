"""``deepspeed.zero`` (= ``deepspeed.runtime.zero``): ``Init``, ``GatheredParameters`` and
the external-parameter registry, as the frameworks call them; see
:mod:`hybridtrain.deepspeed.runtime.zero.partition_parameters` for what each does here."""

from hybridtrain.deepspeed.runtime.zero import partition_parameters
from hybridtrain.deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "partition_parameters", "register_external_parameter",
           "unregister_external_parameter"]
