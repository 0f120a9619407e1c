"""``resolve(config, model, world_size) -> TrainingPlan``: every decision and every
``ConfigError``, before the model is changed or any process group exists.

It reads the config and the model (its module structure and, for pipelines and
streaming when an example batch is given, one traced forward without gradients) and
touches neither. Every rank resolves the same plan from the same inputs, so bad input
fails identically everywhere and no rank waits in a collective.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Hashable, Sequence

import torch
from torch import nn

from hybridtrain.compat import tree_flatten
from hybridtrain.config import Config, ConfigError, ConfigSource, load_config, resolve_batch_sizes
from hybridtrain.config.offload_sections import apply_offload_sections
from hybridtrain.models.blocks import BlockList, BlocksNotFoundError, block_names, find_block_lists
from hybridtrain.models.usage import ModelUsage, trace_usage
from hybridtrain.optim import FP16_INIT_STEP, build_optimizer, build_scheduler
from hybridtrain.parallel import mesh
from hybridtrain.parallel.model_parallel import resolve_device_map
from hybridtrain.parallel.partition import choose_partition, stage_bounds
from hybridtrain.parallel.tensor import resolve_plan
from hybridtrain.plan.checks import check_supported, parallel_sizes
from hybridtrain.plan.types import (
    BlockPlan,
    DataParallelSettings,
    LossScaling,
    OptimizerPlan,
    OptimizerSettings,
    ParallelSizes,
    PipelinePlan,
    Replication,
    SchedulerSettings,
    StepRules,
    StepRunnerKind,
    SwapSettings,
    TrainingPlan,
)
from hybridtrain.runtime.activations import select_checkpoint_targets
from hybridtrain.runtime.batch import Batch, batch_size, run_model, to_device
from hybridtrain.runtime.device import resolve_device
from hybridtrain.runtime.offload import twin_flow_blocks
from hybridtrain.runtime.offload.layout import least_streaming_ratio
from hybridtrain.runtime.precision import autocast
from hybridtrain.runtime.streaming import check_not_shared


def resolve(config: ConfigSource | None, model: nn.Module, world_size: int | None = None,
            example_batch: Batch | None = None, optimizer: torch.optim.Optimizer | None = None) -> TrainingPlan:
    """Decide how ``model`` trains under ``config`` on ``world_size`` processes.

    Args:
        config: a ``Config``, a dict, or a JSON/YAML path.
        model: the model (read, never changed).
        world_size: number of processes (default: ``WORLD_SIZE`` from the environment).
        example_batch: one batch as ``train_batch`` receives it; needed by pipelines (which
            are split at build) and used by streaming to find parameters used outside
            their block.
        optimizer: the caller's own optimizer, if any (read, never changed).

    Raises:
        ConfigError: any invalid, unsupported or inapplicable setting (one line each).
    """
    cfg = load_config(config)
    world = world_size if world_size is not None else mesh.env_world_size()
    cfg = apply_offload_sections(cfg, world)
    check_supported(cfg, world)
    dp, tp, pp = parallel_sizes(cfg, world)
    sizes = ParallelSizes(dp, tp, pp)
    if pp > 1 and cfg.pipeline.micro_batches and cfg.gradient_accumulation_steps is None:
        # Under a pipeline, micro-batches per step and accumulation steps are one setting.
        cfg = cfg.model_copy(update={"gradient_accumulation_steps": cfg.pipeline.micro_batches})
    batch = resolve_batch_sizes(cfg, dp)
    try:
        device = _rank_device(resolve_device(cfg.device), world)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    blocks = _Blocks(model, cfg)
    streamed = _streamed(model, cfg, blocks)
    kept = _kept(cfg, streamed)
    checkpointed = _checkpointed(model, cfg, blocks, streamed)
    swapped = _swapped(cfg, blocks, checkpointed, streamed)
    zero_stage = cfg.zero_optimization.stage if dp > 1 else 0
    if optimizer is not None:
        _check_user_optimizer(zero_stage, tp)
    try:
        device_map = resolve_device_map(model, cfg.device_map)
        tensor_plan = resolve_plan(model, cfg.tensor_parallel.plan, tp) if tp > 1 else {}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_optimizer(cfg, optimizer is not None)
    if pp > 1:
        blocks.single("pipeline")  # before tracing: an encoder–decoder is refused as such
    compute_dtype = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else None
    usage = _usage(model, blocks, example_batch, compute_dtype) \
        if example_batch is not None and (pp > 1 or streamed) else None
    if streamed and usage is not None:
        _refuse_foreign_uses(usage, {i for i, name in enumerate(blocks.names) if name in streamed},
                             "layer_streaming", "list that block in layer_streaming.resident", blocks.names)
    pipeline = _pipeline(cfg, pp, blocks, usage, batch.accumulation_steps) if pp > 1 else None
    counts = pipeline.counts if pipeline is not None and pipeline.counts else ()
    stage_of = {b: s for s, (start, stop) in enumerate(stage_bounds(counts)) for b in range(start, stop)}
    checkpoint_set, swap_set, stream_set = set(checkpointed), set(swapped), set(streamed)
    return TrainingPlan(
        config=cfg, sizes=sizes, batch=batch, device=device,
        compute_dtype=compute_dtype,
        block_lists=tuple(path for path, _ in blocks.lists) if blocks.found else (),
        blocks=tuple(BlockPlan(name, name in checkpoint_set, name in swap_set, name in stream_set, stage_of.get(i))
                     for i, name in enumerate(blocks.names if blocks.found else [])),
        checkpoint_modules=tuple(checkpointed),
        swap_modules=tuple(swapped),
        step_runner=_runner_kind(cfg, pp, streamed),
        replication=_replication(sizes, zero_stage),
        zero_stage=zero_stage,
        tensor_plan=tuple(tensor_plan.items()),
        device_map=tuple(device_map.items()),
        pipeline=pipeline,
        optimizer=_optimizer(cfg, sizes, bool(streamed), batch.accumulation_steps),
        optimizer_settings=optimizer_settings(cfg),
        scheduler=SchedulerSettings(cfg.scheduler.type, tuple(cfg.scheduler.params.items())) if cfg.scheduler else None,
        loss_scaler=_loss_scaler(cfg),
        swap=SwapSettings(cfg.activation_offload.prefetch_blocks, cfg.activation_offload.pin_memory,
                          cfg.activation_offload.min_bytes),
        stream_prefetch_blocks=cfg.layer_streaming.prefetch_blocks,
        stream_keep_blocks=kept,
        stream_images_per_upload=cfg.layer_streaming.half_images == "per_upload",
        step_rules=StepRules(cfg.gradient_clipping, cfg.nonfinite_loss, cfg.wall_clock_breakdown),
        collective_timeout_s=cfg.distributed.timeout_s,
        data_parallel=DataParallelSettings(cfg.data_parallel.gradient_compression, cfg.data_parallel.powersgd_rank,
                                           cfg.data_parallel.powersgd_start_iter, cfg.data_parallel.bucket_cap_mb),
        zero_offload=bool(zero_stage) and sizes.world > 1 and "cpu" in (
            cfg.zero_optimization.offload_param.device, cfg.zero_optimization.offload_optimizer.device),
        # Sharded runs save the optimizer state keyed by parameter name, others by index.
        state_by_name=cfg.zero_optimization.stage > 0,
    )


def _loss_scaler(cfg: Config) -> LossScaling | None:
    """fp16's loss scaling as the config sets it (None without fp16)."""
    if not cfg.fp16.enabled:
        return None
    fp16 = cfg.fp16
    return LossScaling(fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis,
                       fp16.min_loss_scale)


