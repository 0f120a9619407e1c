"""The engine behind ``deepspeed.initialize``: the caller's optimizer and scheduler
arguments read as DeepSpeed reads them, and DeepSpeed's fp16 init step decided
(:func:`takes_fp16_init_step`) and stated in the config handed down the one road
(:func:`hybridtrain.prepare.prepare`).

Shared by plain models (built at ``initialize``) and pipeline modules (built once the
first micro-batch shows the activation shapes, when ``initialize`` had no data).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridtrain.compose import check_plain_initialize
from hybridtrain.config import Config, ConfigError
from hybridtrain.config.deepspeed_keys import deepspeed_takes_fp16_init_step
from hybridtrain.config.loading import config_as_written
from hybridtrain.deepspeed.client_optimizer import describe, lay_groups, with_optimizer
from hybridtrain.deepspeed.loss_scale import DeepSpeedLossScale
from hybridtrain.deepspeed.master_weights import MasterWeightsOptimizer, NormRule, cast_parameters
from hybridtrain.deepspeed.runtime.zero import stage3_masters
from hybridtrain.deepspeed.zero_gradients import averaging_from_config
from hybridtrain.engine import Engine
from hybridtrain.optim import FP16_INIT_STEP
from hybridtrain.prepare import Prepared, prepare
from hybridtrain.runtime.batch import Batch, LossFn


def takes_fp16_init_step(raw: Mapping[str, Any], client: bool) -> bool:
    """Whether DeepSpeed's fp16 wrapper takes the fp16 init step (one step with zero gradients
    when it is built; :func:`hybridtrain.config.deepspeed_keys.deepspeed_takes_fp16_init_step`)
    on the config's own optimizer section or a caller's optimizer (without either DeepSpeed
    has no optimizer; hybridtrain's default one takes no such step). A DeepSpeed rule,
    applied here and stated in the config handed down the one road (:func:`build_engine`);
    loading a config adds nothing.

    Args:
        raw: the DeepSpeed config as written (after this layer's own rewrites).
        client: the caller gave ``deepspeed.initialize`` an optimizer.
    """
    return deepspeed_takes_fp16_init_step(dict(raw)) and (client or isinstance(raw.get("optimizer"), Mapping))


_OWN_FP16_PATH = ("lamb", "onebitadam", "zerooneadam", "onebitlamb")
"""Config optimizers DeepSpeed's fp16 wrapper steps through their own fused paths."""


def master_weights(raw: Mapping[str, Any], cfg: Config) -> bool:
    """Whether this run trains as DeepSpeed's bf16/fp16 does: half weights, fp32 masters in the
    optimizer (:mod:`hybridtrain.deepspeed.master_weights`) instead of autocast over fp32 weights.
    The one decision: the drop-in and ``hybridtrain.initialize`` with ``precision_math: deepspeed``
    both take it. An fp32 run takes the same wrapper, over fp32 weights, under ZeRO-1/2 on several
    processes (:func:`fp32_partitioned_masters`).

    ``precision_math: autocast`` says no. Otherwise DeepSpeed's math runs for ``bf16.enabled`` or
    ``fp16.enabled`` with gradients accumulating in the model's dtype (no
    ``data_types.grad_accum_dtype``) without tensor/pipeline parallel, parameter offload or streaming:
    ZeRO stage 0 on any number of processes without offload (DeepSpeed's ``FP16_Optimizer``, its engine
    averaging the gradients over the processes); stages 1 and 2 on any number of processes, with or
    without ZeRO-Offload to the CPU (``DeepSpeedZeroOptimizer``; both averagings
    :mod:`hybridtrain.deepspeed.zero_gradients` holds; offloaded, the masters and
    optimizer live in host memory); stage 3 on any number of processes with or without
    ``offload_optimizer`` to the CPU (the whole update: not a partial ``ratio``), and with ``offload_param``
    to the CPU on several processes (FSDP2 offloads the half shards; on one process that offload is
    layer streaming, which keeps autocast; a model with no blocks to stream keeps its parameters on the
    device instead, :func:`without_unstreamable_param_offload`, applied to ``cfg`` before this decision)
    (``DeepSpeedZeroOptimizer_Stage3``: :mod:`hybridtrain.deepspeed.runtime.zero.stage3_masters`); and for
    fp16 not over the config's LAMB or 1-bit optimizers (DeepSpeed's fp16 wrapper steps those through
    their own fused paths, which take the loss scale themselves). Elsewhere the engine keeps autocast,
    unless the config says ``precision_math: deepspeed``, which is then refused.

    Raises:
        ConfigError: ``precision_math: deepspeed`` with bf16/fp16 where DeepSpeed's math cannot run
            (one line naming what stands in the way).
    """
    if not (cfg.bf16.enabled or cfg.fp16.enabled):
        return fp32_partitioned_masters(raw, cfg)
    if cfg.precision_math == "autocast":
        return False
    blocker = _deepspeed_math_blocker(raw, cfg)
    if blocker is not None and cfg.precision_math == "deepspeed":
        raise ConfigError(f"precision_math = 'deepspeed' cannot run with {blocker}; allowed there: 'autocast' "
                          "(or leave it unset)")
    return blocker is None


def fp32_partitioned_masters(raw: Mapping[str, Any], cfg: Config) -> bool:
    """Whether an fp32 run takes DeepSpeed's ZeRO-1/2 wrapper too: on several processes, where
    DeepSpeed keeps the module's parameters whole on every rank (``model.state_dict()`` and
    ``named_parameters()`` give plain tensors) and partitions fp32 copies of them with the
    optimizer state (``DeepSpeedZeroOptimizer``, whose arithmetic the wrapper holds: the
    gradients averaged in DeepSpeed's order, its norm and clip); the engine's own ZeRO would
    shard the parameters themselves (DTensors)."""
    zero = cfg.zero_optimization
    return zero.stage in (1, 2) and _world_size() > 1 and _deepspeed_math_blocker(raw, cfg) is None


def _check_deepspeed_math_road(cfg: Config, raw: Mapping[str, Any]) -> None:
    """What DeepSpeed's math cannot take off the drop-in (``hybridtrain.initialize``, ``hybridtrain train``).

    Raises:
        ConfigError: one line naming the field, its value and what is allowed.
    """
    fp16 = raw.get("fp16")
    if cfg.fp16.enabled and isinstance(fp16, Mapping) and fp16.get("auto_cast") is True:
        raise ConfigError("fp16.auto_cast = true casts inputs in the DeepSpeed drop-in's forward only; with "
                          "precision_math = 'deepspeed' the batch is taken as given: allowed false (feed fp16 inputs)")
    if cfg.auto or cfg.oom_recovery.enabled:
        key = "auto" if cfg.auto else "oom_recovery.enabled"
        raise ConfigError(f"{key} = true plans the run's variants under autocast; with precision_math = "
                          "'deepspeed' allowed: false (or precision_math 'autocast')")


def _deepspeed_math_blocker(raw: Mapping[str, Any], cfg: Config) -> str | None:
    """What keeps DeepSpeed's bf16/fp16 math from this run (see :func:`master_weights`), in the
    config's words; None: nothing."""
    zero = cfg.zero_optimization
    data_types = raw.get("data_types")
    accumulation = data_types.get("grad_accum_dtype") if isinstance(data_types, Mapping) else None
    offload = zero.offload_optimizer.device
    stage_offload = {0: ("none",), 1: ("none", "cpu"), 2: ("none", "cpu"), 3: ("none", "cpu")}[zero.stage]
    checks = [
        (cfg.fp16.enabled and cfg.optimizer.type.lower() in _OWN_FP16_PATH, f"optimizer.type = {cfg.optimizer.type!r}"
         " under fp16 (DeepSpeed steps it through its own fused path)"),
        (accumulation is not None, f"data_types.grad_accum_dtype = {accumulation!r}"),
        (offload not in stage_offload, f"zero_optimization.stage = {zero.stage} with offload_optimizer.device = "
         f"{offload!r}"),
        (zero.offload_param.device != "none" and not (zero.stage == 3 and _world_size() > 1),
         f"zero_optimization.offload_param.device = {zero.offload_param.device!r}"
         + (" on one process (layer streaming)" if zero.stage == 3 else "")),
        (zero.stage == 3 and offload != "none" and zero.offload_optimizer.ratio != 1.0,
         f"zero_optimization.offload_optimizer.ratio = {zero.offload_optimizer.ratio} under ZeRO-3"),
        (max(cfg.tensor_parallel.size, cfg.tensor_model_parallel_size or 1) > 1, "tensor parallel"),
        (cfg.pipeline.stages > 1, f"pipeline.stages = {cfg.pipeline.stages}"),
        (cfg.layer_streaming.enabled, "layer_streaming.enabled = true"),
    ]
    return next((why for blocked, why in checks if blocked), None)


def initialize_with_deepspeed_math(model: nn.Module, cfg: Config, raw: Mapping[str, Any],
                                   loss_fn: LossFn | None = None, optimizer: torch.optim.Optimizer | None = None,
                                   example_batch: Batch | None = None) -> Engine:
    """``hybridtrain.initialize`` under ``precision_math: deepspeed``: the engine of
    :func:`prepare_with_deepspeed_math` (which documents the arguments)."""
    return prepare_with_deepspeed_math(cfg, model, loss_fn, optimizer, example_batch, raw).engine


def prepare_with_deepspeed_math(cfg: Config, model: nn.Module, loss_fn: LossFn | None = None,
                                optimizer: torch.optim.Optimizer | None = None, example_batch: Batch | None = None,
                                raw: Mapping[str, Any] | None = None) -> Prepared:
    """The drop-in's engine (:func:`build_prepared`: the same decision :func:`master_weights`, the
    same wrapper) without DeepSpeed's engine surface, for ``hybridtrain.initialize`` and
    ``hybridtrain train`` (:func:`hybridtrain.trainer.run_training`'s ``road``) under
    ``precision_math: deepspeed``; ``engine.train_batch`` then runs DeepSpeed's bf16/fp16 math. The
    plan states ``cfg`` (what a run's ``config.json`` records), not the plain settings the wrapper's
    engine runs. What the drop-in adds and this does not: DeepSpeed's ``gradient_clipping`` default
    of 1.0 (the config's value counts), ``fp16.auto_cast`` (feed half inputs) and
    ``consecutive_hysteresis``.

    Args:
        cfg: the loaded config.
        raw: the config as written (DeepSpeed's fp16 init step and ``data_types`` are read from it;
            None: the keys ``cfg`` was given).

    Raises:
        ConfigError: DeepSpeed's math cannot run with this config (:func:`master_weights`).
    """
    from dataclasses import replace

    raw = raw if raw is not None else config_as_written(cfg)
    _check_deepspeed_math_road(cfg, raw)
    half_weights = master_weights(raw, cfg)
    if half_weights and _world_size() > 1:
        from hybridtrain.deepspeed.comm import init_distributed

        init_distributed(dist_init_required=True)  # the wrapper averages over the group, as under the drop-in
    prepared = build_prepared(model, cfg, takes_fp16_init_step(raw, client=optimizer is not None), optimizer, None,
                              None, loss_fn, example_batch, half_weights=half_weights, raw=raw)
    return Prepared(prepared.engine, replace(prepared.plan, config=cfg))


def build_engine(model: nn.Module, cfg: Config, init_step: bool, optimizer: Any, params: list[Any] | None,
                 lr_scheduler: Any, loss_fn: LossFn | None = None, example_batch: Batch | None = None,
                 half_weights: bool = False, consecutive_hysteresis: bool = False,
                 raw: Mapping[str, Any] | None = None) -> Engine:
    """:func:`hybridtrain.initialize` with ``deepspeed.initialize``'s optimizer arguments (the engine
    of :func:`build_prepared`, which documents the arguments)."""
    return build_prepared(model, cfg, init_step, optimizer, params, lr_scheduler, loss_fn, example_batch,
                          half_weights, consecutive_hysteresis, raw).engine


def build_prepared(model: nn.Module, cfg: Config, init_step: bool, optimizer: Any, params: list[Any] | None,
                   lr_scheduler: Any, loss_fn: LossFn | None = None, example_batch: Batch | None = None,
                   half_weights: bool = False, consecutive_hysteresis: bool = False,
                   raw: Mapping[str, Any] | None = None) -> Prepared:
    """The engine behind ``deepspeed.initialize`` and the plan the one road built it from.

    Args:
        init_step: DeepSpeed's fp16 wrapper takes the fp16 init step
            (:func:`takes_fp16_init_step`); written into ``cfg`` unless it already says.
        optimizer: an optimizer, a callable taking the parameters, or None (the config's).
        params: ``model_parameters`` (parameters or param-group dicts), or None.
        lr_scheduler: a scheduler, a callable taking the optimizer, or None (the config's).
        loss_fn / example_batch: as :func:`hybridtrain.initialize`.
        half_weights: train with DeepSpeed's bf16/fp16 math (:func:`master_weights` decided it).
        consecutive_hysteresis: ``fp16.consecutive_hysteresis`` (read only with ``half_weights``).
        raw: the DeepSpeed config as written (its gradient-averaging keys are read with
            ``half_weights`` on several processes; :func:`~hybridtrain.deepspeed.zero_gradients.
            averaging_from_config`).
    """
    from hybridtrain.optim import build_optimizer, build_scheduler
    from hybridtrain.plan.resolve import optimizer_settings

    rule = _norm_rule(cfg, optimizer)
    cfg = without_unstreamable_param_offload(cfg, model)
    stage3 = None
    if half_weights and cfg.zero_optimization.stage == 3:
        # The engine shards the half parameters (ZeRO-3); the wrapper goes over its optimizer after.
        stage3, cfg, half_weights = cfg, stage3_masters.engine_config(model, cfg), False
    if half_weights:
        # DeepSpeed's bf16 wrapper takes the init step over its fp32 masters; the engine takes none.
        init_step = bool(cfg.optimizer.params.get(FP16_INIT_STEP, init_step))
        cfg = _with_fp16_init_step_set(cfg, False)
    else:
        cfg = with_fp16_init_step(cfg, init_step)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(params if params is not None else model.parameters())
    elif optimizer is None and params is not None and _custom_groups(params, model):
        settings = optimizer_settings(cfg)
        optimizer = build_optimizer(params, settings.type, dict(settings.params))
    if half_weights:
        optimizer, cfg = _with_master_weights(model, cfg, optimizer, params, init_step, rule, consecutive_hysteresis,
                                              raw)
    spec = None
    if isinstance(optimizer, torch.optim.Optimizer) and _replaces_parameters(cfg):
        # The engine shards the parameters before it builds its optimizer: the caller's is
        # rebuilt over the shards (DeepSpeed wraps it instead; same math).
        spec = describe(optimizer, model)
        asked_step = {k: v for k, v in cfg.optimizer.params.items() if k == FP16_INIT_STEP}
        cfg = with_optimizer(cfg, spec, asked_step)
    check_plain_initialize(cfg)
    # zero.Init's partitions go straight into the engine's shards (after a caller's optimizer was named above).
    held = stage3_masters.set_aside_partitions(model, stage3) if stage3 is not None else None
    # The one road; the config states DeepSpeed's fp16 init step (the plan carries it, build
    # takes it before the LR schedule, as DeepSpeed does).
    prepared = prepare(cfg, model, loss_fn, None if spec else optimizer, example_batch)
    engine = prepared.engine
    if isinstance(optimizer, MasterWeightsOptimizer) and optimizer.averages_gradients:
        # DeepSpeed's ZeRO-1/2 wrapper (ZeRO-0: its engine) averages the gradients itself (after_backward); the
        # forward runs the bare model, so the replicas' DDP never reduces them a second time.
        engine.parallel.module = engine.parallel.model
    if spec is not None and lay_groups(engine.optimizer, engine.module, spec) and cfg.scheduler is not None:
        # The config's schedule was built over the one group; it drives the caller's groups.
        engine.scheduler = build_scheduler(engine.optimizer, cfg.scheduler.type, cfg.scheduler.params)
    if stage3 is not None:  # over the caller's groups, laid over the half shards just above
        stage3_masters.wrap_optimizer(engine, stage3, consecutive_hysteresis, held)
    if isinstance(engine.optimizer, MasterWeightsOptimizer):
        # The engine scales each loss, averages after each backward and holds the schedule at a skip as it says.
        engine.own_precision = engine.optimizer
    if isinstance(optimizer, torch.optim.Optimizer) and optimizer is not engine.optimizer:
        # DeepSpeed's ZeRO optimizer updates through the caller's own param_groups, so a
        # scheduler built on the caller's optimizer before initialize (Accelerate's, a
        # Trainer's) sets the rates the update uses; the engine's optimizer (e.g. the host
        # optimizer of an offload) has groups of its own, which the caller's now are.
        optimizer.param_groups = engine.optimizer.param_groups
    if lr_scheduler is not None:
        engine.scheduler = lr_scheduler(engine.optimizer) if callable(lr_scheduler) and not hasattr(
            lr_scheduler, "step") else lr_scheduler
    return prepared


def without_unstreamable_param_offload(cfg: Config, model: nn.Module) -> Config:
    """``cfg`` without ``offload_param`` where the one road would stream the model's repeated
    blocks for it (ZeRO-3 parameter offload on one process,
    :func:`hybridtrain.config.offload_sections.apply_offload_sections`) but the model has none, such as
    transformers' ``RegressionPreTrainedModel`` (two scalar parameters): DeepSpeed offloads
    any model's parameters, so the run trains with them in device memory instead, the same
    math (said once at info level). The optimizer offload stays."""
    from hybridtrain.models.blocks import BlocksNotFoundError, find_block_lists

    zero = cfg.zero_optimization
    if zero.stage != 3 or zero.offload_param.device != "cpu" or cfg.layer_streaming.enabled or _world_size() != 1:
        return cfg
    try:
        find_block_lists(model, cfg.model.blocks)
    except BlocksNotFoundError:
        from hybridtrain.deepspeed.utils import logger

        logger.info(f"zero_optimization.offload_param: {type(model).__name__} has no repeated blocks to stream; "
                    "its parameters stay in device memory (the same math)")
        offload = zero.offload_param.model_copy(update={"device": "none"})
        return cfg.model_copy(update={"zero_optimization": zero.model_copy(update={"offload_param": offload})})
    return cfg


def _with_master_weights(model: nn.Module, cfg: Config, optimizer: torch.optim.Optimizer | None,
                         params: list[Any] | None, init_step: bool, rule: NormRule,
                         consecutive_hysteresis: bool, raw: Mapping[str, Any] | None
                         ) -> tuple[MasterWeightsOptimizer, Config]:
    """The module cast to the half dtype (fp32: as it is) and DeepSpeed's wrapper over the basic
    optimizer (the caller's, else the config's over ``params`` or the model's parameters),
    with fp16's loss scale kept by the wrapper's rule; the config the engine then runs: no
    autocast and no loss scaling or clipping of its own (the wrapper does them as DeepSpeed),
    a non-finite loss skipped (the wrapper then counts an overflow, as DeepSpeed's check of the
    gradients would), and no ZeRO nor offload (the wrapper holds ZeRO-1/2's arithmetic, their
    averaging over several processes and ZeRO-Offload's host masters included)."""
    from hybridtrain.optim import build_optimizer
    from hybridtrain.plan.resolve import optimizer_settings

    fp16 = cfg.fp16.enabled
    half = torch.float16 if fp16 else torch.bfloat16 if cfg.bf16.enabled else torch.float32
    # Read (and refused) before anything changes.
    averaging = averaging_from_config(raw or {}, cfg.zero_optimization.stage, half) if _world_size() > 1 else None
    cast_parameters(model, half)
    if optimizer is None:
        settings = optimizer_settings(cfg)
        optimizer = build_optimizer(params if params is not None else model.parameters(), settings.type,
                                    dict(settings.params))
    scale = None
    if fp16:
        scale = DeepSpeedLossScale.from_config("zero" if rule == "zero" else "stage0", cfg.fp16,
                                               consecutive_hysteresis)
    offload = cfg.zero_optimization.offload_optimizer
    wrapped = MasterWeightsOptimizer(optimizer, cfg.gradient_clipping, rule, fp16_init_step=init_step,
                                     loss_scale=scale, averaging=averaging, offload=offload.device == "cpu")
    # The wrapper holds ZeRO's arithmetic and ZeRO-Offload's host masters: the engine runs neither.
    zero = cfg.zero_optimization.model_copy(update={"stage": 0,
                                                    "offload_optimizer": offload.model_copy(update={"device": "none"})})
    plain = cfg.model_copy(update={"bf16": cfg.bf16.model_copy(update={"enabled": False}),
                                   "fp16": cfg.fp16.model_copy(update={"enabled": False}),
                                   "gradient_clipping": 0.0, "zero_optimization": zero, "precision_math": None,
                                   "nonfinite_loss": "skip"})
    return wrapped, plain


def _norm_rule(cfg: Config, client: Any) -> NormRule:
    """DeepSpeed's bf16 wrapper for this run: ZeRO-1/2's, else ZeRO-0's ``FP16_Optimizer`` over
    its ``FusedAdam`` (the config's Adam/AdamW without ``torch_adam``, deepspeed/runtime/engine.py
    ``get_optimizer_configuration``, or the caller's), else ``FP16_UnfusedOptimizer``.

    Args:
        client: the optimizer argument of ``deepspeed.initialize`` (None: the config's).
    """
    from hybridtrain.deepspeed.ops.adam import FusedAdam

    if cfg.zero_optimization.stage > 0:
        return "zero"
    if client is not None:
        return "fused" if isinstance(client, FusedAdam) else "unfused"
    fused = cfg.optimizer.type.lower() in ("adam", "adamw") and not cfg.optimizer.params.get("torch_adam", False)
    return "fused" if fused else "unfused"


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))


