"""``deepspeed.initialize(model=PipelineModule(...))``: the module mapped onto hybridtrain's
pipeline.

What maps to what:

- ``num_stages`` → ``pipeline.stages`` when the world has several processes (it must
  divide the world size, as in DeepSpeed; the rest are data-parallel replicas). On one
  process all stages run in it, one after the other (DeepSpeed would need ``num_stages``
  processes): the same math, said once at info level.
- ``partition_method`` → ``pipeline.partition`` as explicit layer counts per stage,
  DeepSpeed's boundaries (:mod:`.partition`); the blocks are ``PipelineModule.layers``.
- tied layers → one module outside the blocks; the stages that use it hold it and sum
  its gradients (hybridtrain's pipeline does this for any shared parameter).
- ``loss_fn`` → the engine's loss on the last stage (:class:`.engine.PipelineLoss`).
- ``activation_checkpoint_interval`` (the module's, or a config
  ``pipeline.activation_checkpoint_interval`` > 0, which DeepSpeed lets override it) →
  checkpointed layers (:meth:`PipelineModule.set_checkpoint_interval`).
- the schedule: ``pipeline.schedule`` (default ``1f1b``, the order of DeepSpeed's
  ``TrainSchedule``); it needs at least as many micro-batches as stages.
- ``training_data`` → DeepSpeed's pipeline loader: micro-batches in dataset order
  (``DistributedSampler(shuffle=False)`` over the replicas), repeating forever.

Across processes the activations that cross a stage boundary must be one floating-point
tensor with the batch first (they are sent between processes), and every layer takes one
tensor; a model passing tuples between layers runs on one process only. Both are
checked on the first micro-batch, before anything is built.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.data.dataloader import default_collate

from hybridtrain.config import Config, ConfigError, load_config
from hybridtrain.config.batch_sizes import resolve_batch_sizes
from hybridtrain.deepspeed.building import build_engine, takes_fp16_init_step
from hybridtrain.deepspeed.comm import init_distributed
from hybridtrain.deepspeed.pipe.engine import PipelineEngine, PipelineLoss, StagePlace
from hybridtrain.deepspeed.pipe.module import PipelineModule
from hybridtrain.deepspeed.utils import RepeatingLoader
from hybridtrain.engine import Engine
from hybridtrain.parallel.mesh import env_world_size
from hybridtrain.plan.checks import parallel_sizes
from hybridtrain.runtime.batch import Batch

log = logging.getLogger("hybridtrain.deepspeed")

# DeepSpeed's pipeline config keys that change nothing here (DeepSpeed's PipelineEngine
# reads the stages, partition and seeding from the PipelineModule, not from the config).
_NO_EFFECT = {
    "pipe_partitioned": "splits activations over tensor-parallel ranks: communication only",
    "grad_partitioned": "splits gradients over tensor-parallel ranks: communication only",
    "use_reentrant": "chooses DeepSpeed's checkpoint function: the same recomputation",
    "seed_layers": "DeepSpeed's PipelineEngine reads PipelineModule(seed_layers=…), not the config",
    "stages": "DeepSpeed's PipelineEngine reads PipelineModule(num_stages=…), not the config",
    "partition": "DeepSpeed's PipelineEngine reads PipelineModule(partition_method=…), not the config",
}


def initialize_pipeline(module: PipelineModule, raw: dict[str, Any], optimizer: Any, params: list[Any] | None,
                        training_data: Any, lr_scheduler: Any, dist_init_required: bool | None,
                        collate_fn: Any, drop_last: bool) -> tuple[PipelineEngine, Any, Any, Any]:
    """``deepspeed.initialize`` for a :class:`PipelineModule` (the arguments as there).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``; the optimizer and
        scheduler are None (unless given) when the engine waits for its first batch.

    Raises:
        ConfigError / ValueError: a setting or module this engine cannot run, before any work.
    """
    world = env_world_size()
    raw, pp, interval, reentrant = pipeline_config(raw, module, world)
    init_step = takes_fp16_init_step(raw, client=optimizer is not None)
    cfg = load_config(raw)
    dp, tp, _ = parallel_sizes(cfg, world)
    batch = resolve_batch_sizes(cfg, dp)
    if pp > 1:
        # Spelled out: the pipeline's schedule checks read it, also where train_batch_size implies it.
        cfg = cfg.model_copy(update={"gradient_accumulation_steps": batch.accumulation_steps})
    if pp > 1 and module.dynamic_shape:
        raise ValueError("PipelineModule(dynamic_shape=True) across processes is not supported (stages exchange "
                         "activations of one shape per micro-batch size); allowed: False, or run on one process")
    if world == 1 and module.num_stages > 1:
        log.info("PipelineModule(num_stages=%d) on one process: its %d stages run in this process one after the "
                 "other (DeepSpeed would need %d processes); the math is the same",
                 module.num_stages, module.num_stages, module.num_stages)
    module.reentrant_rule = reentrant
    if interval:
        module.set_checkpoint_interval(interval)
    if dist_init_required or (dist_init_required is None and world > 1):
        init_distributed(dist_init_required=True)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    place = StagePlace(rank // (dp * tp) if pp > 1 else 0, pp, rank, world)
    loss = PipelineLoss(module.loss_fn)
    build = functools.partial(_build, module, cfg, pp, init_step, optimizer, params, lr_scheduler, loss)
    engine = PipelineEngine(module, cfg, batch, place, build, loss, optimizer, lr_scheduler)
    loader = None
    if training_data is not None:
        sampler: DistributedSampler[Any] = DistributedSampler(training_data, num_replicas=dp, rank=(rank // tp) % dp,
                                                              shuffle=False)
        loader = RepeatingLoader(DataLoader(training_data, batch_size=batch.micro_batch, sampler=sampler,
                                            collate_fn=collate_fn, drop_last=drop_last))
        engine.set_dataloader(loader)
        engine.build(_first_micro_batch(training_data, sampler, batch.micro_batch, collate_fn))
    elif pp == 1:
        engine.build(None)  # one stage per process: nothing to trace
    else:
        log.info("deepspeed.initialize: the pipeline is split at the first train_batch/eval_batch (no training_data "
                 "to take the activation shapes from); engine.optimizer and engine.lr_scheduler exist from then on")
    return engine, engine.optimizer, loader, engine.lr_scheduler


def pipeline_config(raw: dict[str, Any], module: PipelineModule, world: int) -> tuple[dict[str, Any], int, int, bool]:
    """The config with the module's pipeline in hybridtrain's keys.

    Returns:
        ``(config, pipeline processes, checkpoint interval from the config or 0, DeepSpeed's
        use_reentrant)``.

    Raises:
        ConfigError: a setting that contradicts the module or that the pipeline cannot run.
    """
    raw = dict(raw)
    section = dict(raw.get("pipeline") or {})
    interval = section.pop("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise ConfigError(f"pipeline.activation_checkpoint_interval = {interval!r} must be an integer >= 0")
    reentrant = section.get("use_reentrant") is not False
    noted = [f"pipeline.{key} ({note})" for key, note in _NO_EFFECT.items() if section.pop(key, None) is not None]
    if noted:
        log.info("DeepSpeed keys without effect here: %s", "; ".join(noted))
    if section.get("virtual_stages", 1) != 1:
        raise ConfigError(f"pipeline.virtual_stages = {section['virtual_stages']} with a PipelineModule: its "
                          "num_stages are the stages; allowed: 1")
    stages = module.num_stages
    if world > 1 and world % stages:
        raise ConfigError(f"PipelineModule(num_stages={stages}) must divide the world size {world} (as in "
                          f"DeepSpeed); start a multiple of {stages} processes")
    pp = stages if world > 1 else 1
    given = raw.pop("pipeline_model_parallel_size", None)
    if given not in (None, 1, stages):
        raise ConfigError(f"pipeline_model_parallel_size = {given} but PipelineModule(num_stages={stages}); "
                          "leave it out (the module decides)")
    zero = raw.get("zero_optimization") or {}
    if isinstance(zero.get("stage"), int) and zero["stage"] >= 2:
        raise ConfigError(f"zero_optimization.stage = {zero['stage']} with a PipelineModule: DeepSpeed's pipeline "
                          "engine allows ZeRO stages 0 and 1 only; use 0 or 1")
    if pp > 1:
        counts = [module.parts[s + 1] - module.parts[s] for s in range(stages)]
        if 0 in counts:
            raise ConfigError(f"PipelineModule(num_stages={stages}, partition_method={module.partition_method!r}) "
                              f"leaves stage {counts.index(0)} without layers ({len(module.layers)} layers, "
                              f"{counts} per stage); use fewer stages or another partition_method")
        section.update(stages=pp, partition=counts)
    if section:
        raw["pipeline"] = section
    else:
        raw.pop("pipeline", None)
    raw["model"] = {**(raw.get("model") or {}), "blocks": "layers"}
    return raw, pp, interval, reentrant


def _build(module: PipelineModule, cfg: Config, pp: int, init_step: bool, optimizer: Any,
           params: list[Any] | None, lr_scheduler: Any, loss: PipelineLoss, example: Batch) -> Engine:
    if pp > 1:
        check_activations(module, example[0])
        module.pipelined = True  # the split wraps the layers: their checkpointing is fixed from here
    return build_engine(module, cfg, init_step, optimizer, params, lr_scheduler, loss_fn=loss,
                        example_batch=example if pp > 1 else None)


def check_activations(module: PipelineModule, inputs: Any) -> None:
    """Across processes every layer must take one tensor and every stage boundary carry
    one floating-point tensor with the batch first.

    Raises:
        ValueError: naming the first layer that does not (one line).
    """
    flow = module.flow(inputs)
    size = flow[0].shape[0] if isinstance(flow[0], torch.Tensor) and flow[0].dim() else None
    starts = set(module.parts[1:-1])
    for index, value in enumerate(flow[:-1]):
        name = _layer_name(module, index)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"PipelineModule: layer {index} ({name}) receives a {type(value).__name__}; across "
                             "processes hybridtrain's pipeline passes one tensor from layer to layer; run this model "
                             "on one process")
        if index in starts and (not value.is_floating_point() or not value.dim() or value.shape[0] != size):
            raise ValueError(f"PipelineModule: stage {sorted(starts).index(index) + 1} starts at layer {index} "
                             f"({name}), which receives a {value.dtype} tensor of shape {tuple(value.shape)}; "
                             f"activations sent between stages must be floating point with the batch ({size}) "
                             "first; choose another partition_method")


def _layer_name(module: PipelineModule, index: int) -> str:
    func = module.forward_funcs[index]
    return type(func).__name__ if isinstance(func, torch.nn.Module) else getattr(func, "__name__", "function")


def _first_micro_batch(data: Any, sampler: Any, micro: int, collate_fn: Any) -> Batch:
    """This rank's first micro-batch, read from the dataset without touching the random
    generators (a random transform would otherwise shift the training's draws)."""
    indices = list(itertools.islice(iter(sampler), micro))
    with torch.random.fork_rng(devices=[]):
        return (collate_fn or default_collate)([data[i] for i in indices])