def optimizer_settings(cfg: Config) -> OptimizerSettings:
    """``cfg.optimizer`` as build uses it: ``optimizer.params.fp16_init_step``, where the
    config has it (written by a user, or by a layer that hands the config down), read out
    of the parameters into :attr:`OptimizerSettings.fp16_init_step`."""
    params = dict(cfg.optimizer.params)
    step = params.pop(FP16_INIT_STEP, None) is True
    return OptimizerSettings(cfg.optimizer.type, tuple(params.items()), step)


class _Blocks:
    """The model's block lists, found once; a technique that needs them and finds none
    raises a ``ConfigError`` prefixed by its config section."""

    def __init__(self, model: nn.Module, cfg: Config) -> None:
        self.lists: list[tuple[str, BlockList]] = []
        self.error: str | None = None
        try:
            self.lists = find_block_lists(model, cfg.model.blocks)
        except BlocksNotFoundError as exc:
            self.error = str(exc)
        self.names = block_names(self.lists)
        self.modules = [block for _, container in self.lists for block in container]

    @property
    def found(self) -> bool:
        return self.error is None

    def need(self, section: str) -> list[str]:
        """Every block's name, or a ConfigError naming ``section`` when there are none."""
        if self.error is not None:
            raise ConfigError(f"{section}: {self.error}")
        return self.names

    def single(self, section: str) -> tuple[str, BlockList]:
        """The one block list a technique needs (pipelines, layer-major streaming)."""
        self.need(section)
        if len(self.lists) > 1:
            paths = " and ".join(p for p, _ in self.lists)
            raise ConfigError(f"{section} needs one list of blocks, but the model has {paths} (an encoder–"
                              f"decoder): its decoder reads the encoder's output from outside its blocks; "
                              f"{_single_hint(section)}")
        return self.lists[0]


