"""The :class:`~hybridtrain.parallel.runtime.ParallelRuntime` of a model split across ranks
(tensor and/or pipeline parallel), with plain data parallel over its replicas.

DDP cannot wrap a model whose parameters are DTensors or whose forward is driven by a
pipeline schedule, so replicas average their gradients here, once per step, with one
flat all-reduce per dtype (:class:`GradientSync`). Tensor-parallel shards are averaged
shard by shard (every replica holds the same shard layout). With ZeRO the replicas are
FSDP2's data-parallel dimension instead (:mod:`hybridtrain.parallel.zero`): it
reduce-scatters gradients in backward, so :class:`GradientSync` only sums tied
end-stage gradients.

Gradient norm (clipping) over a split model::

    ‖g‖² = Σ_pp-stages Σ_{parameters} Σ_{ranks of the mesh dims it is sharded over} ‖local part‖²

(a parameter may be sharded over tp, over dp (ZeRO), over both, or over neither);
replicated parameters (norms, embeddings outside TP) are counted once per stage, and a
tied parameter held by the first and the last stage only on the first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_map_only

from hybridtrain.parallel.mesh import Topology
from hybridtrain.parallel.runtime import ParallelRuntime
from hybridtrain.parallel.tensor import qkv_from_user, qkv_to_user


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a (D)Tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class GradientSync:
    """Averages gradients over the data-parallel replicas (and sums tied end-stage
    gradients first when a pipeline holds a tied parameter on two stages).

    Args:
        model: the (split) model whose parameters' gradients are synchronised.
        topology: where this rank sits.
        tied: names of parameters held by the first and the last pipeline stage.
        tied_group: the process group of those two stages (None without tied parameters).
        reduce_replicas: average over the data-parallel replicas (False under ZeRO, whose
            FSDP2 units already reduce-scattered the gradients over them).
    """

    def __init__(self, model: nn.Module, topology: Topology, tied: list[str] | None = None,
                 tied_group: dist.ProcessGroup | None = None, reduce_replicas: bool = True) -> None:
        self.model = model
        self.topology = topology
        self.tied = tied or []
        self.tied_group = tied_group
        self.reduce_replicas = reduce_replicas

    def sync(self) -> None:
        """Sum tied gradients across the end stages, then average over replicas."""
        if self.tied_group is not None:
            tied = [self.model.get_parameter(name) for name in self.tied]
            for param in tied:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            _all_reduce([local(p.grad) for p in tied if p.grad is not None], self.tied_group, 1)
        if self.topology.dp > 1 and self.reduce_replicas:
            grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
            _all_reduce(grads, self.topology.group("dp"), self.topology.dp)

    # The engine's backward observer protocol (tensor parallel without a pipeline).
    def before_backward(self, final: bool, loss: torch.Tensor) -> None:
        """Nothing to do before backward."""

    def after_backward(self, final: bool) -> None:
        """After the step's last micro-batch, synchronise the accumulated gradients."""
        if final:
            self.sync()


def _split_dims(tensor: torch.Tensor) -> set[str]:
    """Names of the mesh dims a DTensor is split over (``_StridedShard`` included, which is
    what FSDP2 uses for dp on top of a tensor-parallel ``Shard`` of the same dim)."""
    if not isinstance(tensor, DTensor):
        return set()
    names = tensor.device_mesh.mesh_dim_names or ()
    return {names[i] for i, p in enumerate(tensor.placements) if not (p.is_replicate() or p.is_partial())}


def _all_reduce(tensors: list[torch.Tensor], group: dist.ProcessGroup | None, divide: int) -> None:
    # One flat buffer per dtype: a handful of collectives instead of one per parameter.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        if divide > 1:
            flat /= divide
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


