"""Restore a DeepSpeed-layout checkpoint (the real DeepSpeed's, or one the drop-in wrote)
into a hybridtrain engine: weights from the fp32 masters, the optimizer state by parameter
name into this run's own layout (any sharding), the scheduler, the step counters.

DeepSpeed keeps no RNG state in its checkpoints; neither does this restore touch it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridtrain.checkpoint.layout import CheckpointError
from hybridtrain.deepspeed.checkpoint import flat, reader
from hybridtrain.deepspeed.checkpoint.writer import param_names
from hybridtrain.deepspeed.master_weights import MasterWeightsOptimizer

# The model-states keys DeepSpeed's load_checkpoint keeps out of the returned client state.
_NOT_CLIENT_STATE = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
                     "random_ltd")


def load(engine: Any, tag_dir: Path, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
         load_module_only: bool = False) -> dict[str, Any]:
    """Restore ``tag_dir`` into ``engine`` (call on every rank); returns the client state as
    DeepSpeed's ``load_checkpoint`` does (the model-states entries other than its own).

    Raises:
        CheckpointError: the checkpoint's parameters do not match the model's.
    """
    engine.wait_for_updates()
    with_optimizer = load_optimizer_states and not load_module_only
    state = reader.read(tag_dir, with_optimizer=with_optimizer)
    _load_weights(engine, state)
    dropped = list(_NOT_CLIENT_STATE)
    if not load_module_only:
        if with_optimizer:
            _load_optimizer(engine, state)
            dropped.append("optimizer")
        if load_lr_scheduler_states:
            dropped.append("lr_scheduler")
            if engine.scheduler is not None and state.model_states.get("lr_scheduler") is not None:
                engine.scheduler.load_state_dict(state.model_states["lr_scheduler"])
        _load_loss_scale(engine, state, int(state.model_states["skipped_steps"]))
        engine.restore_progress(int(state.model_states["global_steps"]), int(state.model_states["skipped_steps"]))
    return {k: v for k, v in state.model_states.items() if k not in dropped}


def _load_weights(engine: Any, state: reader.DeepSpeedState) -> None:
    """The model's weights (fp32 masters where the checkpoint has them), in this model's dtypes."""
    runtime = engine.parallel
    saved = state.fp32_state_dict()
    shapes = runtime.model_state_shapes()
    problems = [f"missing entry {k!r}" for k in shapes if k not in saved][:3]
    problems += [f"{k!r} has shape {list(saved[k].shape)} in the checkpoint but {list(v)} in the model"
                 for k, v in shapes.items() if k in saved and saved[k].shape != v][:3]
    if problems:
        raise CheckpointError(f"DeepSpeed checkpoint {state.path} does not match this model: " + "; ".join(problems))
    dtypes = {k: v.dtype for k, v in runtime.model.state_dict().items()}
    runtime.load_model_state_dict({k: saved[k].to(dtypes[k]) for k in shapes})
    refresh = getattr(engine.optimizer, "refresh_masters", None)
    if refresh is not None:
        refresh()  # the optimizer's host masters start from the loaded weights
    if isinstance(engine.optimizer, MasterWeightsOptimizer):
        engine.optimizer.load_masters(_masters(engine.optimizer, runtime.model, state, saved))


def _load_loss_scale(engine: Any, state: reader.DeepSpeedState, skipped: int) -> None:
    """fp16 resumes with the saved dynamic loss scale: into DeepSpeed's math's scale
    (:class:`MasterWeightsOptimizer`), or into the engine's own (autocast), whose skipped steps
    are then the checkpoint's."""
    saved = state.scaler_state
    if saved is None:
        return
    scale = getattr(engine.optimizer, "loss_scale", None)
    if isinstance(engine.optimizer, MasterWeightsOptimizer) and scale is not None and scale.dynamic:
        scale.load_state_dict(saved)
    elif engine.scaler is not None and engine.scaler.dynamic:
        engine.scaler.load_state_dict({
            "scale": saved["cur_scale"], "hysteresis_left": saved.get("cur_hysteresis", engine.scaler.hysteresis),
            "step": saved.get("cur_iter", 0), "last_overflow_step": saved.get("last_overflow_iter", -1),
            "skipped_steps": skipped})


