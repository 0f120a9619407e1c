"""Where a streamed model lives before its first step: everything on the device except the
streamed blocks' parameters (:func:`place_for_streaming`), and no parameter shared across a
streamed block's edge (:func:`check_not_shared`), since a streamed block's parameters are
its host masters, uploaded into a buffer of the block's own."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def place_for_streaming(model: nn.Module, streamed: Sequence[nn.Module], device: torch.device) -> None:
    """Move everything to ``device`` except the streamed blocks' parameters (their buffers
    are small and go too), so a model larger than the device never lands on it whole."""
    keep = {id(p) for block in streamed for p in block.parameters()}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in keep:
                p.data = p.data.to(device)
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, b.to(device))  # a buffer stays a buffer (nn.Module.__setattr__)


def check_not_shared(model: nn.Module, streamed: Sequence[nn.Module]) -> None:
    """Refuse a parameter that a streamed block shares with another module.

    Raises:
        ValueError: naming the parameter and its second owner.
    """
    path = {id(m): n for n, m in model.named_modules()}  # blocks named by their module paths
    owner: dict[int, str] = {}
    for i, block in enumerate(streamed):
        where = path.get(id(block), f"streamed block {i}")
        for name, p in block.named_parameters():
            if id(p) in owner:
                raise ValueError(f"parameter {where}.{name} is shared with {owner[id(p)]}; "
                                 "list the sharing blocks in layer_streaming.resident")
            owner[id(p)] = f"{where}.{name}"
    streamed_ids = {id(m) for block in streamed for m in block.modules()}
    for mname, module in model.named_modules():
        if id(module) in streamed_ids:
            continue
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in owner:
                raise ValueError(f"parameter {mname}.{pname} is shared with {owner[id(p)]}; "
                                 "list that block in layer_streaming.resident")
