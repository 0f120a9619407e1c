"""What this build can run: settings that load but need something this process lacks
(more processes) or a technique not available yet are refused here, before any work,
with a message naming the setting and what it needs."""

from __future__ import annotations

from hybridtrain.config.loading import ConfigError
from hybridtrain.config.schema import Config
from hybridtrain.parallel.mesh import resolve_sizes


def parallel_sizes(cfg: Config, world_size: int) -> tuple[int, int, int]:
    """The ``(dp, tp, pp)`` sizes of this run (``-1`` resolved), checked against the world size.

    Raises:
        ConfigError: sizes that do not multiply to / divide the world size.
    """
    try:
        return resolve_sizes(world_size, cfg.data_parallel.size, cfg.tensor_model_parallel_size,
                             cfg.pipeline_model_parallel_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_supported(cfg: Config, world_size: int) -> None:
    """Raise :class:`ConfigError` for the first setting this run cannot honour."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    dp = parallel_sizes(cfg, world_size)[0]
    if cfg.device_map and (cfg.zero_optimization.stage > 0 and dp > 1 or tp > 1 or pp > 1):
        raise ConfigError("device_map (model parallel inside one process) does not compose with ZeRO "
                          "sharding, tensor or pipeline parallel; remove device_map or those settings")
    zero = cfg.zero_optimization
    offload = "cpu" in (zero.offload_param.device, zero.offload_optimizer.device)
    if offload and (zero.stage == 0 or dp == 1):
        raise ConfigError(
            f"zero_optimization offload to cpu needs zero_optimization.stage >= 1 and more than one "
            f"data-parallel rank (stage={zero.stage}, data-parallel size={dp}); single-process "
            "offload is not supported yet"
        )
    not_yet = {
        "tensor_model_parallel_size": tp > 1,
        "pipeline_model_parallel_size": pp > 1,
        "zero_optimization.offload_optimizer.device": cfg.zero_optimization.offload_optimizer.device == "nvme",
        "zero_optimization.offload_param.device": cfg.zero_optimization.offload_param.device == "nvme",
        "activation_checkpointing.cpu_checkpointing": cfg.activation_checkpointing.cpu_checkpointing,
        "activation_checkpointing.partition_activations": cfg.activation_checkpointing.partition_activations,
        "activation_checkpointing.contiguous_memory_optimization":
            cfg.activation_checkpointing.contiguous_memory_optimization,
        "activation_checkpointing.number_checkpoints": cfg.activation_checkpointing.number_checkpoints is not None,
        "activation_checkpointing.synchronize_checkpoint_boundary":
            cfg.activation_checkpointing.synchronize_checkpoint_boundary,
        "activation_checkpointing.profile": cfg.activation_checkpointing.profile,
    }
    for key, requested in not_yet.items():
        if requested:
            value = _value_at(cfg, key)
            raise ConfigError(f"config {key} = {value!r} is not supported yet by hybridtrain; remove it or "
                              "set it to its default")


def _value_at(cfg: Config, dotted: str) -> object:
    node: object = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node
