"""``deepspeed.checkpointing``: activation checkpointing as scripts (and Lightning) call it.

``checkpoint(function, *args)`` recomputes ``function``'s activations in the backward
(``torch.utils.checkpoint``), which is DeepSpeed's math; ``configure`` accepts DeepSpeed's
options, and refuses in one line those that change where activations live in ways this
engine does not implement (partitioning across model-parallel ranks, contiguous buffers).
Activation checkpointing of a whole model is the config's ``activation_checkpointing``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["checkpoint", "configure", "is_configured", "reset"]

_configured = False


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's ``checkpointing.configure``. ``synchronize``/``profile``/``num_checkpoints``
    only time or size buffers; ``checkpoint_in_cpu`` keeps the checkpointed inputs on the CPU
    in DeepSpeed, on the device here (same values).

    Raises:
        NotImplementedError: ``mpu_``, ``partition_activations`` or ``contiguous_checkpointing``.
    """
    global _configured
    refused = [name for name, value in (("mpu_", mpu_), ("partition_activations", partition_activations),
                                        ("contiguous_checkpointing", contiguous_checkpointing)) if value]
    if refused:
        raise NotImplementedError(f"deepspeed.checkpointing.configure({refused[0]}=…) is not supported by "
                                  "hybridtrain.deepspeed; use the config's activation_checkpointing section")
    _configured = True


def is_configured() -> bool:
    """Whether :func:`configure` has run."""
    return _configured


def reset() -> None:
    """Nothing to free: no activation buffers are kept between steps."""


def checkpoint(function: Any, *args: Any) -> Any:
    """``function(*args)`` whose activations are recomputed in the backward."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