def _masters(optimizer: MasterWeightsOptimizer, model: torch.nn.Module, state: reader.DeepSpeedState,
             saved: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 masters of DeepSpeed's bf16 wrapper, in its order: the wrapper's own (without
    ZeRO), else the checkpoint's fp32 values by name (ZeRO's masters, or an fp32 run's weights)."""
    names = [aliases[0] for aliases in param_names(model, optimizer)]
    if state.wrapper_masters is None:
        return [saved[name] for name in names]
    groups = state.wrapper_masters
    if len(groups) != len(optimizer.half_groups):
        raise CheckpointError(f"DeepSpeed checkpoint {state.path} has {len(groups)} fp32 master groups, this "
                              f"run's optimizer {len(optimizer.half_groups)}")
    masters: list[torch.Tensor] = []
    for group, halves in zip(groups, optimizer.half_groups, strict=True):
        shapes = [h.shape for h in halves]
        masters += list(group) if isinstance(group, list | tuple) else flat.split(group.reshape(-1), shapes, None)
    return masters


def _load_optimizer(engine: Any, state: reader.DeepSpeedState) -> None:
    """The optimizer state by parameter name, in this run's layout, through the optimizer's
    own ``load_state_dict`` (its casts, device moves and offload hooks run as usual)."""
    runtime, optimizer = engine.parallel, engine.optimizer
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = param_names(runtime.model, optimizer)
    if state.torch_optimizer is None:
        by_name = state.optimizer_state
    elif _flat_wrapper(state):
        by_name = _by_name_from_flat(state.torch_optimizer, optimizer, names)
    else:
        by_name = _by_name(state.torch_optimizer, names)
    restored: dict[int, dict[str, Any]] = {}
    for index, (param, aliases) in enumerate(zip(params, names, strict=True)):
        saved = next((by_name[n] for n in aliases if n in by_name), None)
        if saved is None:
            continue  # no state when saved (never stepped)
        restored[index] = {key: runtime.from_user_layout(aliases[0], value, param)
                           if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0 else value
                           for key, value in saved.items()}
    current = optimizer.state_dict()
    current["state"] = restored
    if len(state.param_groups) == len(current["param_groups"]):
        current["param_groups"] = [{**mine, **saved, "params": mine["params"]}
                                   for mine, saved in zip(current["param_groups"], state.param_groups, strict=True)]
    groups = optimizer.param_groups
    optimizer.load_state_dict(current)
    # Loading gave the optimizer a new group list; a caller's optimizer and schedulers hold the
    # old one (see hybridtrain.deepspeed.building.build_engine): it gets the loaded groups.
    groups[:] = optimizer.param_groups
    optimizer.param_groups = groups


def _by_name(torch_optimizer: dict[str, Any], names: list[list[str]]) -> dict[str, dict[str, Any]]:
    """A torch optimizer state dict (parameters by index, DeepSpeed's order = this
    optimizer's) keyed by each parameter's first name."""
    if len(names) < len(torch_optimizer["state"]):
        raise CheckpointError(f"the checkpoint's optimizer has state for {len(torch_optimizer['state'])} "
                              f"parameters, this run's optimizer {len(names)}")
    return {names[int(i)][0]: entry for i, entry in torch_optimizer["state"].items()}


def _flat_wrapper(state: reader.DeepSpeedState) -> bool:
    """Whether the checkpoint's optimizer is ``FP16_Optimizer``'s basic optimizer over one
    flat master per group (``fp32_groups_flat``: a tensor per group, not a list)."""
    return bool(state.wrapper_masters) and torch.is_tensor(state.wrapper_masters[0])  # type: ignore[index]


def _by_name_from_flat(torch_optimizer: dict[str, Any], optimizer: Any,
                       names: list[list[str]]) -> dict[str, dict[str, Any]]:
    """The state of a basic optimizer over one flat master per group (``FP16_Optimizer``'s),
    cut into this run's parameters (in their groups' order) and keyed by their first name."""
    if not isinstance(optimizer, MasterWeightsOptimizer):
        raise CheckpointError("this DeepSpeed checkpoint holds FP16_Optimizer's flat fp32 masters; resume it with "
                              "the same bf16/fp16 setting")
    by_name: dict[str, dict[str, Any]] = {}
    first = 0
    for index, halves in enumerate(optimizer.half_groups):
        group_names = [aliases[0] for aliases in names[first:first + len(halves)]]
        first += len(halves)
        entry = torch_optimizer["state"].get(index, {})
        shapes = [h.shape for h in halves]
        per_param: list[dict[str, Any]] = [{} for _ in halves]
        for key, value in entry.items():
            parts = flat.split(value.reshape(-1), shapes) if torch.is_tensor(value) and value.dim() > 0 else \
                [value] * len(halves)
            for target, part in zip(per_param, parts, strict=True):
                # FusedAdam's step is a Python number; torch's Adam keeps a tensor.
                target[key] = part.clone() if torch.is_tensor(part) else torch.tensor(float(part))
        by_name.update(zip(group_names, per_param, strict=True))
    return by_name
