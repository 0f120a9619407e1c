"""Gradient synchronisation of a split (tensor- and/or pipeline-parallel) model, after
its backward: parameters that several pipeline ranks use have their gradients summed over
those ranks, then data-parallel replicas average theirs.

DDP cannot wrap a model whose parameters are DTensors or whose forward is driven by a
pipeline schedule, so replicas average here, once per step, with one flat all-reduce per
dtype. Tensor-parallel shards are averaged shard by shard (every replica holds the same
shard layout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hybridtrain.parallel.mesh import Topology
from hybridtrain.runtime.step_parts import step_part


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a (D)Tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a (D)Tensor (a collective over its mesh for a DTensor)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class GradientSync:
    """Sums the gradients of parameters shared by several pipeline ranks, then averages
    every gradient over the data-parallel replicas.

    Args:
        model: the (split) model whose parameters' gradients are synchronised.
        topology: where this rank sits.
        shared: ``(parameter names, process group of the ranks that use them)`` pairs;
            a group is None on ranks outside it.
        reduce_replicas: average over the data-parallel replicas (False under ZeRO, whose
            FSDP2 units already reduce-scattered the gradients over them).
    """

    def __init__(self, model: nn.Module, topology: Topology,
                 shared: Sequence[tuple[Sequence[str], dist.ProcessGroup | None]] = (),
                 reduce_replicas: bool = True) -> None:
        self.model = model
        self.topology = topology
        self.shared = [(list(names), group) for names, group in shared if group is not None]
        self.reduce_replicas = reduce_replicas

    def sync(self) -> None:
        """Sum shared gradients across their ranks, then average over replicas."""
        for names, group in self.shared:
            params = [self.model.get_parameter(name) for name in names]
            for param in params:
                if param.grad is None:  # this rank's stage did not reach it this step
                    param.grad = torch.zeros_like(param)
            _all_reduce([local(p.grad) for p in params if p.grad is not None], group, 1)
        if self.topology.dp > 1 and self.reduce_replicas:
            grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
            _all_reduce(grads, self.topology.group("dp"), self.topology.dp)

    # The backward observer protocol (tensor parallel without a pipeline).
    def before_backward(self, final: bool, loss: torch.Tensor) -> None:
        """Nothing to do before backward."""

    def after_backward(self, final: bool) -> None:
        """After the step's last micro-batch, synchronise the accumulated gradients."""
        if final:
            self.sync()


def _all_reduce(tensors: list[torch.Tensor], group: dist.ProcessGroup | None, divide: int) -> None:
    # One flat buffer per dtype: a handful of collectives instead of one per parameter.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        with step_part("communication"):
            dist.all_reduce(flat, group=group)
        if divide > 1:
            flat /= divide
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