def _single_hint(section: str) -> str:
    if section == "layer_streaming.layer_major":
        return "set layer_streaming.layer_major: false (streaming without it works)"
    return "set model.blocks to one list, or use a technique that keeps the model whole"


def _rank_device(device: torch.device, world_size: int) -> torch.device:
    # Several ranks on one node each take the GPU of their local rank.
    if world_size > 1 and device.type == "cuda" and device.index in (None, 0):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def _streamed(model: nn.Module, cfg: Config, blocks: _Blocks) -> list[str]:
    """The blocks layer streaming moves through the device (all but ``resident``)."""
    section = cfg.layer_streaming
    if not section.enabled:
        return []
    names = blocks.need("layer_streaming")
    if section.layer_major:
        blocks.single("layer_streaming.layer_major")
    unknown = [r for r in section.resident if r not in names]
    if unknown:
        raise ConfigError(f"layer_streaming.resident {unknown} are not blocks; blocks are "
                          f"{', '.join(names[:4])}, …")
    # Twin-Flow (offload_optimizer.ratio below 1): the blocks holding its device share (the
    # first or the last parameters) stay resident, their update on the device.
    offload = cfg.zero_optimization.offload_optimizer
    on_device = twin_flow_blocks(list(zip(names, blocks.modules, strict=True)), list(model.parameters()),
                                 offload.ratio, first=offload.device_share == "first")
    streamed = [name for name in names if name not in section.resident and name not in on_device]
    if not streamed:
        raise ConfigError(_nothing_streams(model, cfg, blocks))
    try:
        check_not_shared(model, [m for n, m in zip(names, blocks.modules, strict=True) if n in streamed])
    except ValueError as exc:
        raise ConfigError(f"layer_streaming: {exc}") from None
    return streamed


def _nothing_streams(model: nn.Module, cfg: Config, blocks: _Blocks) -> str:
    """Why layer streaming would stream no block, and what would let it, in one line."""
    resident = cfg.layer_streaming.resident
    if set(blocks.names) <= set(resident):
        return ("layer_streaming.resident lists every block, so nothing streams; leave some out, or disable "
                "layer_streaming")
    offload = cfg.zero_optimization.offload_optimizer
    free = [m for n, m in zip(blocks.names, blocks.modules, strict=True) if n not in resident]
    least = least_streaming_ratio(free, list(model.parameters()), first=offload.device_share == "first")
    return (f"zero_optimization.offload_optimizer.ratio = {offload.ratio} keeps a parameter of every block in "
            f"Twin-Flow's device share, so layer_streaming streams nothing; allowed: a ratio of at least "
            f"{math.ceil(least * 100) / 100:g} (or disable layer_streaming)")


