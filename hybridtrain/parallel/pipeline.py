"""Pipeline parallel on ``torch.distributed.pipelining``: a :class:`PipelineRunner` the
engine hands each step's micro-batches to.

The schedules are torch's (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``); stages are built from
the block list (:mod:`hybridtrain.parallel.pipeline_stage`) and balanced by
:mod:`hybridtrain.parallel.partition`. With K stages and M micro-batches (F = forward,
B = backward of micro-batch n, ``.`` = idle)::

    gpipe (K=3, M=4): all forwards, then all backwards; M micro-batches in flight
      stage 0  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
      stage 1  .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .
      stage 2  .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .

    1f1b (K=3, M=4): after K-s warm-up forwards, alternate; at most K-s in flight
      stage 0  F0 F1 F2 .  .  B0 F3 .  B1 .  B2 .  B3
      stage 1  .  F0 F1 .  B0 F2 .  B1 F3 B2 .  B3 .
      stage 2  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  .

Both idle for the same bubble fraction (K-1)/(M+K-1); 1F1B keeps fewer activations.
``interleaved_1f1b`` gives each rank ``virtual_stages`` chunks (stage s on rank s mod K),
shrinking the bubble by that factor; ``zero_bubble`` also splits backward into input- and
weight-gradient halves and fills the bubble with the latter.

The split happens at the first step: it profiles one real micro-batch on the full model
(every rank, times averaged so all agree), prints the chosen partition, hollows out
other ranks' blocks, shards what is left over the data-parallel replicas when ZeRO is on
(each stage's blocks are FSDP2 units, the modules outside the blocks the root unit) and
drops other stages' parameters from the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from hybridtrain.parallel.mesh import Topology
from hybridtrain.parallel.partition import POST, PRE, BlockProfile, choose_partition, profile_blocks
from hybridtrain.parallel.pipeline_stage import HollowBlock, StageModule, StageRouter
from hybridtrain.parallel.split_runtime import GradientSync, SplitRuntime
from hybridtrain.runtime.batch import Batch, LossFn, compute_loss, run_model, split_batch, to_device
from hybridtrain.runtime.precision import autocast

SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class PipelineSpec:
    """The pipeline settings, resolved by :func:`hybridtrain.initialize`.

    Attributes:
        schedule: ``gpipe`` | ``1f1b`` | ``interleaved_1f1b`` | ``zero_bubble``.
        micro_batches: micro-batches per step.
        virtual_stages: stages per rank.
        partition: ``time`` | ``params`` | ``uniform`` | block counts per stage.
        blocks_path: dotted path of the block container in the model.
    """

    schedule: str
    micro_batches: int
    virtual_stages: int
    partition: str | list[int]
    blocks_path: str


class PipelineRunner:
    """Runs whole steps of a pipelined model (``train_step``) and pipelined evaluation.

    Args:
        model: the whole model (tensor-parallel already applied), on every rank.
        blocks: its block container.
        spec: pipeline settings.
        runtime: the split runtime (gets ownership rules once the model is split).
        optimizer_ref: called with the kept parameters to prune the optimizer at the split.
        loss_fn / device / compute_dtype: as the engine's.
        shard: ``shard(model, kept_blocks)`` applies ZeRO to this rank's part once the
            model is split (None without ZeRO).
    """

    def __init__(self, model: nn.Module, blocks: nn.ModuleList | nn.Sequential, spec: PipelineSpec,
                 runtime: SplitRuntime, loss_fn: LossFn | None, device: torch.device,
                 compute_dtype: torch.dtype | None,
                 shard: Callable[[nn.Module, list[nn.Module]], None] | None = None) -> None:
        self.model = model
        self.blocks = blocks
        self.spec = spec
        self.runtime = runtime
        self.topology: Topology = runtime.topology
        self.loss_fn = loss_fn
        self.device = device
        self.compute_dtype = compute_dtype
        self.shard = shard
        self.optimizer: torch.optim.Optimizer | None = None
        self.counts: list[int] = []
        self._stages: list[StageModule] = []
        self._schedule: Any = None
        self._sync: GradientSync | None = None
        self._scale = 1.0

    @property
    def is_split(self) -> bool:
        """Whether the first step has split the model."""
        return self._schedule is not None

    def train_step(self, micro_batches: list[Batch], scale: float) -> torch.Tensor:
        """Forward and backward of every micro-batch through the schedule, then the
        gradient synchronisation (tied end stages, replicas).

        Args:
            micro_batches: the step's micro-batches (this replica's share).
            scale: the fp16 loss scale (1.0 otherwise).

        Returns:
            The step's mean loss on the last stage, 0 elsewhere (``holds_loss`` decides).
        """
        micro_batches = [to_device(m, self.device) for m in micro_batches]
        if not self.is_split:
            self._split(micro_batches[0])
        self._scale = scale
        total = self._run(micro_batches, backward=True)
        assert self._sync is not None
        self._sync.sync()
        return total

    def eval_loss(self, batch: Batch) -> torch.Tensor:
        """Mean loss of ``batch`` (split into the step's micro-batch count), forward only;
        0 on stages before the last."""
        micro_batches = split_batch(to_device(batch, self.device), self.spec.micro_batches)
        if not self.is_split:
            self._split(micro_batches[0])
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self._run(micro_batches, backward=False)
        finally:
            self.model.train(was_training)

    def _run(self, micro_batches: list[Batch], backward: bool) -> torch.Tensor:
        schedule = self._schedule
        for stage in self._stages:
            stage.losses.clear()
        # Mirrors schedule.step()/eval(), which would re-split the batch we already split
        # (the micro-batches are nested structures the engine split its own way).
        for pipeline_stage in schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]:
            pipeline_stage.has_backward = backward
            pipeline_stage.clear_runtime_states()
        was = schedule._has_backward
        schedule._has_backward = backward
        try:
            with autocast(self.device, self.compute_dtype):
                schedule._step_microbatches(arg_mbs=None, kwarg_mbs=[{"batch": m} for m in micro_batches],
                                            target_mbs=[None] * len(micro_batches), losses=None,
                                            return_outputs=False)
        finally:
            schedule._has_backward = was
        losses = [loss for stage in self._stages if stage.is_last for loss in stage.losses]
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).mean()

    def _split(self, micro: Batch) -> None:
        """Profile, partition, hollow, build the torch stages and schedule."""
        spec, topo = self.spec, self.topology
        num_stages = topo.pp * spec.virtual_stages

        def one_loss() -> torch.Tensor:
            with autocast(self.device, self.compute_dtype):
                return compute_loss(run_model(self.model, micro), micro, self.loss_fn).float()

        # Sharding replaces parameters: the optimizer is re-pointed by name at the end.
        names = {id(p): n for n, p in self.model.named_parameters()}
        profile = profile_blocks(self.model, list(self.blocks), one_loss, timed=spec.partition == "time")
        times = torch.tensor(profile.times, dtype=torch.float64)
        dist.all_reduce(times)  # every rank must choose the same split
        profile.times = (times / topo.world_size).tolist()
        self.counts = choose_partition(spec.partition, num_stages, profile)
        bounds, start = [], 0
        for count in self.counts:
            bounds.append((start, start + count))
            start += count
        local = [s for s in range(num_stages) if s % topo.pp == topo.pp_rank]
        if topo.rank == 0:
            print(f"pipeline: {num_stages} stages ({spec.schedule}), blocks per stage {self.counts} "
                  f"(partition by {spec.partition if isinstance(spec.partition, str) else 'config'})",
                  flush=True)
        router = StageRouter(self.blocks, bounds, local, profile.tuple_output)
        if self.shard is not None:  # after hollowing: only this rank's blocks become units
            self.shard(self.model, [b for b in self.blocks if not isinstance(b, HollowBlock)])
        router.install_exits(self.blocks)
        tied = sorted(n for n, phases in profile.phases.items() if {PRE, POST} <= phases)
        self._own_rules(profile, bounds, tied)
        self._stages = [self._stage_module(s, router, bounds, profile, tied) for s in local]
        group = topo.group("pp")
        torch_stages = [PipelineStage(m, m.index, num_stages, self.device, group=group,
                                      **self._metadata(m.index, bounds, profile, len(self.counts)))
                        for m in self._stages]
        cls = SCHEDULES[spec.schedule]
        target = torch_stages if spec.schedule in MULTI_STAGE else torch_stages[0]
        self._schedule = cls(target, n_microbatches=spec.micro_batches,
                             loss_fn=lambda out, _target: out * self._scale, scale_grads=False)
        self._sync = GradientSync(self.model, topo, tied, _end_stage_group(topo) if tied else None,
                                  reduce_replicas=self.shard is None)
        self._prune_optimizer(names)
        self.runtime.load_pending_optimizer_state()

    def _stage_module(self, index: int, router: StageRouter, bounds: list[tuple[int, int]],
                      profile: BlockProfile, tied: list[str]) -> StageModule:
        start, stop = bounds[index]
        params = [p for i in range(start, stop) for p in self.blocks[i].parameters()]
        last = index == len(bounds) - 1
        for name, phases in profile.phases.items():
            if (index == 0 and (PRE in phases or not phases)) or (last and POST in phases):
                params.append(self.model.get_parameter(name))
        return StageModule(self.model, router, index, params, self.loss_fn, 1.0 / self.spec.micro_batches)

    def _metadata(self, index: int, bounds: list[tuple[int, int]], profile: BlockProfile,
                  num_stages: int) -> dict[str, Any]:
        """Static shapes of what a stage receives and sends (no shape-inference pass)."""
        def example(block: int) -> torch.Tensor:
            shape, dtype = profile.boundary_shapes[block]
            # requires_grad marks the activation as one whose gradient travels back.
            return torch.empty(shape, dtype=dtype, device=self.device, requires_grad=True)
        start, stop = bounds[index]
        inputs = () if index == 0 else (example(start),)
        output = torch.empty((), device=self.device) if index == num_stages - 1 else example(stop)
        return {"input_args": inputs, "output_args": output}

    def _own_rules(self, profile: BlockProfile, bounds: list[tuple[int, int]], tied: list[str]) -> None:
        """Tell the runtime which pipeline rank holds the true value of each state entry."""
        prefix = f"{self.spec.blocks_path}." if self.spec.blocks_path else ""
        stage_of_block = {i: s for s, (a, b) in enumerate(bounds) for i in range(a, b)}
        pp, last = self.topology.pp, len(bounds) - 1
        post_only = {n for n, phases in profile.phases.items() if phases == {POST}}

        def owner(name: str) -> int:
            if name.startswith(prefix):
                head = name[len(prefix):].split(".", 1)[0]
                if head.isdigit():
                    return stage_of_block[int(head)] % pp
            return last % pp if name in post_only else 0

        tied_set = set(tied)
        self.runtime.owner = owner
        self.runtime.counted = lambda name: (owner(name) == self.topology.pp_rank
                                             and (name not in tied_set or self.topology.pp_rank == 0))

    def _prune_optimizer(self, names: dict[int, str]) -> None:
        """Drop hollowed-out blocks' parameters from the optimizer (they live on other ranks)
        and point it at the sharded parameters under ZeRO (``names``: id → name before the
        split). The optimizer has not stepped yet; a state loaded from a checkpoint before
        the split is held back by the runtime and applied after this."""
        if self.optimizer is None:
            return
        kept = dict(self.model.named_parameters())
        for group in self.optimizer.param_groups:
            group["params"] = [kept[names[id(p)]] for p in group["params"] if names.get(id(p)) in kept]


def _end_stage_group(topo: Topology) -> dist.ProcessGroup | None:
    """The group {first stage, last stage} of this rank's (dp, tp) coordinate. Every rank
    creates every such group (``new_group`` is collective), keeps its own."""
    mine = None
    for dp_rank in range(topo.dp):
        for tp_rank in range(topo.tp):
            ranks = [pp * topo.dp * topo.tp + dp_rank * topo.tp + tp_rank for pp in (0, topo.pp - 1)]
            group = dist.new_group(ranks)
            if topo.rank in ranks:
                mine = group
    return mine
