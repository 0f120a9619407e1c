"""``auto: true``: :func:`hybridtrain.initialize` lets the planner choose the plan.

:func:`planned_config` is the first stop of the internal road (``hybridtrain.prepare.prepare``), not
a public way to an engine: call :func:`hybridtrain.initialize`.

The caller's model is estimated as it is (its parameters replaced by meta tensors while
it is traced, nothing copied), on this machine: the device's memory (or
``device_memory_limit``) and the host memory available now.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hybridtrain.config import Config, ConfigError, ConfigSource, load_config
from hybridtrain.parallel import mesh
from hybridtrain.plan.variants import changed_settings
from hybridtrain.planner.estimate import Target, model_source, resolve_target
from hybridtrain.planner.search import choose
from hybridtrain.runtime.batch import Batch, LossFn
from hybridtrain.runtime.device import resolve_device
from hybridtrain.runtime.transfer import available_host_bytes

log = logging.getLogger("hybridtrain")


def planned_config(config: ConfigSource | None, model: nn.Module, loss_fn: LossFn | None,
                   example_batch: Batch | None) -> Config:
    """``config`` itself, or with ``auto: true`` the fastest same-math variant that fits
    this machine (logged once). Without ``example_batch`` nothing can be traced: the config
    is used as it is, and the log says so.

    Raises:
        ConfigError: no variant fits (one line with the numbers), before anything is allocated.
    """
    cfg = load_config(config)
    if not cfg.auto:
        return cfg
    if example_batch is None:
        # DeepSpeed scripts call initialize without a batch: they train as configured.
        log.info("auto: the planner needs one batch of the training shape to trace the model; pass "
                 "initialize(model, config, example_batch=batch) (training as configured)")
        return cfg.model_copy(update={"auto": False})
    target = this_machine(cfg)
    try:
        chosen = choose(cfg, target, mesh.env_world_size(), model=model_source(model, example_batch, loss_fn))
    except ValueError as exc:
        raise ConfigError(f"auto: {exc}") from None
    log.info("auto: the planner chose %s", _differences(cfg, chosen) or "the config as it is")
    return chosen


def this_machine(cfg: Config) -> Target:
    """This machine as a planning target: its device's memory (capped by
    ``device_memory_limit``) and the host memory available now."""
    device = resolve_device(cfg.device)
    target = resolve_target("cpu" if device.type == "cpu" else None)
    memory = target.memory_bytes
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    if cfg.device_memory_limit is not None:
        memory = min(memory, cfg.device_memory_limit) if memory is not None else cfg.device_memory_limit
    return Target(target.kind, target.name, memory, available_host_bytes())


def _differences(before: Config, after: Config) -> str:
    """The settings the planner changed, as ``key: old → new``."""
    return ", ".join(f"{key}: {old!r} → {new!r}" for key, old, new in sorted(changed_settings(before, after))
                     if key != "auto")
