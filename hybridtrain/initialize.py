"""``initialize``: validate everything, then apply the techniques in a fixed order and
return an :class:`Engine`. This is the one place that reads the config; modules below it
get explicit arguments."""

from __future__ import annotations

import os
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
from hybridtrain.parallel.runtime import ParallelRuntime
from hybridtrain.parallel.zero import ZeroRuntime, apply_zero
from hybridtrain.runtime.activation_offload import apply_activation_offload
from hybridtrain.runtime.batch import LossFn
from hybridtrain.runtime.checkpointing import (
    apply_activation_checkpointing,
    select_checkpoint_targets,
)
from hybridtrain.runtime.device import resolve_device
from hybridtrain.runtime.optim import build_optimizer, build_scheduler
from hybridtrain.runtime.optimizer_offload import OffloadOptimizer
from hybridtrain.runtime.precision import LossScaler


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
    batch = resolve_batch_sizes(cfg, sizes[0])
    try:
        device = _rank_device(resolve_device(cfg.device), world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    checkpoint_targets = _checkpoint_targets(model, cfg)
    swap_targets, swap_recompute = _swap_targets(model, cfg, checkpoint_targets)
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
    model.to(device)
    if checkpoint_targets:
        _disable_hf_cache(model)
        # Blocks that are also swapped get a checkpoint that swaps their inputs instead.
        apply_activation_checkpointing([m for m in checkpoint_targets if m not in swap_recompute])
    if swap_targets:
        swap = cfg.activation_offload
        apply_activation_offload(swap_targets, device, swap_recompute, swap.prefetch_blocks, swap.pin_memory,
                                 swap.min_bytes)
    apply_device_map(model, device_map, device)
    parallel = _parallelize(model, cfg, device, sizes, shard_units, compute_dtype)
    try:
        if optimizer is None:
            optimizer = build_optimizer(model.parameters(), cfg.optimizer.type, cfg.optimizer.params)
        setup = _resume_fingerprint(cfg, optimizer)
        offload = _offload_optimizer(optimizer, cfg, device, sizes)
        optimizer = offload or optimizer
        scheduler = build_scheduler(optimizer, cfg.scheduler.type, cfg.scheduler.params) if cfg.scheduler else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    scaler = None
    if cfg.fp16.enabled:
        scaler = LossScaler(cfg.fp16.loss_scale, cfg.fp16.initial_scale_power, cfg.fp16.loss_scale_window,
                            cfg.fp16.hysteresis, cfg.fp16.min_loss_scale)
    options = EngineOptions(
        batch=batch,
        device=device,
        compute_dtype=compute_dtype,
        gradient_clipping=cfg.gradient_clipping,
        nonfinite_loss=cfg.nonfinite_loss,
        wall_clock_breakdown=cfg.wall_clock_breakdown,
        setup=setup,
        parallel=parallel,
        backward_observer=offload,
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
    if topology.dp == 1:
        return ParallelRuntime(model, topology)
    zero = cfg.zero_optimization
    if zero.stage > 0:
        offload = "cpu" in (zero.offload_param.device, zero.offload_optimizer.device)
        apply_zero(model, shard_units, topology.submesh("dp"), zero.stage, compute_dtype, offload)
        return ZeroRuntime(model, topology, zero.stage)
    dp = cfg.data_parallel
    ddp = apply_data_parallel(model, topology.group("dp"), device, dp.gradient_compression,
                              dp.powersgd_rank, dp.powersgd_start_iter, dp.bucket_cap_mb)
    return ParallelRuntime(model, topology, ddp)


def _blocks_or_none(model: nn.Module, cfg: Config) -> list[nn.Module]:
    # Without recognisable blocks the whole model is one FSDP unit: still correct, but
    # every parameter is gathered at once.
    try:
        return list(find_blocks(model, cfg.model.blocks)[1])
    except BlocksNotFoundError:
        return []


def _checkpoint_targets(model: nn.Module, cfg: Config) -> list[nn.Module]:
    section = cfg.activation_checkpointing
    if not section.enabled:
        return []
    try:
        blocks = None if section.module_classes else list(find_blocks(model, cfg.model.blocks)[1])
        return select_checkpoint_targets(model, blocks, section.every_n_blocks, section.module_classes)
    except (BlocksNotFoundError, ValueError) as exc:
        raise ConfigError(f"activation_checkpointing: {exc}") from None


def _swap_targets(model: nn.Module, cfg: Config,
                  checkpoint_targets: list[nn.Module]) -> tuple[list[nn.Module], list[nn.Module]]:
    """Blocks whose saved activations are swapped, and those of them also checkpointed
    (only their inputs travel). DeepSpeed's ``cpu_checkpointing`` swaps the checkpoints."""
    section = cfg.activation_offload
    if not section.enabled:
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
                       sizes: tuple[int, int, int]) -> OffloadOptimizer | None:
    """ZeRO-Offload on one process (several processes offload inside ZeRO sharding)."""
    section = cfg.zero_optimization.offload_optimizer
    if section.device != "cpu" or sizes != (1, 1, 1):
        return None
    # These need every gradient before any update, so the host step waits for backward.
    defer = cfg.gradient_clipping > 0 or cfg.fp16.enabled or cfg.nonfinite_loss == "skip"
    return OffloadOptimizer(optimizer, device, section.pin_memory, section.ratio,
                            cfg.zero_optimization.reduce_bucket_size, defer)


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
