"""Composition: ``initialize`` validates everything, then applies the techniques in a
fixed order and returns an :class:`Engine`. This is the one place that reads the config;
modules below it get explicit arguments. (Named ``compose`` so that the submodule does not
shadow the ``hybridtrain.initialize`` function.)"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridtrain.config import Config, ConfigError, ConfigSource, load_config, resolve_batch_sizes
from hybridtrain.config.capabilities import check_supported, parallel_sizes
from hybridtrain.engine import Engine, EngineOptions
from hybridtrain.models.blocks import BlocksNotFoundError, find_blocks
from hybridtrain.parallel import mesh
from hybridtrain.parallel.data import apply_data_parallel
from hybridtrain.parallel.model_parallel import apply_device_map, resolve_device_map
from hybridtrain.parallel.pipeline import PipelineRunner, PipelineSpec
from hybridtrain.parallel.runtime import ParallelRuntime
from hybridtrain.parallel.split_runtime import GradientSync, SplitRuntime
from hybridtrain.parallel.tensor import apply_tensor_parallel, resolve_plan
from hybridtrain.parallel.zero import ZeroRuntime, apply_zero
from hybridtrain.runtime.activation_offload import (
    apply_activation_offload,
    params_in_several_backwards,
)
from hybridtrain.runtime.batch import LossFn
from hybridtrain.runtime.checkpointing import (
    apply_activation_checkpointing,
    select_checkpoint_targets,
)
from hybridtrain.runtime.device import resolve_device
from hybridtrain.runtime.layer_major import LayerMajorRunner
from hybridtrain.runtime.optim import build_optimizer, build_scheduler
from hybridtrain.runtime.optimizer_offload import OffloadOptimizer
from hybridtrain.runtime.precision import LossScaler
from hybridtrain.runtime.streaming import LayerStreamer, check_not_shared, place_for_streaming


def initialize(model: nn.Module, config: ConfigSource | None = None, loss_fn: LossFn | None = None,
               optimizer: torch.optim.Optimizer | None = None) -> Engine:
    """Prepare ``model`` for training as ``config`` describes.

    Args:
        model: any ``nn.Module`` (including Hugging Face models).
        config: a ``Config``, a dict, or a JSON/YAML path (DeepSpeed keys load as they are).
        loss_fn: ``loss_fn(outputs, batch) -> loss``; without it the output's ``.loss`` or a
            scalar output is the loss.
        optimizer: an optimizer over ``model``'s parameters; built from ``config.optimizer``
            when absent.

    Returns:
        The engine; ``engine.train_batch(batch)`` runs one optimizer step.

    Raises:
        ConfigError: any invalid or unsupported setting, before the model is touched.
    """
    cfg = load_config(config)
    world_size = mesh.env_world_size()
    # Everything below up to the first collective only reads the config and the model, so
    # bad input fails identically on every rank and no rank waits in a collective.
    check_supported(cfg, world_size)
    sizes = parallel_sizes(cfg, world_size)
    if sizes[2] > 1 and cfg.pipeline.micro_batches and cfg.gradient_accumulation_steps is None:
        # Under a pipeline, micro-batches per step and accumulation steps are one setting.
        cfg = cfg.model_copy(update={"gradient_accumulation_steps": cfg.pipeline.micro_batches})
    batch = resolve_batch_sizes(cfg, sizes[0])
    try:
        device = _rank_device(resolve_device(cfg.device), world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    streamed = _streamed_blocks(model, cfg)
    checkpoint_targets = _checkpoint_targets(model, cfg, streamed)
    swap_targets, swap_recompute = _swap_targets(model, cfg, checkpoint_targets, streamed)
    compute_dtype = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else None
    sharded = cfg.zero_optimization.stage > 0 and sizes[0] > 1
    if sharded and optimizer is not None:
        raise ConfigError("zero_optimization.stage > 0 shards the parameters, so the optimizer must be "
                          "built after sharding: pass optimizer=None and set config optimizer instead")
    shard_units = _blocks_or_none(model, cfg) if sharded else []
    try:
        device_map = resolve_device_map(model, cfg.device_map)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    # Order matters: parameters must be on their final device before the optimizer sees
    # them, and the forward is wrapped last so the wrappers see the final modules.
    if streamed:
        place_for_streaming(model, streamed, device)  # the blocks stay in host memory
    else:
        model.to(device)
    if checkpoint_targets:
        _disable_hf_cache(model)
        # Blocks that are also swapped get a checkpoint that swaps their inputs instead.
        apply_activation_checkpointing([m for m in checkpoint_targets if m not in swap_recompute])
    swapper = None
    if swap_targets:
        swap = cfg.activation_offload
        swapper = apply_activation_offload(swap_targets, device, swap_recompute, swap.prefetch_blocks,
                                           swap.pin_memory, swap.min_bytes)
    pipeline_blocks = _pipeline_blocks(model, cfg, sizes[2])
    try:
        tensor_plan = resolve_plan(model, cfg.tensor_parallel.plan, sizes[1]) if sizes[1] > 1 else {}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    apply_device_map(model, device_map, device)
    parallel = _parallelize(model, cfg, device, sizes, shard_units, compute_dtype)
    if isinstance(parallel, SplitRuntime):
        # torchtitan's order: tensor parallel on the tp mesh first, then ZeRO (FSDP2) over
        # the dp mesh on top of those DTensors; a pipeline shards each stage at its split.
        if tensor_plan:
            parallel.reordered = set(apply_tensor_parallel(model, parallel.topology.submesh("tp"), tensor_plan))
        shard = _zero_sharder(cfg, parallel.topology, compute_dtype) if parallel.zero_stage else None
        if pipeline_blocks is not None:
            spec = PipelineSpec(cfg.pipeline.schedule, batch.accumulation_steps, cfg.pipeline.virtual_stages,
                                cfg.pipeline.partition, pipeline_blocks[0])
            parallel.pipeline = PipelineRunner(model, pipeline_blocks[1], spec, parallel, loss_fn, device,
                                               compute_dtype, shard)
        elif shard is not None:
            shard(model, shard_units)
    try:
        if optimizer is None:
            optimizer = build_optimizer(model.parameters(), cfg.optimizer.type, cfg.optimizer.params)
        setup = _resume_fingerprint(cfg, optimizer)
        offload = _offload_optimizer(optimizer, cfg, device, sizes, streamed, batch.accumulation_steps,
                                     lambda: params_in_several_backwards(model, swap_recompute))
        optimizer = offload or optimizer
        scheduler = build_scheduler(optimizer, cfg.scheduler.type, cfg.scheduler.params) if cfg.scheduler else None
        if parallel.pipeline is not None:
            parallel.pipeline.optimizer = optimizer  # pruned to this stage's parameters at the split
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    scaler = None
    if cfg.fp16.enabled:
        scaler = LossScaler(cfg.fp16.loss_scale, cfg.fp16.initial_scale_power, cfg.fp16.loss_scale_window,
                            cfg.fp16.hysteresis, cfg.fp16.min_loss_scale)
    streamer = LayerStreamer(streamed, offload, device, cfg.layer_streaming.prefetch_blocks) \
        if streamed and offload else None
    options = EngineOptions(
        batch=batch,
        device=device,
        compute_dtype=compute_dtype,
        gradient_clipping=cfg.gradient_clipping,
        nonfinite_loss=cfg.nonfinite_loss,
        wall_clock_breakdown=cfg.wall_clock_breakdown,
        setup=setup,
        parallel=parallel,
        backward_observer=streamer or offload or _replica_sync(parallel),
        step_runner=LayerMajorRunner(streamer, swapper) if streamer and cfg.layer_streaming.layer_major else None,
    )
    return Engine(model, optimizer, scheduler, scaler, loss_fn, options, cfg)


def _rank_device(device: torch.device, world_size: int) -> torch.device:
    # Several ranks on one node each take the GPU of their local rank.
    if world_size > 1 and device.type == "cuda" and device.index in (None, 0):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def _parallelize(model: nn.Module, cfg: Config, device: torch.device, sizes: tuple[int, int, int],
                 shard_units: list[nn.Module], compute_dtype: torch.dtype | None) -> ParallelRuntime:
    """Join the process group, then shard (ZeRO) or replicate (DDP) over the data-parallel
    dimension. The first collectives of the run happen here."""
    if sizes == (1, 1, 1):
        return ParallelRuntime(model)
    mesh.init_process_group(device)
    topology = mesh.build_topology(device, *sizes)
    zero_stage = cfg.zero_optimization.stage if topology.dp > 1 else 0
    if topology.tp > 1 or topology.pp > 1:
        return SplitRuntime(model, topology, zero_stage)  # split and sharded by initialize
    if topology.dp == 1:
        return ParallelRuntime(model, topology)
    shard = _zero_sharder(cfg, topology, compute_dtype) if zero_stage else None
    if shard is not None:
        shard(model, shard_units)
        return ZeroRuntime(model, topology, zero_stage)
    dp = cfg.data_parallel
    ddp = apply_data_parallel(model, topology.group("dp"), device, dp.gradient_compression,
                              dp.powersgd_rank, dp.powersgd_start_iter, dp.bucket_cap_mb)
    return ParallelRuntime(model, topology, ddp)


def _zero_sharder(cfg: Config, topology: mesh.Topology,
                  compute_dtype: torch.dtype | None) -> Callable[[nn.Module, list[nn.Module]], None]:
    """``shard(model, blocks)``: ZeRO over the data-parallel mesh dimension, as configured."""
    zero = cfg.zero_optimization
    offload = "cpu" in (zero.offload_param.device, zero.offload_optimizer.device)
    dp_mesh = topology.submesh("dp")

    def shard(model: nn.Module, blocks: list[nn.Module]) -> None:
        apply_zero(model, blocks, dp_mesh, zero.stage, compute_dtype, offload)
    return shard


def _pipeline_blocks(model: nn.Module, cfg: Config,
                     stages: int) -> tuple[str, nn.ModuleList | nn.Sequential] | None:
    """The block container a pipeline splits, checked against the stages (no collective)."""
    if stages == 1:
        return None
    try:
        path, blocks = find_blocks(model, cfg.model.blocks)
    except BlocksNotFoundError as exc:
        raise ConfigError(f"pipeline: {exc}") from None
    total = stages * cfg.pipeline.virtual_stages
    if total > len(blocks):
        raise ConfigError(f"pipeline of {total} stages (stages × virtual_stages) but the model has "
                          f"{len(blocks)} blocks; use at most {len(blocks)} stages")
    counts = cfg.pipeline.partition
    if isinstance(counts, list) and (sum(counts) != len(blocks) or min(counts) < 1):
        raise ConfigError(f"pipeline.partition {counts} must be positive block counts adding up to the "
                          f"model's {len(blocks)} blocks")
    return path, blocks


def _replica_sync(parallel: ParallelRuntime) -> GradientSync | None:
    # Tensor parallel without a pipeline: replicas average gradients after the last backward
    # (under ZeRO, FSDP2 reduce-scatters them in backward instead).
    if (isinstance(parallel, SplitRuntime) and parallel.pipeline is None and parallel.topology.dp > 1
            and not parallel.zero_stage):
        return GradientSync(parallel.model, parallel.topology)
    return None


def _blocks_or_none(model: nn.Module, cfg: Config) -> list[nn.Module]:
    # Without recognisable blocks the whole model is one FSDP unit: still correct, but
    # every parameter is gathered at once.
    try:
        return list(find_blocks(model, cfg.model.blocks)[1])
    except BlocksNotFoundError:
        return []


def _checkpoint_targets(model: nn.Module, cfg: Config, streamed: list[nn.Module]) -> list[nn.Module]:
    if streamed:  # streaming chooses its own recomputation
        return streamed if cfg.layer_streaming.boundary_activations != "device" else []
    section = cfg.activation_checkpointing
    if not section.enabled:
        return []
    try:
        blocks = None if section.module_classes else list(find_blocks(model, cfg.model.blocks)[1])
        return select_checkpoint_targets(model, blocks, section.every_n_blocks, section.module_classes)
    except (BlocksNotFoundError, ValueError) as exc:
        raise ConfigError(f"activation_checkpointing: {exc}") from None


def _swap_targets(model: nn.Module, cfg: Config, checkpoint_targets: list[nn.Module],
                  streamed: list[nn.Module]) -> tuple[list[nn.Module], list[nn.Module]]:
    """Blocks whose saved activations are swapped, and those of them also checkpointed
    (only their inputs travel). DeepSpeed's ``cpu_checkpointing`` and streaming with host
    boundary activations swap the checkpoints."""
    section = cfg.activation_offload
    if streamed and cfg.layer_streaming.boundary_activations == "host":
        swapped = streamed
    elif not section.enabled:
        swapped = checkpoint_targets if cfg.activation_checkpointing.cpu_checkpointing else []
    else:
        try:
            blocks = list(find_blocks(model, cfg.model.blocks)[1])
        except BlocksNotFoundError as exc:
            raise ConfigError(f"activation_offload: {exc}") from None
        wrong = [i for i in section.blocks if not 0 <= i < len(blocks)]
        if wrong:
            raise ConfigError(f"activation_offload.blocks {wrong} out of range; the model has "
                              f"{len(blocks)} blocks (0..{len(blocks) - 1})")
        swapped = [blocks[i] for i in sorted(set(section.blocks))] if section.blocks else blocks
    checkpointed = {id(m) for m in checkpoint_targets}
    return swapped, [m for m in swapped if id(m) in checkpointed]


def _offload_optimizer(optimizer: torch.optim.Optimizer, cfg: Config, device: torch.device,
                       sizes: tuple[int, int, int], streamed: list[nn.Module], accumulation: int,
                       late: Callable[[], frozenset[int]]) -> OffloadOptimizer | None:
    """ZeRO-Offload on one process (several processes offload inside ZeRO sharding); layer
    streaming always updates on the host, each streamed block being one bucket."""
    section = cfg.zero_optimization.offload_optimizer
    if not streamed and (section.device != "cpu" or sizes != (1, 1, 1)):
        return None
    # These need every gradient before any update, so the host step waits for backward.
    defer = cfg.gradient_clipping > 0 or cfg.fp16.enabled or cfg.nonfinite_loss == "skip"
    pin = cfg.layer_streaming.pin_memory if streamed else section.pin_memory
    # Gradients wait in host memory when micro-batches land one by one and are summed there
    # (layer-major streaming sums them on the device and lands each block once).
    summed_on_host = accumulation > 1 and not (streamed and cfg.layer_streaming.layer_major)
    return OffloadOptimizer(optimizer, device, pin, 1.0 if streamed else section.ratio,
                            cfg.zero_optimization.reduce_bucket_size, defer,
                            streamed=[list(block.parameters()) for block in streamed],
                            lasting_grads=defer or summed_on_host, late=late())


def _streamed_blocks(model: nn.Module, cfg: Config) -> list[nn.Module]:
    """The blocks layer streaming moves through the device (all but ``resident``)."""
    section = cfg.layer_streaming
    if not section.enabled:
        return []
    try:
        path, container = find_blocks(model, cfg.model.blocks)
    except BlocksNotFoundError as exc:
        raise ConfigError(f"layer_streaming: {exc}") from None
    names = {f"{path}.{i}" if path else str(i): block for i, block in enumerate(container)}
    unknown = [r for r in section.resident if r not in names]
    if unknown:
        raise ConfigError(f"layer_streaming.resident {unknown} are not blocks; blocks are "
                          f"{', '.join(list(names)[:4])}, …")
    streamed = [block for name, block in names.items() if name not in section.resident]
    try:
        check_not_shared(model, streamed)
    except ValueError as exc:
        raise ConfigError(f"layer_streaming: {exc}") from None
    return streamed


def _disable_hf_cache(model: nn.Module) -> None:
    # A Hugging Face KV cache is filled as a side effect of the forward; recomputation
    # would fill it twice, and training never reads it.
    hf_config: Any = getattr(model, "config", None)
    if hf_config is not None and hasattr(hf_config, "use_cache"):
        hf_config.use_cache = False


def _resume_fingerprint(cfg: Config, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Settings a checkpoint must share with the run that resumes it."""
    precision = "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"
    return {
        "optimizer": type(optimizer).__name__,
        "precision": precision,
        "scheduler": cfg.scheduler.type if cfg.scheduler else None,
        # Sharded runs save the optimizer state keyed by parameter name, others by index.
        **({"optimizer_state": "by-name"} if cfg.zero_optimization.stage > 0 else {}),
    }
