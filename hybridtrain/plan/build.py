"""``build(plan, model) -> Engine``: apply a :class:`~hybridtrain.plan.types.TrainingPlan`.

Everything was decided and validated by :func:`~hybridtrain.plan.resolve.resolve`; this
module only changes things, in a fixed order (commented where it matters): the model is
placed, its blocks wrapped (checkpointing, swapping), processes joined and the model
replicated, sharded or split, then the optimizer is built over the final parameters and
the step runner and backward observers chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridtrain.checkpoint.sharded import checkpoint_group
from hybridtrain.engine import Engine, EngineOptions
from hybridtrain.optim import build_optimizer, build_scheduler, take_fp16_init_step
from hybridtrain.parallel import mesh
from hybridtrain.parallel.data import apply_data_parallel
from hybridtrain.parallel.gradient_sync import GradientSync
from hybridtrain.parallel.model_parallel import apply_device_map
from hybridtrain.parallel.pipeline import PipelineRunner, split_pipeline
from hybridtrain.parallel.replicated import ReplicatedRuntime
from hybridtrain.parallel.runtime import ParallelRuntime
from hybridtrain.parallel.split import SplitRuntime
from hybridtrain.parallel.tensor import apply_tensor_parallel
from hybridtrain.parallel.zero import ZeroRuntime, apply_zero
from hybridtrain.plan.types import TrainingPlan
from hybridtrain.runtime.activations import (
    apply_activation_checkpointing,
    apply_activation_offload,
    params_in_several_backwards,
)
from hybridtrain.runtime.batch import Batch, LossFn, to_device
from hybridtrain.runtime.offload import OffloadOptimizer, OffloadSteps
from hybridtrain.runtime.precision import LossScaler, half_width_params, precision_name
from hybridtrain.runtime.step_runner import BackwardObserver, StepRunner
from hybridtrain.runtime.streaming import LayerMajorRunner, LayerStreamer, place_for_streaming

Sharder = Callable[[nn.Module, list[nn.Module]], None]


def build(plan: TrainingPlan, model: nn.Module, loss_fn: LossFn | None = None,
          optimizer: torch.optim.Optimizer | None = None, example_batch: Batch | None = None) -> Engine:
    """Apply ``plan`` to ``model`` and return the engine that trains it.

    Args:
        plan: from :func:`~hybridtrain.plan.resolve.resolve` for this model.
        model: the model the plan was resolved for (changed in place).
        loss_fn / optimizer: as :func:`hybridtrain.initialize`.
        example_batch: the batch the plan was resolved with (a pipeline partitioned by
            time measures its blocks' forward and backward on it).
    """
    device = plan.device
    streamed = _modules(model, plan.blocks_where("stream"))
    swapped = _modules(model, list(plan.swap_modules))
    checkpointed = _modules(model, list(plan.checkpoint_modules))
    # Blocks both checkpointed and swapped get a checkpoint that swaps their inputs instead.
    swap_recompute = [m for m in swapped if any(m is c for c in checkpointed)]
    # Order matters: parameters must be on their final device before the optimizer sees
    # them, and the forward is wrapped before the parallel wrappers see the modules.
    if streamed:
        place_for_streaming(model, streamed, device)  # the blocks stay in host memory
    elif not sharded_build(plan):
        model.to(device)
    if checkpointed:
        disable_caches(model)
        apply_activation_checkpointing([m for m in checkpointed if not any(m is s for s in swap_recompute)])
    swapper = None
    if swapped:
        swap = plan.swap
        swapper = apply_activation_offload(swapped, device, swap_recompute, swap.prefetch_blocks,
                                           swap.pin_memory, swap.min_bytes)
    apply_device_map(model, dict(plan.device_map), device)
    parallel, runner, observers = _parallelize(plan, model, loss_fn, example_batch)
    settings = plan.optimizer_settings
    if optimizer is None:
        optimizer = build_optimizer(model.parameters(), settings.type, optimizer_params(plan))
    elif plan.pipeline is not None:
        _keep_held(optimizer, model)
    if settings.fp16_init_step:  # before the schedule sets its first rate, as DeepSpeed steps
        take_fp16_init_step(optimizer)
    setup = _resume_fingerprint(plan, optimizer)
    offload = None
    # Which weights autocast reads only in half (they may cross host⇄device in half);
    # across processes gradients are reduced in fp32 before they land, so none there.
    half_dtypes = half_width_params(model, plan.compute_dtype, plan.sizes.world)
    if plan.optimizer.placement != "device":
        placement = plan.optimizer
        offload = OffloadOptimizer(optimizer, device, placement.pin_memory, placement.host_ratio,
                                   placement.bucket_size, placement.defer_step,
                                   streamed=[list(block.parameters()) for block in streamed],
                                   grads_wait_on_host=placement.grads_wait_on_host,
                                   several_backwards=params_in_several_backwards(model, swap_recompute),
                                   half_dtypes=half_dtypes,
                                   grad_norms=plan.step_rules.gradient_clipping > 0,
                                   grads_wait_on_device=placement.grads_wait_on_device,
                                   device_share_first=placement.device_share_first)
        # model.state_dict() waits for updates first; updated weights go up in half where exact.
        offload.half_uploads.attach(model, offload.buckets, offload.wait_for_updates)
        optimizer = offload
    schedule = plan.scheduler
    scheduler = build_scheduler(optimizer, schedule.type, dict(schedule.params)) if schedule else None
    scaling = plan.loss_scaler
    scaler = LossScaler(scaling.static_scale, scaling.initial_scale_power, scaling.window, scaling.hysteresis,
                        scaling.min_scale) if scaling else None
    if streamed and offload is not None:
        # The streamer tells the host optimizer about each backward itself.
        streamer = LayerStreamer(streamed, offload, device, plan.stream_prefetch_blocks,
                                 half_dtypes=half_dtypes,
                                 keep_blocks_for_backward=plan.stream_keep_blocks,
                                 images_per_upload=plan.stream_images_per_upload)
        observers.append(streamer)
        if plan.step_runner == "layer_major":
            runner = LayerMajorRunner(streamer, swapper)
    elif offload is not None:
        observers.append(offload)
    rules = plan.step_rules
    options = EngineOptions(
        batch=plan.batch, device=device, compute_dtype=plan.compute_dtype,
        gradient_clipping=rules.gradient_clipping, nonfinite_loss=rules.nonfinite_loss,
        wall_clock_breakdown=rules.wall_clock_breakdown, setup=setup, parallel=parallel,
        runner=runner, observers=observers, autocast_cache=plan.autocast_cache,
        steps=OffloadSteps(offload, _clips_locally(parallel)) if offload is not None else None,
    )
    return Engine(model, optimizer, scheduler, scaler, loss_fn, options)


def _modules(model: nn.Module, names: list[str]) -> list[nn.Module]:
    return [model.get_submodule(name) for name in names]


def _clips_locally(parallel: ParallelRuntime) -> bool:
    """Whether the runtime's clip is the local norm (one process, or replicated gradients):
    a runtime that keeps the replicated rule clips what this process holds."""
    return type(parallel).clip_grad_norm is ReplicatedRuntime.clip_grad_norm


def _parallelize(plan: TrainingPlan, model: nn.Module, loss_fn: LossFn | None,
                 example_batch: Batch | None) -> tuple[ParallelRuntime, StepRunner | None, list[BackwardObserver]]:
    """Join the process group, then replicate (DDP), shard (ZeRO) or split (tensor and
    pipeline parallel) the model. The first collectives of the run happen here."""
    sizes, device = plan.sizes, plan.device
    if plan.sizes.world == 1:
        return ReplicatedRuntime(model), None, []
    mesh.init_process_group(device, plan.collective_timeout_s, host_collectives=plan.zero_offload)
    # Made now, while the rendezvous store is alive: the save after a lost launcher (whose
    # process held that store) needs no store then.
    checkpoint_group()
    topology = mesh.build_topology(device, sizes.dp, sizes.tp, sizes.pp)
    shard = _zero_sharder(plan, topology) if plan.zero_stage else None
    blocks = _modules(model, [b.name for b in plan.blocks])
    if plan.replication == "ddp":
        dp = plan.data_parallel
        ddp = apply_data_parallel(model, topology.group("dp"), device, dp.gradient_compression,
                                  dp.powersgd_rank, dp.powersgd_start_iter, dp.bucket_cap_mb)
        return ReplicatedRuntime(model, topology, ddp), None, []
    if plan.replication == "zero":
        assert shard is not None
        shard(model, blocks)
        return ZeroRuntime(model, topology, plan.zero_stage), None, []
    # torchtitan's order: tensor parallel on the tp mesh first, then ZeRO (FSDP2) over the
    # dp mesh on top of those DTensors; a pipeline shards each stage at its split.
    qkv_interleaved = frozenset(apply_tensor_parallel(model, topology.submesh("tp"), dict(plan.tensor_plan))) \
        if plan.tensor_plan else frozenset()
    if plan.pipeline is None:
        if shard is not None:
            shard(model, blocks)
        runtime = SplitRuntime(model, topology, plan.zero_stage, qkv_interleaved=qkv_interleaved)
        # Replicas average gradients after the last backward (ZeRO reduce-scatters in it).
        sync: list[BackwardObserver] = [GradientSync(model, topology)] if topology.dp > 1 and not shard else []
        return runtime, None, sync
    if example_batch is None:
        raise ValueError("build: a pipeline plan needs the example_batch it was resolved with")
    example = to_device(example_batch, device)
    container = model.get_submodule(plan.pipeline.blocks_path) if plan.pipeline.blocks_path else model
    split = split_pipeline(model, container, plan.pipeline, topology, example,  # type: ignore[arg-type]
                           loss_fn, device, plan.compute_dtype, shard)
    runtime = SplitRuntime(model, topology, plan.zero_stage, split.owner, split.counted, qkv_interleaved,
                           pipelined=True)
    return runtime, PipelineRunner(split, plan.pipeline, topology, device, plan.compute_dtype), []


def sharded_build(plan: TrainingPlan) -> bool:
    """Whether each rank places only its part, so the whole model never lands on one device:
    under ZeRO across processes (nothing else splitting the model) ``fully_shard`` moves each
    unit's parameters to the device and keeps this rank's shard, and a model built on the
    meta device is materialized shard by shard (:func:`materialize_shards`); a pipeline
    (without tensor parallel) moves only this rank's stage, after hollowing the other
    ranks' blocks — unless ``partition: time`` must run the whole model first."""
    if plan.device_map:
        return False
    if plan.pipeline is not None:
        return not plan.tensor_plan and plan.pipeline.counts is not None
    return plan.replication == "zero"


def materialize_shards(model: nn.Module, device: torch.device) -> None:
    """After ``fully_shard`` of a meta-device model: allocate each rank's shards (and the
    buffers) on ``device`` and initialize them with the model's ``init_weights()`` (the
    torchtitan convention), else each module's ``reset_parameters()``.

    Raises:
        ValueError: the model has neither (its meta weights would stay uninitialized).
    """
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    model.to_empty(device=device)
    # DTensor's random ops draw each shard from its own offset of one stream on CUDA; on a
    # CPU mesh each rank draws its shard locally, so every rank would get the same values:
    # a seed per rank (derived from the common state, which is left as it was) avoids that.
    with torch.random.fork_rng(devices=[]):
        if device.type == "cpu" and torch.distributed.is_initialized():
            torch.manual_seed(int(torch.randint(2**62, ())) + torch.distributed.get_rank())
        _initialize(model)


def _initialize(model: nn.Module) -> None:
    init = getattr(model, "init_weights", None)
    if callable(init):
        init()
        return
    resets = [m for m in model.modules() if callable(getattr(m, "reset_parameters", None))]
    owned = {id(p) for m in resets for p in m.parameters(recurse=False)}
    missing = [n for n, p in model.named_parameters() if id(p) not in owned]
    if missing:
        raise ValueError(f"model built on the meta device: {type(model).__name__} has no init_weights() and "
                         f"{missing[0]} has no reset_parameters(); give the model an init_weights() method, or "
                         "build it on the CPU")
    with torch.no_grad():
        for module in resets:
            module.reset_parameters()  # type: ignore[operator]  # callable: checked above


def optimizer_params(plan: TrainingPlan) -> dict[str, Any]:
    """The optimizer's params as built (the plan's ``optimizer_settings``): under ZeRO with
    CPU offload the step runs on host DTensors, where torch's fused CPU Adam is several times
    faster than the default per-tensor loop (same math); a ``fused`` the user set is kept."""
    settings = plan.optimizer_settings
    params = dict(settings.params)
    fusable = settings.type.lower() in ("adam", "adamw") and params.get("bias_correction", True)
    if plan.zero_offload and fusable and "fused" not in params and "foreach" not in params:
        params["fused"] = True
    return params


def _zero_sharder(plan: TrainingPlan, topology: mesh.Topology) -> Sharder:
    """``shard(model, blocks)``: ZeRO over the data-parallel mesh dimension, as planned."""
    offload = plan.zero_offload
    dp_mesh = topology.submesh("dp")

    def shard(model: nn.Module, blocks: list[nn.Module]) -> None:
        apply_zero(model, blocks, dp_mesh, plan.zero_stage, plan.compute_dtype, offload)
        if sharded_build(plan):
            # Offloaded shards live in host memory (FSDP2 moves them to the device per unit).
            materialize_shards(model, torch.device("cpu") if offload else plan.device)
    return shard


def _keep_held(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """A caller's optimizer under a pipeline: drop the parameters of blocks this rank no
    longer holds (before any step, so there is no state to lose)."""
    held = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in held]


def disable_caches(model: nn.Module) -> None:
    """Turn off every Hugging Face KV cache in the model: it is filled as a side effect of
    the forward, so recomputation would fill it twice, and training never reads it. An
    encoder–decoder's decoder keeps its own config (T5), so every submodule's is set."""
    for module in model.modules():
        config: Any = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", None):
            config.use_cache = False


def _resume_fingerprint(plan: TrainingPlan, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Settings a checkpoint must share with the run that resumes it."""
    precision = precision_name(plan.compute_dtype)
    return {
        "optimizer": type(optimizer).__name__,
        "precision": precision,
        "scheduler": plan.scheduler.type if plan.scheduler else None,
        **({"optimizer_state": "by-name"} if plan.state_by_name else {}),
    }
