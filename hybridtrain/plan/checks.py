"""What this build can run: settings that load but need something this process lacks
(more processes) or a technique not available yet are refused here, before any work,
with a message naming the setting and what it needs."""

from __future__ import annotations

from hybridtrain.config.batch_sizes import resolve_batch_sizes
from hybridtrain.config.loading import ConfigError
from hybridtrain.config.schema import MULTI_STAGE_SCHEDULES, Config
from hybridtrain.parallel.mesh import resolve_sizes


def parallel_sizes(cfg: Config, world_size: int) -> tuple[int, int, int]:
    """The ``(dp, tp, pp)`` sizes of this run (``-1`` resolved), checked against the world size.

    Raises:
        ConfigError: sizes that do not multiply to / divide the world size.
    """
    tp = _one_of(cfg.tensor_model_parallel_size, "tensor_model_parallel_size", cfg.tensor_parallel.size,
                 "tensor_parallel.size")
    pp = _one_of(cfg.pipeline_model_parallel_size, "pipeline_model_parallel_size", cfg.pipeline.stages,
                 "pipeline.stages")
    try:
        return resolve_sizes(world_size, cfg.data_parallel.size, tp, pp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _one_of(value: int, name: str, alias: int, alias_name: str) -> int:
    # DeepSpeed's flat key and our section's key name one setting; 1 is "not set".
    if value > 1 and alias > 1 and value != alias:
        raise ConfigError(f"{name}={value} but {alias_name}={alias}; they are the same setting, set only one")
    return max(value, alias)


def check_supported(cfg: Config, world_size: int) -> None:
    """Raise :class:`ConfigError` for the first setting this run cannot honour."""
    dp, tp, pp = parallel_sizes(cfg, world_size)
    if cfg.device_map and (cfg.zero_optimization.stage > 0 and dp > 1 or tp > 1 or pp > 1):
        raise ConfigError("device_map (model parallel inside one process) does not compose with ZeRO "
                          "sharding, tensor or pipeline parallel; remove device_map or those settings")
    _check_offload_combinations(cfg, dp, tp, pp)
    _check_model_parallel(cfg, dp, tp, pp)


def _check_offload_combinations(cfg: Config, dp: int, tp: int, pp: int) -> None:
    """Activation swapping, optimizer offload and layer streaming: what does not compose."""
    streaming = cfg.layer_streaming.enabled
    swapping = cfg.activation_offload.enabled or cfg.activation_checkpointing.cpu_checkpointing
    offload_optimizer = cfg.zero_optimization.offload_optimizer.device == "cpu"
    problems = {
        "layer_streaming.layer_major needs layer_streaming.enabled: true":
            cfg.layer_streaming.layer_major and not streaming,
        f"layer_streaming.keep_blocks_for_backward = {cfg.layer_streaming.keep_blocks_for_backward} needs "
        "layer_streaming.enabled: true (it keeps streamed blocks on the device); set it to 0":
            cfg.layer_streaming.keep_blocks_for_backward != 0 and not streaming,
        "layer_streaming runs on one process; remove data/tensor/pipeline parallel or layer_streaming":
            streaming and (dp > 1 or tp > 1 or pp > 1),
        "layer_streaming already keeps optimizer state in host memory; remove "
        "zero_optimization.offload_optimizer":
            streaming and offload_optimizer,
        "activation_checkpointing.module_classes cannot be combined with layer_streaming (it checkpoints the "
        "blocks that stay on the device, every_n_blocks of them); allowed: module_classes = []":
            streaming and cfg.activation_checkpointing.enabled and bool(cfg.activation_checkpointing.module_classes),
        "device_map does not compose with layer_streaming, activation_offload or optimizer offload; "
        "remove device_map or those settings":
            bool(cfg.device_map) and (streaming or swapping or offload_optimizer),
        "activation_offload and layer_streaming run on one process; remove tensor/pipeline parallel":
            swapping and (tp > 1 or pp > 1),
    }
    for reason, applies in problems.items():
        if applies:
            raise ConfigError(reason)


def _check_model_parallel(cfg: Config, dp: int, tp: int, pp: int) -> None:
    """Tensor and pipeline parallel: what they need and what they do not compose with."""
    if tp == 1 and pp == 1:
        return
    if cfg.zero_optimization.stage > 0 and dp > 1 and pp > 1 and cfg.pipeline.schedule == "zero_bubble":
        # Its weight-gradient pass calls autograd.grad on the stage's parameters, which
        # bypasses FSDP2's gradient hooks, so the reduce-scatter would never happen.
        raise ConfigError("zero_optimization.stage > 0 does not compose with pipeline schedule zero_bubble "
                          "(its split backward bypasses FSDP2's gradient reduce-scatter); use "
                          "interleaved_1f1b or set zero_optimization.stage: 0")
    if cfg.data_parallel.gradient_compression != "none":
        raise ConfigError("data_parallel.gradient_compression needs DDP, which tensor/pipeline parallel "
                          "replaces; set gradient_compression: none")
    if pp == 1:
        return
    section = cfg.pipeline
    accum = cfg.gradient_accumulation_steps
    if section.micro_batches is not None and accum is not None and accum != section.micro_batches:
        raise ConfigError(f"pipeline.micro_batches={section.micro_batches} but gradient_accumulation_steps="
                          f"{accum}; under a pipeline they are the same setting, set only one")
    # Accumulation may be implied by the two other batch sizes; the schedule sees that value.
    micro = section.micro_batches or accum or resolve_batch_sizes(cfg, dp).accumulation_steps
    interleaved = section.schedule in MULTI_STAGE_SCHEDULES
    if section.virtual_stages > 1 and not interleaved:
        raise ConfigError(f"pipeline.virtual_stages={section.virtual_stages} needs schedule interleaved_1f1b "
                          f"or zero_bubble (schedule={section.schedule!r}); set virtual_stages: 1")
    # torch before 2.13 refuses fewer micro-batches than stages for every one-stage-per-rank schedule.
    if section.schedule in ("gpipe", "1f1b") and micro < pp:
        raise ConfigError(f"pipeline schedule {section.schedule} needs at least as many micro-batches as stages "
                          f"(micro_batches={micro}, stages={pp}); set pipeline.micro_batches >= {pp}")
    rounds = max(1, micro // pp)
    if interleaved and micro % rounds:
        raise ConfigError(f"pipeline schedule {section.schedule} needs micro_batches a multiple of "
                          f"{rounds} (micro_batches={micro}, stages={pp}); use {rounds * (micro // rounds + 1)}")
    stages = pp * section.virtual_stages
    if isinstance(section.partition, list) and len(section.partition) != stages:
        raise ConfigError(f"pipeline.partition lists {len(section.partition)} block counts for {stages} stages "
                          f"(stages × virtual_stages); give one count per stage")