def with_fp16_init_step(cfg: Config, init_step: bool) -> Config:
    """``cfg`` stating DeepSpeed's fp16 init step in ``optimizer.params.fp16_init_step``; a
    value the user wrote there decides instead."""
    if not init_step or FP16_INIT_STEP in cfg.optimizer.params:
        return cfg
    return _with_fp16_init_step_set(cfg, True)


def _with_fp16_init_step_set(cfg: Config, take: bool) -> Config:
    params = {**cfg.optimizer.params, FP16_INIT_STEP: take}
    return cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"params": params})})


def _replaces_parameters(cfg: Config) -> bool:
    """Whether this run's engine replaces the model's parameters (ZeRO over several
    processes, tensor parallel), so that it must build the optimizer itself."""
    world = _world_size()
    tensor_parallel = max(cfg.tensor_parallel.size, cfg.tensor_model_parallel_size or 1)
    return world > 1 and (cfg.zero_optimization.stage > 0 or tensor_parallel > 1)


def _custom_groups(params: list[Any], model: nn.Module) -> bool:
    """Whether ``model_parameters`` asks for more than the config optimizer over all the
    model's trainable parameters: param-group dicts, or a subset of the parameters."""
    if any(isinstance(p, Mapping) for p in params):
        return True
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return {id(p) for p in params} != trainable
