"""Pipeline parallel on ``torch.distributed.pipelining``: the model is split into stages at
build (:func:`split_pipeline`) and a :class:`PipelineRunner` runs each step's
micro-batches through torch's public schedule API.

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

Parameters outside the blocks live on every rank, but only the stages whose code uses
them (found by the traced forward of :mod:`hybridtrain.models.usage`: embeddings before
the blocks → first stage; final norm and head after them → last stage; a tied head, even
one written as ``h @ self.emb.weight.T`` in ``forward`` → both) train them; a parameter
used by stages on several ranks has its gradient summed over those ranks after backward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
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

from hybridtrain.config.schema import MULTI_STAGE_SCHEDULES
from hybridtrain.models.blocks import BlockList
from hybridtrain.models.usage import POST, PRE, ModelUsage, first_names
from hybridtrain.parallel.gradient_sync import GradientSync
from hybridtrain.parallel.mesh import Topology
from hybridtrain.parallel.partition import choose_partition, stage_bounds, time_blocks
from hybridtrain.parallel.pipeline_plan import PipelinePlan
from hybridtrain.parallel.pipeline_stage import PassThroughBlock, StageModule, StageRouter
from hybridtrain.runtime.batch import (
    Batch,
    LossFn,
    batch_size,
    compute_loss,
    run_model,
    split_batch,
    to_device,
)
from hybridtrain.runtime.precision import autocast
from hybridtrain.runtime.step_runner import StepContext

log = logging.getLogger("hybridtrain")

SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}


@dataclass(frozen=True)
class StageLayout:
    """Which stage holds which blocks and which stages use each parameter outside them.

    Attributes:
        bounds: ``(start, stop)`` block range of every stage, in pipeline order.
        users: name of each parameter outside the blocks → the stages whose code uses it
            (a parameter the forward never used: the first stage).
        blocks_prefix: ``"<blocks path>."`` (block parameters are named under it).
        aliases: second names of shared parameters → their first name (BERT's
            ``cls.predictions.decoder.bias`` is ``cls.predictions.bias``).
    """

    bounds: tuple[tuple[int, int], ...]
    users: dict[str, frozenset[int]]
    blocks_prefix: str
    aliases: dict[str, str]

    @classmethod
    def decide(cls, counts: Sequence[int], usage: ModelUsage, blocks_path: str,
               outside: Sequence[str], aliases: dict[str, str]) -> StageLayout:
        """The layout of ``counts`` blocks per stage (``outside``: first names of the
        parameters outside the blocks; ``aliases``: other name → first name)."""
        bounds = stage_bounds(counts)
        stage_of = {i: s for s, (a, b) in enumerate(bounds) for i in range(a, b)}
        last = len(bounds) - 1
        users: dict[str, frozenset[int]] = {}
        for name in outside:
            stages = set()
            for place in usage.places.get(name, frozenset()):
                kind, _, index = place.partition(":")
                stages.add(0 if kind == PRE else last if kind == POST else stage_of[int(index)])
            users[name] = frozenset(stages or {0})
        return cls(tuple(bounds), users, f"{blocks_path}." if blocks_path else "", aliases)

    def stage_of_entry(self, name: str) -> int:
        """The stage that holds the true value of a state entry (the first user)."""
        name = self.aliases.get(name, name)
        if name.startswith(self.blocks_prefix):
            head = name[len(self.blocks_prefix):].split(".", 1)[0]
            if head.isdigit():
                block = int(head)
                return next(s for s, (a, b) in enumerate(self.bounds) if a <= block < b)
        return min(self.users.get(name, frozenset({0})))

    def shared_rank_sets(self, pp: int) -> dict[frozenset[int], list[str]]:
        """Pipeline-rank sets (of two or more ranks) → the parameters they share."""
        sets: dict[frozenset[int], list[str]] = {}
        for name, stages in sorted(self.users.items()):
            ranks = frozenset(s % pp for s in stages)
            if len(ranks) > 1:
                sets.setdefault(ranks, []).append(name)
        return sets


@dataclass
class PipelineSplit:
    """The model after :func:`split_pipeline`: this rank's stages and the ownership rules
    the split runtime needs for norms and state dicts."""

    model: nn.Module
    layout: StageLayout
    stages: list[StageModule]
    owner: Callable[[str], int]
    counted: Callable[[str], bool]
    sync: GradientSync


def split_pipeline(model: nn.Module, blocks: BlockList, settings: PipelinePlan, topology: Topology,
                   example: Batch, loss_fn: LossFn | None, device: torch.device,
                   compute_dtype: torch.dtype | None,
                   shard: Callable[[nn.Module, list[nn.Module]], None] | None) -> PipelineSplit:
    """Split ``model`` into this rank's stages: measure the partition if it is by time,
    hollow out other ranks' blocks, shard what is left (ZeRO), and build the stages.

    Args:
        example: a batch on ``device`` (timed for ``partition: time``).
        shard: ``shard(model, kept_blocks)`` applies ZeRO to this rank's part (or None).
    """
    pp = topology.pp
    num_stages = pp * settings.virtual_stages
    counts = settings.counts or _counts_by_time(model, blocks, num_stages, topology, example,
                                                loss_fn, device, compute_dtype)
    block_params = {id(p) for b in blocks for p in b.parameters()}
    first = first_names(model)
    outside = [n for n, p in model.named_parameters() if id(p) not in block_params]
    aliases = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if n != first[id(p)]}
    layout = StageLayout.decide(counts, settings.usage, settings.blocks_path, outside, aliases)
    local = [s for s in range(num_stages) if s % pp == topology.pp_rank]
    if topology.rank == 0:
        print(f"pipeline: {num_stages} stages ({settings.schedule}), blocks per stage {list(counts)} "
              f"(partition by {settings.partition if isinstance(settings.partition, str) else 'config'})",
              flush=True)
    router = StageRouter(blocks, list(layout.bounds), local, settings.usage.tuple_output)
    # Other ranks' blocks are hollow now: only this rank's stage (and what lives outside the
    # blocks) goes to the device (a no-op where the whole model was placed to be timed).
    model.to(device)
    if shard is not None:  # after hollowing: only this rank's blocks become units
        shard(model, [b for b in blocks if not isinstance(b, PassThroughBlock)])
    router.install_exits(blocks)
    stages = [StageModule(model, router, s, _owned(model, blocks, layout, s), loss_fn,
                          1.0 / settings.micro_batches) for s in local]
    shared = layout.shared_rank_sets(pp)
    _agree(topology, sorted((sorted(ranks), names) for ranks, names in shared.items()))
    # Sorted, so that every rank creates the groups in the same order (new_group is collective).
    groups = [(names, _rank_set_group(topology, ranks)) for ranks, names in sorted(shared.items(), key=_ranks)]
    sync = GradientSync(model, topology, groups, reduce_replicas=shard is None)

    def owner(name: str) -> int:
        return layout.stage_of_entry(name) % pp

    def counted(name: str) -> bool:
        return owner(name) == topology.pp_rank
    return PipelineSplit(model, layout, stages, owner, counted, sync)


def _counts_by_time(model: nn.Module, blocks: BlockList, num_stages: int, topology: Topology, example: Batch,
                    loss_fn: LossFn | None, device: torch.device, compute_dtype: torch.dtype | None) -> tuple[int, ...]:
    def one_loss() -> torch.Tensor:
        with autocast(device, compute_dtype):
            return compute_loss(run_model(model, example), example, loss_fn).float()
    params = [float(sum(p.numel() for p in b.parameters())) for b in blocks]
    # Timing runs the whole model on this rank: only where it fits, decided by all ranks
    # together (on the device: NCCL reduces device tensors only).
    fits = torch.tensor([1.0 if _whole_model_fits(model, device) else 0.0], device=device)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if not fits.item():
        if topology.rank == 0:
            log.warning("pipeline.partition: time needs the whole model on one device, which does not fit on "
                        "every rank; partitioning by parameters instead")
        return tuple(choose_partition("params", num_stages, params, None))
    times = torch.tensor(time_blocks(model, list(blocks), one_loss), dtype=torch.float64, device=device)
    dist.all_reduce(times)  # every rank must choose the same split
    return tuple(choose_partition("time", num_stages, params, (times / topology.world_size).tolist()))


def _whole_model_fits(model: nn.Module, device: torch.device) -> bool:
    """Whether a forward and backward of the whole model can run here: its parameters are
    materialized on ``device`` and (on CUDA) the free memory holds their gradients twice
    over (gradients and activations, a rough bound)."""
    params = list(model.parameters())
    if any(p.device != device for p in params):  # on meta, or elsewhere: nothing to time
        return False
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return 2 * sum(p.numel() * p.element_size() for p in params) <= free


def _agree(topology: Topology, shared: list[Any]) -> None:
    """Every rank must create the same process groups: a forward whose control flow depends
    on the data could make ranks trace different uses of a shared parameter.

    Raises:
        RuntimeError: the ranks disagree (naming what this rank found).
    """
    parts: list[Any] = [None] * topology.world_size
    dist.all_gather_object(parts, shared)
    if any(part != shared for part in parts):
        raise RuntimeError(f"pipeline: ranks traced different parameter uses across stages (rank "
                           f"{topology.rank}: {shared}); the example batch must be the same on every rank")


def _owned(model: nn.Module, blocks: BlockList, layout: StageLayout, stage: int) -> list[nn.Parameter]:
    start, stop = layout.bounds[stage]
    params = [p for i in range(start, stop) for p in blocks[i].parameters()]
    params += [model.get_parameter(n) for n, users in layout.users.items() if stage in users]
    return params


def _ranks(item: tuple[frozenset[int], list[str]]) -> list[int]:
    return sorted(item[0])


def _rank_set_group(topology: Topology, pp_ranks: frozenset[int]) -> dist.ProcessGroup | None:
    """The group of the given pipeline ranks at this rank's (dp, tp) coordinate. Every rank
    creates every such group (``new_group`` is collective) and keeps its own."""
    mine = None
    for dp_rank in range(topology.dp):
        for tp_rank in range(topology.tp):
            ranks = [pp * topology.dp * topology.tp + dp_rank * topology.tp + tp_rank for pp in sorted(pp_ranks)]
            group = dist.new_group(ranks)
            if topology.rank in ranks:
                mine = group
    return mine


class PipelineRunner:
    """Runs whole steps of a split model through torch's public schedule API; the engine's
    :class:`~hybridtrain.runtime.step_runner.StepRunner` under a pipeline.

    torch's stages are built for one micro-batch size (they exchange activations of static
    shape), so one stage set and schedule is made per micro-batch size seen (training and
    evaluation may differ); the split itself never changes.

    Args:
        split: the model's stages on this rank.
        settings: the pipeline settings.
        topology: where this rank sits.
        device / compute_dtype: as the engine's.
    """

    whole_steps_only = True

    def __init__(self, split: PipelineSplit, settings: PipelinePlan, topology: Topology,
                 device: torch.device, compute_dtype: torch.dtype | None) -> None:
        self.split = split
        self.settings = settings
        self.topology = topology
        self.device = device
        self.compute_dtype = compute_dtype
        self._schedules: dict[tuple[int, bool], Any] = {}
        self._scale = 1.0

    def forward_backward(self, micro_batches: Sequence[Batch], step: StepContext) -> torch.Tensor:
        """Forward and backward of every micro-batch through the schedule, then the
        gradient synchronisation (shared parameters, replicas). Timed as ``interleaved``.

        Returns:
            The step's mean loss on the last stage, 0 elsewhere.
        """
        with step.timed("interleaved"):
            self._scale = step.scale
            total = self._run(list(micro_batches), backward=True)
            self.split.sync.sync()
        return total

    def evaluate(self, batch: Batch) -> torch.Tensor:
        """Mean loss of ``batch`` (split into the step's micro-batch count), forward only;
        0 on stages before the last."""
        micro_batches = split_batch(batch, self.settings.micro_batches)
        model = self.split.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return self._run(micro_batches, backward=False)
        finally:
            model.train(was_training)

    def _run(self, micro_batches: list[Batch], backward: bool) -> torch.Tensor:
        micro_batches = [to_device(m, self.device) for m in micro_batches]
        schedule = self._schedule(batch_size(micro_batches[0]), backward)
        for stage in self.split.stages:
            stage.batches = micro_batches
            stage.losses.clear()
        # Each stage reads its micro-batch by index from the engine's own split.
        index = torch.arange(len(micro_batches))
        try:
            with autocast(self.device, self.compute_dtype):
                if backward:
                    schedule.step(index=index, target=index)
                else:
                    schedule.eval(index=index, target=index)
        finally:
            for stage in self.split.stages:
                stage.batches = []
        losses = [loss for stage in self.split.stages if stage.is_last for loss in stage.losses]
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).mean()

    def _schedule(self, micro: int, backward: bool) -> Any:
        # One per micro-batch size, and evaluation apart from training (a schedule set up
        # for forward only keeps no backward state).
        key = (micro, backward)
        if key not in self._schedules:
            layout, usage = self.split.layout, self.settings.usage
            group = self.topology.group("pp")
            num_stages = len(layout.bounds)
            stages = [PipelineStage(m, m.index, num_stages, self.device, group=group,
                                    **_metadata(m.index, layout, usage, micro, self.device))
                      for m in self.split.stages]
            cls = SCHEDULES[self.settings.schedule]
            target = stages if self.settings.schedule in MULTI_STAGE_SCHEDULES else stages[0]
            self._schedules[key] = cls(target, n_microbatches=self.settings.micro_batches,
                                         loss_fn=lambda out, _target: out.sum() * self._scale, scale_grads=False)
        return self._schedules[key]


def _metadata(index: int, layout: StageLayout, usage: ModelUsage, micro: int,
              device: torch.device) -> dict[str, Any]:
    """Static shapes of what a stage receives and sends (no shape-inference pass)."""
    def example(block: int) -> torch.Tensor:
        shape, dtype = usage.boundary[block]
        # requires_grad marks the activation as one whose gradient travels back.
        return torch.empty((micro, *shape), dtype=dtype, device=device, requires_grad=True)
    start, stop = layout.bounds[index]
    inputs = () if index == 0 else (example(start),)
    output = torch.empty((1,), device=device) if index == len(layout.bounds) - 1 else example(stop)
    return {"input_args": inputs, "output_args": output}