def _kept(cfg: Config, streamed: list[str]) -> int:
    """How many streamed blocks keep their device copy from forward to backward (of each
    micro-batch; of the step under layer-major order)."""
    keep = cfg.layer_streaming.keep_blocks_for_backward
    if keep > len(streamed):
        raise ConfigError(f"layer_streaming.keep_blocks_for_backward = {keep} but {len(streamed)} blocks are "
                          f"streamed; use -1 (all) or 0..{len(streamed)}")
    return len(streamed) if keep == -1 else keep


def _checkpointed(model: nn.Module, cfg: Config, blocks: _Blocks, streamed: list[str]) -> list[str]:
    """Paths of the modules activation checkpointing wraps: blocks, or modules chosen by
    class (``module_classes``). Streaming recomputes its blocks itself; under it the section
    checkpoints the blocks that stay on the device (every n-th of them)."""
    section = cfg.activation_checkpointing
    if streamed:
        own = streamed if cfg.layer_streaming.boundary_activations != "device" else []
        return own + _resident_checkpointed(cfg, blocks, streamed)
    if not section.enabled:
        return []
    names = {id(m): name for name, m in model.named_modules()}
    try:
        if section.module_classes:
            chosen = select_checkpoint_targets(model, None, module_classes=section.module_classes)
        else:
            blocks.need("activation_checkpointing")
            # every_n_blocks counts within each block list (an encoder's and a decoder's first block).
            chosen = [m for _, container in blocks.lists
                      for m in select_checkpoint_targets(model, list(container), section.every_n_blocks)]
    except ConfigError:
        raise  # already names its section
    except ValueError as exc:
        raise ConfigError(f"activation_checkpointing: {exc}") from None
    return [names[id(m)] for m in chosen]


def _resident_checkpointed(cfg: Config, blocks: _Blocks, streamed: list[str]) -> list[str]:
    """Under layer streaming, the blocks that stay on the device (``resident``, Twin-Flow's
    share) which ``activation_checkpointing`` wraps: every n-th of them, in model order.
    Their activations otherwise live from forward to backward beside the device share."""
    section = cfg.activation_checkpointing
    if not section.enabled:
        return []
    resident = [name for name in blocks.names if name not in streamed]
    return resident[::section.every_n_blocks]


def _swapped(cfg: Config, blocks: _Blocks, checkpointed: list[str], streamed: list[str]) -> list[str]:
    """Paths of the modules whose saved activations are swapped. DeepSpeed's
    ``cpu_checkpointing`` and streaming with host boundary activations swap the checkpoints."""
    section = cfg.activation_offload
    if streamed and cfg.layer_streaming.boundary_activations == "host":
        return streamed
    if not section.enabled:
        return checkpointed if cfg.activation_checkpointing.cpu_checkpointing else []
    names = blocks.need("activation_offload")
    wrong = [i for i in section.blocks if not 0 <= i < len(names)]
    if wrong:
        raise ConfigError(f"activation_offload.blocks {wrong} out of range; the model has "
                          f"{len(names)} blocks (0..{len(names) - 1})")
    return [names[i] for i in sorted(set(section.blocks))] if section.blocks else names


_META_USAGES: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, ModelUsage]] = weakref.WeakKeyDictionary()
"""Traces of models on the meta device, by block list and batch shapes: the planner resolves
hundreds of variants of one meta model, and a meta forward sees shapes, never values."""


