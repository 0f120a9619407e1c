"""ZeRO-3's parameter partitions, laid out as DeepSpeed's ``zero.Init`` leaves them.

A partitioned parameter keeps its ``Parameter`` object (the model, its optimizer groups and
``named_parameters`` see the same one) but holds no data: ``param.data`` is an empty tensor,
``param.ds_tensor`` is this rank's partition (the flat parameter padded with zeros to a multiple
of the world size and cut in equal parts, part ``rank``), and ``ds_numel``, ``ds_shape``,
``ds_id`` and ``ds_status`` say what it is, as DeepSpeed's ``partition_parameters`` sets them.
Gathering all-gathers the partitions back into ``param.data`` (a collective: every rank calls
it with the same parameters, in the same order).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from enum import Enum

import torch
import torch.distributed as dist
from torch import nn


class ZeroParamStatus(Enum):
    """DeepSpeed's ``ZeroParamStatus``: whether a parameter's data is here."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_ids = itertools.count()


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is one of :func:`partition`'s (gathered or not)."""
    return hasattr(param, "ds_tensor")


def partition_size(numel: int, world: int) -> int:
    """Each rank's share of a parameter of ``numel`` elements (the padded flat size / world)."""
    return math.ceil(numel / world) if numel else 0


@torch.no_grad()
def partition(param: nn.Parameter) -> None:
    """Keep only this rank's part of ``param`` (see the module); its data must be whole and the
    same on every rank (built from the same seed, or broadcast)."""
    rank, world = _rank_and_world()
    numel = param.data.numel()
    share = partition_size(numel, world)
    flat = torch.zeros(share * world, dtype=param.dtype, device=param.device)
    flat[:numel] = param.data.reshape(-1)
    if not is_partitioned(param):
        param.ds_numel = numel  # type: ignore[attr-defined]
        param.ds_shape = param.shape  # type: ignore[attr-defined]
        param.ds_id = next(_ids)  # type: ignore[attr-defined]
    param.ds_tensor = flat[rank * share:(rank + 1) * share].clone()  # type: ignore[attr-defined]
    param.ds_tensor.ds_numel = share  # type: ignore[attr-defined]
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


@torch.no_grad()
def gather(params: Iterable[nn.Parameter]) -> None:
    """Put every partitioned parameter of ``params`` back whole into its ``data`` (a collective
    under several processes); parameters already whole are left as they are."""
    rank, world = _rank_and_world()
    for param in params:
        if not is_partitioned(param) or param.ds_status is ZeroParamStatus.AVAILABLE:  # type: ignore[attr-defined]
            continue
        local = param.ds_tensor  # type: ignore[attr-defined]
        if world > 1:
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local.contiguous())
            whole = torch.cat(parts)
        else:
            whole = local
        param.data = whole[:param.ds_numel].view(param.ds_shape).clone()  # type: ignore[attr-defined]
        param.ds_status = ZeroParamStatus.AVAILABLE  # type: ignore[attr-defined]


def release(param: nn.Parameter) -> None:
    """Drop ``param``'s gathered data, as DeepSpeed does after a read-only gather."""
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]


def make_whole(model: nn.Module) -> bool:
    """Gather every partitioned parameter of ``model`` for good and forget its partition (a
    collective), so that an engine takes the model as built whole; True if any was partitioned."""
    params = [p for p in model.parameters() if is_partitioned(p)]
    gather(params)
    for param in params:
        for name in ("ds_tensor", "ds_numel", "ds_shape", "ds_id", "ds_status"):
            delattr(param, name)
    return bool(params)