class SplitRuntime(ParallelRuntime):
    """Runtime of a tensor- and/or pipeline-parallel model.

    Args:
        model: the user's model (TP-sharded; hollowed by the pipeline once it is split;
            ZeRO-sharded over dp when ``zero_stage > 0``).
        topology: where this rank sits.
        zero_stage: the ZeRO stage sharding the data-parallel dimension (0 = replicas).

    Attributes:
        owner: ``owner(name) -> pipeline rank`` holding the true value of a state-dict
            entry (set by the pipeline at its split; rank 0 without a pipeline).
        counted: ``counted(name)``: whether this rank counts a parameter in the gradient
            norm (False for another stage's entry or the second copy of a tied one).
        reordered: entries stored in tensor parallel's interleaved fused-qkv row order.
    """

    def __init__(self, model: nn.Module, topology: Topology, zero_stage: int = 0) -> None:
        super().__init__(model, topology)
        self.zero_stage = zero_stage
        self.owner: Any = lambda name: 0
        self.counted: Any = lambda name: True
        self.reordered: set[str] = set()
        # A ZeRO pipeline replaces its parameters at the split (first step): an optimizer
        # state loaded before that waits here, keyed by name, until the split applies it.
        self._pending_optimizer: tuple[torch.optim.Optimizer, dict[str, Any]] | None = None

    def set_grad_sync(self, sync: bool) -> None:
        """ZeRO-1 without a pipeline reduce-scatters on the last micro-batch only (see
        :mod:`hybridtrain.parallel.zero`); otherwise gradients are synchronised in backward
        (ZeRO 2/3) or by :class:`GradientSync` after the last micro-batch."""
        if self.zero_stage == 1 and self.pipeline is None:
            self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]

    def clip_grad_norm(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole (unsplit) model's gradient, as one process would."""
        # Squares bucketed by the mesh dims their parameter is split over: (none, dp, tp, dp+tp).
        squares = torch.zeros(4, dtype=torch.float64)
        grads = []
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            grads.append(local(param.grad))
            if self.counted(name):
                split = _split_dims(param.grad)
                square = local(param.grad).detach().double().pow(2).sum().cpu()
                squares[("dp" in split) + 2 * ("tp" in split)] += square
        for dim, buckets in (("dp", [1, 3]), ("tp", [2, 3])):
            if getattr(self.topology, dim) > 1:
                part = squares[buckets].clone()
                dist.all_reduce(part, group=self.topology.group(dim))
                squares[buckets] = part
        total = squares.sum()
        if self.topology.pp > 1:
            dist.all_reduce(total, group=self.topology.group("pp"))
        norm = total.sqrt().float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coef.to(grad.device))
        return norm

    def _local_state(self) -> dict[str, torch.Tensor]:
        # Every TP peer takes part in each gather; only the owning stage keeps the entry.
        mine = {}
        for name, value in self.model.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if name in self.reordered:
                full = qkv_to_user(full, self.topology.tp)
            if self.owner(name) == self.topology.pp_rank:
                mine[name] = full.detach().to("cpu", copy=True)
        return mine

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state on every rank (TP shards gathered, pipeline stages merged)."""
        mine = self._local_state()
        if self.topology.pp == 1:
            return mine
        parts: list[Any] = [None] * self.topology.pp
        dist.all_gather_object(parts, mine, group=self.topology.group("pp"))
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return merged

    def model_state_shapes(self) -> dict[str, torch.Size]:
        """Full shapes of the entries this rank holds (TP shapes are the unsharded ones)."""
        return {k: v.shape for k, v in self.model.state_dict().items()}

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict: each rank copies in the entries (shards) it holds."""
        with torch.no_grad():
            for name, value in self.model.state_dict().items():
                full = state[name].to(local(value).device)
                if name in self.reordered:
                    full = qkv_from_user(full, self.topology.tp)
                if isinstance(value, DTensor):
                    full = distribute_tensor(full, value.device_mesh, value.placements).to_local()
                local(value).copy_(full)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The whole model's optimizer state keyed by parameter name: TP shards gathered,
        and every pipeline stage's entries merged (each stage only holds its own)."""
        # cpu_offload=True would keep the result on global rank 0 only, which holds just
        # the first stage: every rank gathers its stage's full state instead.
        options = StateDictOptions(full_state_dict=True, cpu_offload=self.topology.pp == 1)
        state = get_optimizer_state_dict(self.model, optimizer, options=options)
        if self.topology.pp == 1:
            return state
        state = tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), state)
        owned = {n: v for n, v in state["state"].items() if self.owner(n) == self.topology.pp_rank}
        parts: list[Any] = [None] * self.topology.pp
        dist.all_gather_object(parts, (owned, state["param_groups"]), group=self.topology.group("pp"))
        merged_groups = [{**group, "params": []} for group in state["param_groups"]]
        merged_state: dict[str, Any] = {}
        for part_state, part_groups in parts:
            merged_state.update(part_state)
            for target, group in zip(merged_groups, part_groups, strict=True):
                target["params"] += [n for n in group["params"] if n not in target["params"]]
        return {"state": merged_state, "param_groups": merged_groups}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Restore :meth:`optimizer_state_dict`'s result: each stage takes the entries of
        the parameters it holds (TP shards re-sharded)."""
        if self.zero_stage and self.pipeline is not None and not self.pipeline.is_split:
            self._pending_optimizer = (optimizer, state)
            return
        if self.topology.pp > 1:
            held = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
            state = {"state": {n: v for n, v in state["state"].items() if n in held},
                     "param_groups": [{**g, "params": [n for n in g["params"] if n in held]}
                                      for g in state["param_groups"]]}
        set_optimizer_state_dict(self.model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def load_pending_optimizer_state(self) -> None:
        """Apply an optimizer state loaded before a ZeRO pipeline's split (see
        :meth:`load_optimizer_state_dict`); called by the pipeline once it is split."""
        if self._pending_optimizer is not None:
            optimizer, state = self._pending_optimizer
            self._pending_optimizer = None
            self.load_optimizer_state_dict(optimizer, state)