def _usage(model: nn.Module, blocks: _Blocks, example: Batch, compute_dtype: torch.dtype | None) -> ModelUsage:
    """Trace one forward of the example batch (where the model lives now); per-sample
    shapes do not depend on its size."""
    where = next((p.device for p in model.parameters()), torch.device("cpu"))
    example = to_device(example, where)
    shapes = _shapes(example) if where.type == "meta" else None
    # The modules and parameters by identity: a model changed in between is traced again.
    key = None if shapes is None else (tuple(id(m) for m in model.modules()), tuple(id(p) for p in model.parameters()),
                                       tuple(id(b) for b in blocks.modules), shapes)
    if key is not None and key in _META_USAGES.get(model, {}):
        return _META_USAGES[model][key]
    # Under the training precision, so that the recorded boundary dtypes are the sent ones.
    dtype = compute_dtype if where.type in ("cpu", "cuda") else None
    try:
        usage = trace_usage(model, blocks.modules, lambda: run_model(model, example), batch_size(example),
                            lambda: autocast(where, dtype))
    except Exception as exc:  # noqa: BLE001 - any failure of the user's forward, in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"example_batch: the model's forward failed on it ({type(exc).__name__}: {first}); "
                          "check that it is a batch like those train_batch receives and that the model runs "
                          "on it") from None
    if key is not None:
        _META_USAGES.setdefault(model, {})[key] = usage
    return usage


def _shapes(batch: Batch) -> Hashable | None:
    """A meta batch's structure (torch's pytree spec) with its tensors' shapes and dtypes and
    its plain values; None when it holds anything else (that forward is traced every time)."""
    leaves, spec = tree_flatten(batch)
    signature: list[Hashable] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            signature.append((tuple(leaf.shape), leaf.dtype))
        elif leaf is None or isinstance(leaf, bool | int | float | str):
            signature.append(leaf)
        else:
            return None
    return spec, tuple(signature)


def _refuse_foreign_uses(usage: ModelUsage, indices: set[int], section: str, hint: str,
                         names: Sequence[str]) -> None:
    """A block parameter that code outside its block reads cannot live with the block only.
    ``names``: the blocks' module paths (the message names blocks by them)."""
    for name, places in sorted(usage.used_outside_own_block().items()):
        owner = usage.owner[name]
        if owner in indices:
            where = ", ".join(sorted(_place_words(p, names) for p in places))
            raise ConfigError(f"{section}: parameter {name} belongs to block {owner} ({names[owner]}) but the "
                              f"model's code also uses it {where}; {hint}")


def _place_words(place: str, names: Sequence[str]) -> str:
    kind, _, index = place.partition(":")
    i = int(index or 0)
    block = f"{i} ({names[i]})" if i < len(names) else str(i)
    return {"pre": "before the blocks", "post": "after the blocks", "block": f"in block {block}",
            "between": f"between blocks {i} and {i + 1}"}[kind]


def _pipeline(cfg: Config, pp: int, blocks: _Blocks, usage: ModelUsage | None, micro_batches: int) -> PipelinePlan:
    """The pipeline split, checked against the blocks and what the code uses."""
    path, container = blocks.single("pipeline")
    section = cfg.pipeline
    total = pp * section.virtual_stages
    if total > len(container):
        raise ConfigError(f"pipeline of {total} stages (stages × virtual_stages) but the model has "
                          f"{len(container)} blocks; use at most {len(container)} stages")
    counts = section.partition
    if isinstance(counts, list) and (sum(counts) != len(container) or min(counts) < 1):
        raise ConfigError(f"pipeline.partition {counts} must be positive block counts adding up to the "
                          f"model's {len(container)} blocks")
    if usage is None:
        raise ConfigError("pipeline: the model is split into stages at initialize and needs one example batch "
                          "(the shape train_batch receives): initialize(model, config, example_batch=batch)")
    _refuse_foreign_uses(usage, set(range(len(container))), "pipeline",
                         "a pipeline holds each block on one stage only; move the parameter out of the "
                         "blocks or use tensor/data parallel", blocks.names)
    between = sorted(n for n, places in usage.places.items() if n not in usage.owner
                     and any(p.startswith("between:") for p in places))
    if between:
        raise ConfigError(f"pipeline: parameter {between[0]} is used between two blocks, outside any block; "
                          "a stage boundary there would skip it; make that code part of a block")
    if usage.hidden_error:
        raise ConfigError(f"pipeline: {usage.hidden_error}")
    if not usage.batch_major:
        raise ConfigError("pipeline: the blocks' hidden state does not have the batch as its first dimension "
                          "(a sequence-first model); stages exchange batch-first activations")
    if usage.unchained:
        i = usage.unchained[0]
        raise ConfigError(f"pipeline: block {i} of {path or 'the model'} does not receive block {i - 1}'s output "
                          "(the model's code changes the hidden state between blocks, e.g. a residual added "
                          "outside them); a pipeline sends each block's output on; put that code inside the blocks")
    params = [float(sum(p.numel() for p in block.parameters())) for block in container]
    rule: str | list[int] = section.partition
    resolved = None if rule == "time" else tuple(choose_partition(rule, total, params, None))
    return PipelinePlan(section.schedule, micro_batches, section.virtual_stages,
                        tuple(rule) if isinstance(rule, list) else rule, resolved, path, usage)


