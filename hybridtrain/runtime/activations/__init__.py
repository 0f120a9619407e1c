"""Activation memory: checkpointing (recompute in backward) and swapping saved activations to
host memory (vDNN), both wrapping a module's forward in place.

- :mod:`.recompute`: activation checkpointing and the modules it applies to
- :mod:`.swapping`: :class:`ActivationSwapper`, saved activations to host and back
- :mod:`.forward_wrap`: wrapping a module's ``forward`` without renaming its parameters
"""

from __future__ import annotations

from hybridtrain.runtime.activations.recompute import (
    apply_activation_checkpointing,
    is_kv_cache,
    remove_activation_checkpointing,
    select_checkpoint_targets,
    tensor_call,
)
from hybridtrain.runtime.activations.swapping import (
    ActivationSwapper,
    apply_activation_offload,
    params_in_several_backwards,
)

__all__ = [
    "ActivationSwapper",
    "apply_activation_checkpointing",
    "apply_activation_offload",
    "is_kv_cache",
    "params_in_several_backwards",
    "remove_activation_checkpointing",
    "select_checkpoint_targets",
    "tensor_call",
]
