"""The decision of how to train a model, as a frozen value.

A :class:`TrainingPlan` says everything :func:`hybridtrain.plan.build` will do — sizes,
blocks and what happens to each, who runs a step, where the optimizer lives, precision —
without having done any of it. :func:`hybridtrain.plan.resolve` makes one (and raises every
``ConfigError``); the planner compares candidates; ``hybridtrain config --plan`` prints one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from hybridtrain.config import BatchSizes, Config
from hybridtrain.parallel.pipeline_plan import PipelinePlan
from hybridtrain.runtime.precision import precision_name

StepRunnerKind = Literal["micro_batches", "layer_major", "pipeline"]
OptimizerPlacement = Literal["device", "host", "host_streamed"]
Replication = Literal["none", "ddp", "zero", "tensor_or_pipeline"]


@dataclass(frozen=True)
class ParallelSizes:
    """Data-, tensor- and pipeline-parallel sizes (their product is the world size)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        """Number of processes."""
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class BlockPlan:
    """What happens to one block.

    Attributes:
        name: its dotted module path.
        checkpoint: its activations are recomputed in backward (only its inputs kept).
        swap: its saved activations (its inputs, when checkpointed) go to host memory.
        stream: its weights live in host memory and pass through the device (L2L).
        stage: its pipeline stage (None without a pipeline, or before a partition by time
            is measured at build).
    """

    name: str
    checkpoint: bool = False
    swap: bool = False
    stream: bool = False
    stage: int | None = None


@dataclass(frozen=True)
class OptimizerPlan:
    """Where the optimizer step runs.

    Attributes:
        placement: ``device``; ``host`` (ZeRO-Offload: fp32 masters and the step in host
            memory); ``host_streamed`` (layer streaming: every streamed block is a bucket).
        host_ratio: share of the parameters updated on the host (below 1: twin-flow, the
            rest on the device).
        defer_step: the host step waits until every gradient has landed (clipping, fp16,
            ``nonfinite_loss: skip``), instead of running as each bucket lands.
        grads_wait_on_host: gradients wait in host memory (summed there, or deferred).
        grads_wait_on_device: gradients that must wait (summed, or deferred) wait on the
            device instead, then stream through pooled host buffers (12 bytes per AdamW
            parameter on the host; the device holds the waiting gradients).
        pin_memory: host buffers page-locked.
        bucket_size: elements per gradient bucket (optimizer offload).
        device_share_first: Twin-Flow's device share is the first parameters, not the
            last (``offload_optimizer.device_share``).
    """

    placement: OptimizerPlacement = "device"
    host_ratio: float = 0.0
    defer_step: bool = False
    grads_wait_on_host: bool = False
    grads_wait_on_device: bool = False
    pin_memory: bool = False
    bucket_size: int = 0
    device_share_first: bool = False


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer :func:`hybridtrain.plan.build` makes (unless the caller gave one) and
    how it starts.

    Attributes:
        type: ``optimizer.type``.
        params: its keyword arguments (``optimizer.params`` without
            ``fp16_init_step``, which is no optimizer argument).
        fp16_init_step: step it once with zero gradients before training, before the LR
            schedule is built (:mod:`hybridtrain.optim.deepspeed.init_step`), where the
            config's ``optimizer.params.fp16_init_step`` is true: a user's, or the one the
            DeepSpeed drop-in writes where DeepSpeed's fp16 wrapper would take the step.
    """

    type: str = "AdamW"
    params: tuple[tuple[str, Any], ...] = ()
    fp16_init_step: bool = False


@dataclass(frozen=True)
class SchedulerSettings:
    """The learning-rate schedule build makes (``scheduler.type`` and ``scheduler.params``)."""

    type: str
    params: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class LossScaling:
    """fp16 loss scaling (DeepSpeed's ``fp16`` section).

    Attributes:
        static_scale: a fixed scale, or 0 for dynamic scaling.
        initial_scale_power: dynamic scaling starts at 2**initial_scale_power.
        window: good steps before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
        min_scale: the scale never drops below this.
    """

    static_scale: float = 0.0
    initial_scale_power: int = 16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0


@dataclass(frozen=True)
class SwapSettings:
    """How swapped activations move (``activation_offload``).

    Attributes:
        prefetch_blocks: blocks whose activations are brought back ahead of backward.
        pin_memory: host buffers page-locked.
        min_bytes: saved tensors smaller than this stay on the device.
    """

    prefetch_blocks: int = 1
    pin_memory: bool = True
    min_bytes: int = 1024


@dataclass(frozen=True)
class DataParallelSettings:
    """DDP's gradient communication (``data_parallel``): compression (``none``, ``fp16``,
    ``bf16``, ``powersgd``), PowerSGD's rank and first compressed step, bucket size in MB."""

    gradient_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2
    bucket_cap_mb: float = 25.0