def _check_user_optimizer(zero_stage: int, tp: int) -> None:
    """A caller's optimizer holds the model's parameter objects: techniques that replace
    them need the optimizer built afterwards (host offload takes over its state, stepped or
    not)."""
    replaced = "zero_optimization.stage > 0" if zero_stage else "tensor_parallel" if tp > 1 else None
    if replaced:
        raise ConfigError(f"{replaced} replaces the model's parameters (shards them), so the optimizer must be "
                          "built afterwards: pass optimizer=None and set config optimizer instead")


def check_optimizer(cfg: Config, user_optimizer: bool = False) -> None:
    """Build the configured optimizer and scheduler over a stand-in parameter: their names
    and parameters fail here, not after the model was changed.

    Raises:
        ConfigError: an unknown optimizer or schedule, or a parameter it rejects.
    """
    try:
        settings = optimizer_settings(cfg)
        stand_in = build_optimizer([nn.Parameter(torch.zeros(1))], settings.type, dict(settings.params)) \
            if not user_optimizer else torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)
        if cfg.scheduler:
            build_scheduler(stand_in, cfg.scheduler.type, cfg.scheduler.params)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _runner_kind(cfg: Config, pp: int, streamed: list[str]) -> StepRunnerKind:
    if pp > 1:
        return "pipeline"
    return "layer_major" if streamed and cfg.layer_streaming.layer_major else "micro_batches"


def _replication(sizes: ParallelSizes, zero_stage: int) -> Replication:
    if sizes.tp > 1 or sizes.pp > 1:
        return "tensor_or_pipeline"
    if sizes.dp == 1:
        return "none"
    return "zero" if zero_stage else "ddp"


def _optimizer(cfg: Config, sizes: ParallelSizes, streaming: bool, accumulation: int) -> OptimizerPlan:
    """ZeRO-Offload on one process (several processes offload inside ZeRO sharding); layer
    streaming updates its streamed blocks on the host, each one bucket (Twin-Flow's
    device share, in resident blocks, on the device)."""
    section = cfg.zero_optimization.offload_optimizer
    if not streaming and (section.device != "cpu" or sizes.world != 1):
        return OptimizerPlan()
    # These need every gradient before any update, so the host step waits for backward.
    defer = cfg.gradient_clipping > 0 or cfg.fp16.enabled or cfg.nonfinite_loss == "skip"
    # Gradients wait in host memory when micro-batches land one by one and are summed there
    # (layer-major streaming sums them on the device and lands each block once).
    summed_on_host = accumulation > 1 and not (streaming and cfg.layer_streaming.layer_major)
    waits = defer or summed_on_host
    on_device = waits and section.gradients_wait == "device"
    return OptimizerPlan(
        placement="host_streamed" if streaming else "host",
        host_ratio=section.ratio,
        defer_step=defer, grads_wait_on_host=waits and not on_device, grads_wait_on_device=on_device,
        pin_memory=cfg.layer_streaming.pin_memory if streaming else section.pin_memory,
        bucket_size=cfg.zero_optimization.reduce_bucket_size,
        device_share_first=section.device_share == "first",
    )

