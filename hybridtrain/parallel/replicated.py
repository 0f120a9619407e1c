"""The :class:`~hybridtrain.parallel.runtime.ParallelRuntime` of a replicated model: every
rank holds the whole model — one process (a world of one replica: the engine's default)
or DDP. Losses are averaged over the replicas, norms and state dicts are local.
:class:`~hybridtrain.parallel.zero.ZeroRuntime` and
:class:`~hybridtrain.parallel.split.SplitRuntime` extend it with what sharding or a split
model changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hybridtrain.parallel.mesh import Topology
from hybridtrain.runtime.precision import reported_loss
from hybridtrain.runtime.step_parts import step_part


def collective_device() -> torch.device:
    """Where small tensors for collectives live: NCCL reduces CUDA tensors only, gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ReplicatedRuntime:
    """Replicated model (one process, or DDP); the contract is
    :class:`~hybridtrain.parallel.runtime.ParallelRuntime`.

    Args:
        model: the user's model (parameter names as the user knows them).
        topology: where this rank sits.
        module: what the forward calls (defaults to ``model``).
    """

    def __init__(self, model: nn.Module, topology: Topology | None = None,
                 module: nn.Module | None = None) -> None:
        self.model = model
        self.topology = topology or Topology()
        self.module = module if module is not None else model

    @property
    def distributed(self) -> bool:
        """Whether more than one process cooperates."""
        return self.topology.world_size > 1

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes shared files (checkpoints, metrics): global rank 0."""
        return self.topology.rank == 0

    def set_grad_sync(self, sync: bool) -> None:
        """Communicate gradients in the next backward (False while accumulating)."""
        if isinstance(self.module, nn.parallel.DistributedDataParallel):
            self.module.require_backward_grad_sync = sync

    def counts_loss(self) -> bool:
        """Whether this rank's loss counts in the global mean (one rank per replica)."""
        return self.topology.is_last_stage and self.topology.tp_rank == 0

    def mean_loss(self, value: torch.Tensor) -> torch.Tensor:
        """The global batch's mean loss from this rank's replica mean, on every rank.

        Each replica trains an equal share, so the global mean is the mean over replicas;
        ranks that hold no loss (pipeline stages before the last, tensor-parallel peers)
        contribute zero to one all-reduce over the world.
        """
        if not self.distributed:
            return value
        share = reported_loss(value) / self.topology.dp if self.counts_loss() else torch.zeros_like(value)
        share = share.clone()
        with step_part("communication"):
            dist.all_reduce(share)
        return share

    def all_finite(self, finite: bool) -> bool:
        """Whether every rank found its gradients finite (ranks may hold different shards)."""
        if not self.distributed:
            return finite
        flag = torch.tensor([0.0 if finite else 1.0], device=collective_device())
        with step_part("communication"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() == 0.0)

    def clip_grad_norm(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (gradients are replicated after DDP's all-reduce)."""
        return torch.nn.utils.clip_grad_norm_(list(params), max_norm)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full state dict as CPU copies (every rank gets it)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def model_state_shapes(self) -> dict[str, torch.Size]:
        """Full shape of every state-dict entry, without gathering anything."""
        return {k: v.shape for k, v in self.model.state_dict().items()}

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (as :meth:`model_state_dict` returns) on every rank."""
        self.model.load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's full state (identical on every replica here)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Restore :meth:`optimizer_state_dict`'s result on every rank."""
        optimizer.load_state_dict(state)

    # Sharded checkpoints (hybridtrain.checkpoint.training_state) store every entry in its
    # full logical shape, as each rank holds it; these say how this runtime's tensors map to it.
    def owns(self, name: str) -> bool:
        """Whether this rank saves the state-dict entry (or parameter) ``name``."""
        return True

    def row_interleave(self, name: str) -> int:
        """The fused-qkv row order of ``name``'s tensors here: 1 = the user's ``[Q; K; V]``,
        n = tensor parallel's per-rank interleave over n ranks
        (:func:`hybridtrain.parallel.tensor.qkv_from_user`)."""
        return 1

    def from_user_layout(self, name: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``full``, a whole entry of ``name`` in the user's row order, in ``like``'s layout
        (row order, and sharding when ``like`` is a DTensor)."""
        if isinstance(like, DTensor):
            # Every rank holds the whole entry: each cuts its shard, nothing is communicated.
            return distribute_tensor(full.to(like.to_local().device), like.device_mesh, like.placements,
                                     src_data_rank=None)
        return full

    def barrier(self) -> None:
        """Wait for every rank (e.g. until the writer finished a checkpoint)."""
        if self.distributed:
            dist.barrier()
