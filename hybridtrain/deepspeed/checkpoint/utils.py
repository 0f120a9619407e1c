"""``deepspeed.checkpoint.utils``."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """Copies of the tensors in ``item`` (nested lists, tuples, dicts) on ``device``, so a
    saved file holds only them and not the storage they view, as DeepSpeed's helper.

    A parameter hybridtrain's ZeRO sharded over the processes (a ``DTensor``) is gathered
    whole, as DeepSpeed's ZeRO-1/2 module holds it: a collective, which the frameworks call
    on every rank (Accelerate's ``get_state_dict``, the Trainer's ``save_model``)."""
    if isinstance(item, DTensor):
        return item.full_tensor().detach().clone().to(device)
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list | tuple):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
