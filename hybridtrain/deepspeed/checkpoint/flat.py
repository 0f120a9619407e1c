"""ZeRO-1/2's flat layout: how DeepSpeed lays one optimizer group's parameters out as one
flat fp32 buffer and cuts it into a partition per data-parallel rank.

The group's parameters are concatenated in group order (``param_alignment_paddings`` may
put zeros after each but the last), the buffer is padded at its end to a multiple of
``2 × dp`` elements, and rank ``r`` owns the ``r``-th of ``dp`` equal slices. A rank's
``group_paddings`` entry is how much of its slice is that end padding; the files hold each
rank's slice without it (``single_partition_of_fp32_groups``), while the base optimizer's
rigid state keeps it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ALIGNMENT_FACTOR = 2
"""DeepSpeed's ``nccl_start_alignment_factor``: the flat buffer is a multiple of this × dp."""


def partition_size(total: int, dp: int) -> int:
    """Elements in each rank's slice of a group of ``total`` elements over ``dp`` ranks."""
    alignment = ALIGNMENT_FACTOR * dp
    return math.ceil(total / alignment) * alignment // dp


def paddings(total: int, dp: int) -> list[int]:
    """Each rank's end padding (``group_paddings``) for a group of ``total`` elements."""
    size = partition_size(total, dp)
    return [size - max(0, min(size, total - rank * size)) for rank in range(dp)]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The group's tensors as one flat fp32 buffer (no padding)."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors]) if tensors else torch.zeros(0)


def rank_slice(flat: torch.Tensor, dp: int, rank: int, padded: bool) -> torch.Tensor:
    """Rank ``rank``'s slice of ``flat`` (a whole group, no padding): with ``padded``, its
    full partition (zeros past the group's end); else without the end padding."""
    size = partition_size(flat.numel(), dp)
    piece = flat[rank * size:(rank + 1) * size].clone()
    if padded and piece.numel() < size:
        piece = torch.cat([piece, piece.new_zeros(size - piece.numel())])
    return piece


def split(flat: torch.Tensor, shapes: Sequence[torch.Size], gaps: Sequence[int] | None = None) -> list[torch.Tensor]:
    """The parameters in ``flat`` (a whole group, no end padding), shaped as ``shapes``;
    ``gaps`` are DeepSpeed's ``param_alignment_paddings`` (zeros after each parameter).

    Raises:
        ValueError: ``flat`` holds fewer elements than the shapes need.
    """
    gaps = gaps or [0] * len(shapes)
    needed = sum(math.prod(s) for s in shapes) + sum(gaps[:-1] if gaps else [])
    if flat.numel() < needed:
        raise ValueError(f"a ZeRO group holds {flat.numel()} elements, its parameters need {needed}")
    out, offset = [], 0
    for shape, gap in zip(shapes, gaps, strict=True):
        numel = math.prod(shape)
        out.append(flat[offset:offset + numel].reshape(shape).clone())
        offset += numel + gap
    return out
