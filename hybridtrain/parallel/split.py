"""The :class:`~hybridtrain.parallel.runtime.ParallelRuntime` of a model split across ranks
(tensor and/or pipeline parallel), with data parallel over its replicas: plain replicas
averaged by :class:`~hybridtrain.parallel.gradient_sync.GradientSync`, or ZeRO (FSDP2
over the data-parallel dimension, :mod:`hybridtrain.parallel.zero`), which reduce-scatters
gradients in backward itself.

Gradient norm (clipping) over a split model::

    ‖g‖² = Σ_pp-stages Σ_{parameters} Σ_{ranks of the mesh dims it is sharded over} ‖local part‖²

(a parameter may be sharded over tp, over dp (ZeRO), over both, or over neither);
replicated parameters (norms, embeddings outside TP) are counted once per stage, and a
parameter several stages use only on the stage that owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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

from hybridtrain.compat import tree_map_only
from hybridtrain.parallel.gradient_sync import full_tensor, local
from hybridtrain.parallel.mesh import Topology
from hybridtrain.parallel.replicated import ReplicatedRuntime, collective_device
from hybridtrain.parallel.tensor import qkv_from_user, qkv_to_user
from hybridtrain.parallel.zero import set_fsdp_grad_sync


def _split_dims(tensor: torch.Tensor) -> set[str]:
    """Names of the mesh dims a DTensor is split over (``_StridedShard`` included, which is
    what FSDP2 uses for dp on top of a tensor-parallel ``Shard`` of the same dim)."""
    if not isinstance(tensor, DTensor):
        return set()
    names = tensor.device_mesh.mesh_dim_names or ()
    return {names[i] for i, p in enumerate(tensor.placements) if not (p.is_replicate() or p.is_partial())}


class SplitRuntime(ReplicatedRuntime):
    """Runtime of a tensor- and/or pipeline-parallel model.

    Args:
        model: the user's model (TP-sharded; hollowed by the pipeline split; ZeRO-sharded
            over dp when ``zero_stage > 0``).
        topology: where this rank sits.
        zero_stage: the ZeRO stage sharding the data-parallel dimension (0 = replicas).
        owner: ``owner(name) -> pipeline rank`` holding the true value of a state-dict
            entry (rank 0 without a pipeline).
        counted: ``counted(name)``: whether this rank counts a parameter in the gradient
            norm (False for another stage's entry or a non-owner's copy of a shared one).
        qkv_interleaved: entries stored in tensor parallel's interleaved fused-qkv row order.
        pipelined: a pipeline split the model (its schedule synchronises gradients).
    """

    def __init__(self, model: nn.Module, topology: Topology, zero_stage: int = 0,
                 owner: Callable[[str], int] = lambda name: 0,
                 counted: Callable[[str], bool] = lambda name: True,
                 qkv_interleaved: frozenset[str] = frozenset(), pipelined: bool = False) -> None:
        super().__init__(model, topology)
        self.zero_stage = zero_stage
        self.owner = owner
        self.counted = counted
        self.qkv_interleaved = qkv_interleaved
        self.pipelined = pipelined

    def set_grad_sync(self, sync: bool) -> None:
        """ZeRO-1 without a pipeline reduce-scatters on the last micro-batch only (see
        :mod:`hybridtrain.parallel.zero`); otherwise gradients are synchronised in backward
        (ZeRO 2/3) or by :class:`GradientSync` after the last micro-batch."""
        if self.zero_stage == 1 and not self.pipelined:
            set_fsdp_grad_sync(self.model, sync)

    def clip_grad_norm(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole (unsplit) model's gradient, as one process would."""
        # Squares bucketed by the mesh dims their parameter is split over: (none, dp, tp, dp+tp).
        device = collective_device()
        squares = torch.zeros(4, dtype=torch.float64, device=device)
        grads = []
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            grads.append(local(param.grad))
            if self.counted(name):
                split = _split_dims(param.grad)
                square = local(param.grad).detach().double().pow(2).sum().to(device)
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
            full = full_tensor(value)
            if name in self.qkv_interleaved:
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
        """Full shapes of every entry of the whole model (TP shapes are the unsharded ones;
        a pipeline's stages are merged: a collective over the pipeline ranks)."""
        mine = {k: v.shape for k, v in self.model.state_dict().items() if self.owner(k) == self.topology.pp_rank}
        if self.topology.pp == 1:
            return mine
        parts: list[Any] = [None] * self.topology.pp
        dist.all_gather_object(parts, mine, group=self.topology.group("pp"))
        return {k: v for part in parts for k, v in part.items()}

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict: each rank copies in the entries (shards) it holds."""
        with torch.no_grad():
            for name, value in self.model.state_dict().items():
                full = state[name].to(local(value).device)
                if name in self.qkv_interleaved:
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
        if self.topology.pp > 1:
            held = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
            state = {"state": {n: v for n, v in state["state"].items() if n in held},
                     "param_groups": [{**g, "params": [n for n in g["params"] if n in held]}
                                      for g in state["param_groups"]]}
        set_optimizer_state_dict(self.model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def owns(self, name: str) -> bool:
        """The pipeline stage that holds the true value of ``name`` saves it."""
        return self.owner(name) == self.topology.pp_rank

    def row_interleave(self, name: str) -> int:
        """Fused-qkv entries are interleaved per tensor-parallel rank (see :mod:`tensor`)."""
        return self.topology.tp if name in self.qkv_interleaved else 1

    def from_user_layout(self, name: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A whole entry in the user's ``[Q; K; V]`` order, interleaved if ``name`` is a fused
        qkv entry, and sharded as ``like``."""
        if name in self.qkv_interleaved:
            full = qkv_from_user(full, self.topology.tp)
        return super().from_user_layout(name, full, like)