@dataclass(frozen=True)
class StepRules:
    """What the engine does around each optimizer step.

    Attributes:
        gradient_clipping: max global gradient norm (0 = off).
        nonfinite_loss: ``error`` or ``skip`` the step on a non-finite loss.
        wall_clock_breakdown: time each step's parts.
    """

    gradient_clipping: float = 0.0
    nonfinite_loss: str = "error"
    wall_clock_breakdown: bool = False


@dataclass(frozen=True)
class TrainingPlan:
    """How :func:`hybridtrain.plan.build` will train a model (see the module docstring).

    Attributes:
        config: the validated configuration the plan was resolved from (for the callers
            of the one road: trainer, planner, memory guard); build reads the decided
            fields below, never the config.
        sizes: named parallel sizes.
        batch: the batch arithmetic.
        device: this process's compute device.
        compute_dtype: autocast dtype (None = fp32).
        block_lists: dotted paths of the block containers, in execution order.
        blocks: every block and what happens to it.
        checkpoint_modules: paths of every module activation checkpointing wraps (the
            checkpointed blocks, or modules chosen by ``module_classes``).
        swap_modules: paths of every module whose saved activations are swapped (its
            inputs only, when it is also checkpointed).
        step_runner: who runs a step's forwards and backwards.
        replication: how data-parallel replicas keep in step: ``none`` (one replica),
            ``ddp``, ``zero`` (FSDP2 sharding) or ``tensor_or_pipeline`` (a model split
            across ranks by tensor and/or pipeline parallel, whose replicas average
            gradients after backward, or shard under ZeRO).
        zero_stage: the ZeRO stage in effect (0 on one replica).
        tensor_plan: module path → ``colwise``/``rowwise`` (tensor parallel).
        device_map: module path → device (naive model parallel inside one process).
        pipeline: the pipeline split, or None.
        optimizer: where the optimizer step runs.
        optimizer_settings: the optimizer build makes and how it starts.
        scheduler: the learning-rate schedule build makes, or None.
        loss_scaler: fp16 loss scaling, or None (no fp16).
        swap: how swapped activations move (read where ``swap_modules`` is not empty).
        stream_prefetch_blocks: streamed blocks fetched ahead of the one computing.
        stream_images_per_upload: half-width images cast into pooled host buffers at every
            upload instead of kept per block.
        stream_keep_blocks: how many streamed blocks (the last ones) keep their device copy
            from forward to backward (``-1`` resolved to the number streamed; 0 without
            streaming).
        step_rules: clipping, non-finite losses, step timing.
        collective_timeout_s: how long a collective waits for a silent rank.
        data_parallel: DDP's gradient communication (``replication == "ddp"``).
        zero_offload: ZeRO across processes with FSDP2's CPU offload (shards and the
            optimizer step in host memory).
        state_by_name: checkpoints key the optimizer state by parameter name (the config
            asks for ZeRO, whatever the world size), else by index.
    """

    config: Config
    sizes: ParallelSizes
    batch: BatchSizes
    device: torch.device
    compute_dtype: torch.dtype | None
    block_lists: tuple[str, ...]
    blocks: tuple[BlockPlan, ...]
    checkpoint_modules: tuple[str, ...]
    swap_modules: tuple[str, ...]
    step_runner: StepRunnerKind
    replication: Replication
    zero_stage: int
    tensor_plan: tuple[tuple[str, str], ...]
    device_map: tuple[tuple[str, torch.device], ...]
    pipeline: PipelinePlan | None
    optimizer: OptimizerPlan
    optimizer_settings: OptimizerSettings
    scheduler: SchedulerSettings | None
    loss_scaler: LossScaling | None
    swap: SwapSettings
    stream_prefetch_blocks: int
    stream_keep_blocks: int
    stream_images_per_upload: bool
    step_rules: StepRules
    collective_timeout_s: float
    data_parallel: DataParallelSettings
    zero_offload: bool
    state_by_name: bool

    @property
    def loss_scaling(self) -> bool:
        """Whether fp16 loss scaling is on."""
        return self.loss_scaler is not None

    @property
    def autocast_cache(self) -> bool:
        """Whether autocast keeps its weight-cast cache (torch's default: a weight read twice
        in one forward shares one half copy, as in a plain loop): where nothing is
        checkpointed, swapped, streamed, split by tensor or pipeline parallel, so the saved
        tensors hold every cast copy anyway (:func:`hybridtrain.runtime.precision.scaling.autocast`)."""
        return not (self.checkpoint_modules or self.swap_modules or any(b.stream for b in self.blocks)
                    or self.tensor_plan or self.pipeline is not None or self.step_runner != "micro_batches")

    def blocks_where(self, flag: str) -> list[str]:
        """Names of the blocks whose ``flag`` (``checkpoint``/``swap``/``stream``) is set."""
        return [b.name for b in self.blocks if getattr(b, flag)]

    def summary(self) -> dict[str, object]:
        """The decisions as plain values (what ``hybridtrain config --plan`` prints)."""
        dtype = precision_name(self.compute_dtype)
        out: dict[str, object] = {
            "world": {"dp": self.sizes.dp, "tp": self.sizes.tp, "pp": self.sizes.pp},
            "batch": {"global": self.batch.global_batch, "micro": self.batch.micro_batch,
                      "accumulation": self.batch.accumulation_steps},
            "device": str(self.device),
            "precision": dtype + (" + loss scaling" if self.loss_scaling else ""),
            "block_lists": list(self.block_lists),
            "blocks": len(self.blocks),
            "checkpointed": _ranges(self, "checkpoint"),
            "swapped": _ranges(self, "swap"),
            "streamed": _ranges(self, "stream"),
            "step_runner": self.step_runner,
            "replication": self.replication,
            "zero_stage": self.zero_stage,
            "optimizer": {f.name: getattr(self.optimizer, f.name) for f in fields(self.optimizer)},
        }
        if self.tensor_plan:
            out["tensor_parallel"] = dict(self.tensor_plan)
        if self.stream_keep_blocks:
            out["kept_for_backward"] = self.stream_keep_blocks
        if self.device_map:
            out["device_map"] = {k: str(v) for k, v in self.device_map}
        if self.pipeline is not None:
            p = self.pipeline
            out["pipeline"] = {"schedule": p.schedule, "micro_batches": p.micro_batches,
                               "virtual_stages": p.virtual_stages,
                               "partition": list(p.partition) if isinstance(p.partition, tuple) else p.partition,
                               "blocks_per_stage": list(p.counts) if p.counts else "measured at build"}
        return out

    def differences(self, other: TrainingPlan) -> dict[str, tuple[object, object]]:
        """Decisions that differ from ``other``: key → (this plan's, the other's)."""
        mine, theirs = self.summary(), other.summary()
        return {k: (mine.get(k), theirs.get(k)) for k in sorted(set(mine) | set(theirs))
                if mine.get(k) != theirs.get(k)}


def _ranges(plan: TrainingPlan, flag: str) -> str:
    """``"all"``, ``"none"`` or the block indices with ``flag`` set, e.g. ``"0-3, 6"``."""
    chosen = [i for i, b in enumerate(plan.blocks) if getattr(b, flag)]
    if not chosen:
        return "none"
    if len(chosen) == len(plan.blocks):
        return "all"
    runs: list[str] = []
    start = prev = chosen[0]
    for i in [*chosen[1:], -2]:
        if i != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = i
        prev = i
    return ", ".join(runs)
