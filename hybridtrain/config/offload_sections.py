"""DeepSpeed's ``zero_optimization`` offload sections as DeepSpeed applies them, beside the
DeepSpeed key table (:mod:`hybridtrain.config.deepspeed_keys`): sections a ZeRO stage does
not use are dropped, and ZeRO-3 ``offload_param`` on one process becomes layer streaming.
:func:`hybridtrain.plan.resolve.resolve` applies them once it knows the world size."""

from __future__ import annotations

import logging

from hybridtrain.config.schema import Config

log = logging.getLogger("hybridtrain.plan")


def apply_offload_sections(cfg: Config, world_size: int) -> Config:
    """DeepSpeed's offload settings as DeepSpeed applies them, each mapping said once at
    info level:

    - offload settings of a stage that does not use them (any at stage 0, ``offload_param``
      below stage 3) are ignored, as DeepSpeed ignores them;
    - DeepSpeed's answer to a model too big for one GPU — ZeRO-3 with ``offload_param`` (and
      usually ``offload_optimizer``) on ``cpu``, on one process — runs as our equivalent:
      layer streaming (parameters in host memory, streamed block by block, the update on
      the host). Other sizes keep DeepSpeed's meaning (FSDP2 offload).
    """
    cfg = _drop_unused_offload(cfg)
    if cfg.activation_checkpointing.cpu_checkpointing and not cfg.activation_checkpointing.enabled:
        # DeepSpeed's section only configures checkpoints that model code takes itself.
        log.info("activation_checkpointing.cpu_checkpointing has no effect without "
                 "activation_checkpointing.enabled: true")
    zero = cfg.zero_optimization
    # The parallel sizes multiply to the world size (checked later, in plan/checks.py), so
    # one process means no data, tensor or pipeline parallel.
    if zero.offload_param.device != "cpu" or zero.stage != 3 or world_size != 1 or cfg.layer_streaming.enabled:
        return cfg
    checkpointing = cfg.activation_checkpointing
    streaming = cfg.layer_streaming.model_copy(update={
        "enabled": True, "pin_memory": zero.offload_param.pin_memory or zero.offload_optimizer.pin_memory,
        "boundary_activations": "host" if checkpointing.enabled and checkpointing.cpu_checkpointing else "recompute"})
    log.info("zero_optimization stage %d with offload_param on cpu on one process runs as layer_streaming "
             "(weights in host memory streamed block by block, the optimizer step on the host)", zero.stage)
    return cfg.model_copy(update={
        "layer_streaming": streaming,
        "activation_checkpointing": checkpointing.model_copy(update={"enabled": False, "cpu_checkpointing": False}),
        "zero_optimization": zero.model_copy(update={
            "offload_param": zero.offload_param.model_copy(update={"device": "none"}),
            "offload_optimizer": zero.offload_optimizer.model_copy(update={"device": "none"})}),
    })


def _drop_unused_offload(cfg: Config) -> Config:
    zero = cfg.zero_optimization
    unused = [name for name, section in (("offload_optimizer", zero.offload_optimizer),
                                         ("offload_param", zero.offload_param))
              if section.device != "none" and (zero.stage == 0 or (name == "offload_param" and zero.stage < 3))]
    if not unused:
        return cfg
    log.info("zero_optimization %s has no effect at stage %d (DeepSpeed offloads %s only in %s); ignored",
             " and ".join(unused), zero.stage, "parameters" if unused == ["offload_param"] else "with ZeRO",
             "stage 3" if unused == ["offload_param"] else "stages 1-3")
    update = {name: getattr(zero, name).model_copy(update={"device": "none"}) for name in unused}
    return cfg.model_copy(update={"zero_optimization": zero.model_copy(update=update)})
