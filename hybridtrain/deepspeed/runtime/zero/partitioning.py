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
def partition(param: nn.Parameter, dtype: torch.dtype | None = None) -> None:
    """Keep only this rank's part of ``param`` (see the module), cast to ``dtype`` when given and
    ``param`` is floating (DeepSpeed's ``zero.Init`` casts to the config's half dtype); its data
    must be whole and the same on every rank (built from the same seed, or broadcast)."""
    rank, world = _rank_and_world()
    numel = param.data.numel()
    share = partition_size(numel, world)
    if not is_partitioned(param):
        param.ds_numel = numel  # type: ignore[attr-defined]
        param.ds_shape = param.shape  # type: ignore[attr-defined]
        param.ds_id = next(_ids)  # type: ignore[attr-defined]
        param.ds_build_dtype = param.dtype  # type: ignore[attr-defined]
    dtype = dtype if dtype is not None and param.is_floating_point() else param.dtype
    flat = torch.zeros(share * world, dtype=dtype, device=param.device)
    flat[:numel] = param.data.reshape(-1)
    param.ds_tensor = flat[rank * share:(rank + 1) * share].clone()  # type: ignore[attr-defined]
    param.ds_tensor.ds_numel = share  # type: ignore[attr-defined]
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
    param.data = torch.empty(0, dtype=dtype, device=param.device)


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
    collective), in the dtype it was built in (values a half partition rounded are widened
    exactly), so that an engine takes the model as built whole; True if any was partitioned."""
    params = [p for p in model.parameters() if is_partitioned(p)]
    gather(params)
    for param in params:
        if param.dtype != param.ds_build_dtype:  # type: ignore[attr-defined]
            param.data = param.data.to(param.ds_build_dtype)  # type: ignore[attr-defined]
        _forget(param)
    return bool(params)


def _forget(param: nn.Parameter) -> None:
    for name in ("ds_tensor", "ds_numel", "ds_shape", "ds_id", "ds_status", "ds_build_dtype"):
        delattr(param, name)


Partitions = dict[str, tuple[torch.Tensor, int, torch.Size]]
"""Values set aside by :func:`hold_partitions`: parameter name → (this rank's part, numel, shape); a
buffer's name → (its value, numel, shape)."""


@torch.no_grad()
def hold_partitions(model: nn.Module, dtype: torch.dtype) -> Partitions | None:
    """When every parameter of ``model`` is partitioned: take each one's part out and put a
    whole-shaped parameter of ``dtype`` on the meta device in its place (tied ones stay tied; the
    buffers, never partitioned, are set aside too), so that an engine shards the model as it
    shards a model built on the meta device and :func:`load_partitions` then fills the shards:
    the model is never whole on a rank. Whoever holds the old parameter objects (an optimizer)
    must have named them first. None (nothing changed) when some parameter is not partitioned.
    Nothing is communicated."""
    params = dict(model.named_parameters())
    if not params or not all(is_partitioned(p) for p in params.values()):
        return None
    held: Partitions = {name: (b.detach().clone(), b.numel(), b.shape) for name, b in model.named_buffers()}
    for name, param in params.items():
        held[name] = (param.ds_tensor, int(param.ds_numel), torch.Size(param.ds_shape))  # type: ignore[attr-defined]
    placeholders: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in placeholders:
                placeholders[id(param)] = nn.Parameter(
                    torch.empty(param.ds_shape, dtype=dtype, device="meta"),  # type: ignore[attr-defined]
                    requires_grad=param.requires_grad)
            setattr(module, name, placeholders[id(param)])
    return held


@torch.no_grad()
def load_partitions(model: nn.Module, held: Partitions) -> None:
    """Copy the values :func:`hold_partitions` set aside into ``model``'s parameters as the engine
    laid them out (a DTensor's shard, else the whole tensor), one parameter at a time, so at most
    one is whole at once (a collective per parameter, in the model's order on every rank), and
    its buffers back."""
    from torch.distributed.tensor import DTensor

    _, world = _rank_and_world()
    for name, buffer in model.named_buffers():
        if name in held:
            buffer.copy_(held.pop(name)[0])
    for name, param in model.named_parameters():
        part, numel, shape = held.pop(name)
        if world > 1:
            parts = [torch.empty_like(part) for _ in range(world)]
            dist.all_gather(parts, part.contiguous())
            whole = torch.cat(parts)[:numel].view(shape)
        else:
            whole = part[:numel].view(shape)
        shard = shard_like(whole, param)
        (param.to_local() if isinstance(param, DTensor) else param).copy_(
            shard.to_local() if isinstance(shard, DTensor) else shard)
        del whole, shard


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``like``: this rank's shard of it (a DTensor cut locally, nothing
    communicated: every rank holds ``full``) when ``like`` is a DTensor, else ``full``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    local = like.to_local()
    return distribute_tensor(full.to(local.device, local.dtype), like.device_mesh, like.placements,
                             src_data_rank=None)
