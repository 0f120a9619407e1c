"""ZeRO-1/2's partitioned fp32 masters on several ranks, for DeepSpeed's bf16/fp16 math
(:mod:`hybridtrain.deepspeed.master_weights`): each rank holds its shard of every master and of
the optimizer state, the half weights are gathered whole after the step."""

from __future__ import annotations

import torch
import torch.distributed as dist


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of ``rows`` that sharding along the first dimension gives
    ``rank`` of ``world`` (``torch.chunk``'s split, as ``Shard(0)``: ``ceil(rows / world)`` each,
    the last ones shorter or empty)."""
    size = -(-rows // world) if rows else 0
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def shard_elements(shape: torch.Size, world: int, rank: int) -> tuple[int, int]:
    """The elements ``[start, stop)`` of a flattened tensor of ``shape`` in ``rank``'s master
    shard (a 0-dim tensor is replicated: its one element)."""
    if len(shape) == 0:
        return 0, 1
    columns = 1
    for size in shape[1:]:
        columns *= size
    start, stop = shard_rows(shape[0], world, rank)
    return start * columns, stop * columns


class MasterShards:
    """ZeRO-1/2's partitioned fp32 masters: each rank holds 1/world of every master, a ``DTensor``
    sharded along its first dimension over the data-parallel ranks (a 0-dim master is
    replicated). DeepSpeed cuts one flat buffer per group instead; the masters' optimizer (Adam
    and the like) updates element by element, so the cut changes no bits, and the checkpoint
    code reads whole masters and optimizer state through ``full_tensor`` as it does ZeRO's
    sharded parameters. The half weights are gathered whole after each step (:meth:`whole`,
    DeepSpeed's all-gather of the half weights).

    Args:
        device: where the masters live (the host under ZeRO-Offload; collectives there over gloo).
    """

    def __init__(self, device: torch.device) -> None:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        world = dist.get_world_size()
        if device.type == "cpu" and "gloo" not in str(dist.get_backend()):
            # Host masters beside device collectives (ZeRO-Offload on accelerators): a gloo group.
            self.mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
        else:
            self.mesh = init_device_mesh(device.type, (world,))

    def shard(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``whole`` (every rank holds the same ``whole``; no communication)."""
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        placements = [Replicate()] if whole.dim() == 0 else [Shard(0)]
        return distribute_tensor(whole, self.mesh, placements, src_data_rank=None)

    @staticmethod
    def from_local(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's shard, in ``like``'s local shape) as a tensor sharded as ``like``."""
        from torch.distributed.tensor import DTensor

        mesh = like.device_mesh  # type: ignore[attr-defined]
        return DTensor.from_local(local, mesh, like.placements, run_check=False,  # type: ignore[attr-defined]
                                  shape=like.shape, stride=like.stride())

    @staticmethod
    def whole(master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``master`` whole on every rank in ``dtype`` (cast before the all-gather, as DeepSpeed
        gathers the half weights)."""
        return master.to(dtype).full_tensor()  # type: ignore[attr-defined]
