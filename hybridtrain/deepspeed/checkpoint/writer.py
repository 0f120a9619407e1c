"""Write a training engine's state in DeepSpeed's layout (see :mod:`.files`), so that the
real DeepSpeed resumes it (``load_checkpoint``) and its tools read it (``zero_to_fp32``).

Every rank gathers the whole model and optimizer state (collectives, in the same order on
every rank); data-parallel rank 0 writes the model-states file and, under ZeRO-1/2, every
data-parallel rank writes its own slice of the flat fp32 masters and optimizer state, laid
out as DeepSpeed's ZeRO optimizer holds them (:mod:`.flat`).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hybridtrain.checkpoint.training_state import optimizer_param_names
from hybridtrain.deepspeed.checkpoint import files, flat, zero3
from hybridtrain.deepspeed.master_weights import MasterWeightsOptimizer


def _whole(value: Any) -> Any:
    """A CPU copy of ``value``, gathered whole when it is a sharded ``DTensor`` (a collective)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Every name in ``model`` of each parameter ``optimizer`` updates, in its groups' order; the
    fp32 masters of DeepSpeed's bf16 wrapper (:class:`MasterWeightsOptimizer`) count as the
    bfloat16 parameters they update."""
    if not isinstance(optimizer, MasterWeightsOptimizer):
        return optimizer_param_names(model, optimizer)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [names[id(half)] for halves in optimizer.half_groups for half in halves]


def per_element(key: str, value: Any, param_shape: torch.Size) -> bool:
    """Whether optimizer-state entry ``key`` of a parameter of ``param_shape`` holds one value per
    element (Adam's moments), which DeepSpeed's flat optimizers keep flattened with the group's,
    rather than one for the parameter (the step): by shape, and by name where a 0-dim parameter
    gives both the shape ()."""
    return torch.is_tensor(value) and value.shape == param_shape and (value.dim() > 0 or key != "step")


class EngineSnapshot:
    """What a DeepSpeed checkpoint holds, gathered from a hybridtrain engine on every rank.

    ``groups``: per optimizer group, each trained parameter's DeepSpeed name (its first name
    in the model) with its whole optimizer state, in the group's order. ``masters``: the fp32
    masters by name where the optimizer keeps them apart from the (bfloat16) module.
    """

    def __init__(self, engine: Any) -> None:
        engine.wait_for_updates()
        self.engine = engine
        self.model = engine.parallel.model
        self.module = engine.model_state_dict()
        names = param_names(self.model, engine.optimizer)
        self.masters: dict[str, torch.Tensor] = {}
        self.groups: list[list[tuple[str, dict[str, Any]]]] = []
        self.hypers: list[dict[str, Any]] = []
        index = 0
        for group in engine.optimizer.param_groups:
            entries = []
            for param in group["params"]:
                state = engine.optimizer.state.get(param, {})
                entries.append((names[index][0], {k: _whole(v) for k, v in state.items()}))
                if isinstance(engine.optimizer, MasterWeightsOptimizer):
                    self.masters[names[index][0]] = _whole(param)
                index += 1
            self.groups.append(entries)
            self.hypers.append({k: v for k, v in group.items() if k != "params"})

    def fp32(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s fp32 value: its master, else the module's entry."""
        return self.masters[name] if name in self.masters else self.module[name]

    def shared_params(self) -> dict[str, str]:
        """Every further name of a tied parameter → its first name, as DeepSpeed records them."""
        first: dict[int, str] = {}
        shared = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if id(param) in first:
                shared[name] = first[id(param)]
            else:
                first[id(param)] = name
        return shared

    def buffer_names(self) -> list[str]:
        """The module's persistent buffers (state-dict entries that are no parameter)."""
        params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        return [k for k in self.module if k not in params]


def save(engine: Any, config: Any, raw_config: dict[str, Any], tag_dir: Path,
         client_state: dict[str, Any]) -> None:
    """Write ``engine``'s state into ``tag_dir`` in DeepSpeed's layout (call on every rank).

    Args:
        config: hybridtrain's config (ZeRO stage, precision, clipping).
        raw_config: the DeepSpeed config as given (stored as ``ds_config``).
    """
    snapshot = EngineSnapshot(engine)
    topology = engine.topology
    stage = int(config.zero_optimization.stage)
    bf16 = bool(config.bf16.enabled)
    tag_dir.mkdir(parents=True, exist_ok=True)
    if stage == 3:
        _save_zero3(snapshot, config, raw_config, tag_dir, client_state)
        return
    if stage > 0:
        rank_state = {files.OPTIMIZER_STATE_DICT: {**_zero_state(snapshot, config, topology.dp, topology.dp_rank),
                                                   **_zero_loss_scaler(engine)},
                      "ds_config": raw_config, "ds_version": files.DS_VERSION_WRITTEN}
        files.write_atomically(rank_state, tag_dir / files.optim_states_name(topology.dp_rank, bf16))
    if topology.rank == 0:
        files.write_atomically(_model_states(snapshot, config, raw_config, topology.dp, client_state),
                               tag_dir / files.MODEL_STATES)
        if stage > 0:
            _write_recovery_script(tag_dir.parent)
    engine.parallel.barrier()


def _save_zero3(snapshot: EngineSnapshot, config: Any, raw_config: dict[str, Any], tag_dir: Path,
                client_state: dict[str, Any]) -> None:
    """ZeRO-3's files: every data-parallel rank writes its model-states file (the module's
    parameters as empty tensors, as DeepSpeed's partitioned ones save) and its optimizer file
    (its slice of every parameter, one sub-group per optimizer group; :func:`.zero3.rank_flat`)."""
    engine = snapshot.engine
    dp, rank = engine.topology.dp, engine.topology.dp_rank
    states = _model_states(snapshot, config, raw_config, dp, client_state)
    params = {n for n, _ in snapshot.model.named_parameters(remove_duplicate=False)}
    states["module"] = OrderedDict((k, v.new_empty(0) if k in params else v) for k, v in states["module"].items())
    # DeepSpeed drops the optimizer's empty groups (a Trainer's no-decay group of a model without
    # biases) before ZeRO-3 builds its sub-groups: its files have none, nor do these.
    kept = [(group, hypers) for group, hypers in zip(snapshot.groups, snapshot.hypers, strict=True) if group]
    states.update(param_shapes=[OrderedDict((n, snapshot.module[n].shape) for n, _ in group) for group, _ in kept],
                  frozen_param_shapes=OrderedDict(), shared_params={}, frozen_param_fragments=OrderedDict())
    files.write_atomically(states, tag_dir / zero3.model_states_name(rank))
    state: dict[int, dict[str, Any]] = {}
    for index, (group, _) in enumerate(kept):
        entries = [entry for _, entry in group]
        if entries and all(entries):
            shape = snapshot.fp32(group[0][0]).shape
            state[index] = {key: zero3.rank_flat([e[key] for e in entries], dp, rank)
                            if per_element(key, first, shape) else first
                            for key, first in entries[0].items()}
    # fp16's loss scale as DeepSpeed's ZeRO optimizers keep it; bf16 and fp32 a static 1.0.
    scaler = _zero_loss_scaler(engine).get("loss_scaler", files.StaticLossScaler(1.0))
    optimizer_file = {
        "zero_stage": 3, "loss_scaler": scaler, "dynamic_loss_scale": isinstance(scaler, files.DynamicLossScalerState),
        "overflow": False, "partition_count": dp,
        files.OPTIMIZER_STATE_DICT: {"state": state, "param_groups": [
            {**hypers, "params": [i]} for i, (_, hypers) in enumerate(kept)]},
        "fp32_flat_groups": [zero3.rank_flat([snapshot.fp32(n) for n, _ in group], dp, rank) for group, _ in kept],
    }
    files.write_atomically({files.OPTIMIZER_STATE_DICT: optimizer_file, "ds_config": raw_config,
                            "ds_version": files.DS_VERSION_WRITTEN},
                           tag_dir / files.optim_states_name(rank, bool(config.bf16.enabled)))
    if engine.topology.rank == 0:
        _write_recovery_script(tag_dir.parent)
    engine.parallel.barrier()


def _module_in_saved_dtype(snapshot: EngineSnapshot, config: Any) -> dict[str, torch.Tensor]:
    """The module's state dict as DeepSpeed saves it: bit16 floats under bf16/fp16."""
    half = torch.bfloat16 if config.bf16.enabled else torch.float16 if config.fp16.enabled else None
    if half is None:
        return OrderedDict(snapshot.module)
    return OrderedDict((k, v.to(half) if v.is_floating_point() else v) for k, v in snapshot.module.items())


def _model_states(snapshot: EngineSnapshot, config: Any, raw_config: dict[str, Any], dp: int,
                  client_state: dict[str, Any]) -> dict[str, Any]:
    """The model-states file's dict (DeepSpeed's keys, then the caller's)."""
    engine = snapshot.engine
    stage = int(config.zero_optimization.stage)
    trained = {name for group in snapshot.groups for name, _ in group}
    frozen = OrderedDict((n, p) for n, p in snapshot.model.named_parameters() if n not in trained)
    state: dict[str, Any] = {
        "module": _module_in_saved_dtype(snapshot, config),
        "buffer_names": snapshot.buffer_names(),
        "optimizer": _stage0_optimizer_state(snapshot, engine) if stage == 0 else None,
        "param_shapes": [OrderedDict((n, snapshot.module[n].shape) for n, _ in group) for group in snapshot.groups]
        if stage > 0 else None,
        "frozen_param_shapes": OrderedDict((n, p.shape) for n, p in frozen.items()) if stage == 2 else None,
        "shared_params": snapshot.shared_params() if stage > 0 else None,
        "frozen_param_fragments": OrderedDict((n, snapshot.module[n]) for n in frozen) if stage == 2 else None,
        "lr_scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
        "data_sampler": None, "random_ltd": None,
        "skipped_steps": engine.skipped_steps, "global_steps": engine.global_step,
        "global_samples": engine.global_step * engine.options.batch.global_batch,
        "dp_world_size": dp, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": raw_config, "ds_version": files.DS_VERSION_WRITTEN,
    }
    state.update(client_state)
    return state


def _stage0_optimizer_state(snapshot: EngineSnapshot, engine: Any) -> dict[str, Any]:
    """Without ZeRO: the torch optimizer's state dict; under DeepSpeed's bf16 wrapper, the
    wrapper's (its basic optimizer's state dict and the fp32 masters: per parameter for
    ``FP16_UnfusedOptimizer``, flat per group for ``FP16_Optimizer``, as their ``state_dict``)."""
    inner = _torch_optimizer_state(snapshot)
    optimizer = engine.optimizer
    if not isinstance(optimizer, MasterWeightsOptimizer):
        return inner
    masters = [[snapshot.fp32(name) for name, _ in group] for group in snapshot.groups]
    if optimizer.rule == "fused":
        return {**_stage0_scale_state(optimizer, engine, fused=True),
                files.OPTIMIZER_STATE_DICT: _flat_groups_state(snapshot),
                "fp32_groups_flat": [flat.flatten(group) for group in masters], "clip_grad": float(optimizer.max_norm)}
    return {**_stage0_scale_state(optimizer, engine, fused=False), files.OPTIMIZER_STATE_DICT: inner,
            "fp32_groups": masters}


def _stage0_scale_state(optimizer: MasterWeightsOptimizer, engine: Any, fused: bool) -> dict[str, Any]:
    """The loss-scale entries of a ZeRO-0 wrapper's state dict: fp16's scale as the wrapper
    keeps it; bf16's none (``FP16_Optimizer``) or a fixed 1.0 (``FP16_UnfusedOptimizer``)."""
    scale = optimizer.loss_scale
    if scale is None:
        return {} if fused else {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": engine.global_step}
    entries: dict[str, Any] = {"dynamic_loss_scale": scale.dynamic, "cur_scale": scale.scale,
                               "cur_iter": scale.iteration}
    if scale.dynamic:
        entries.update({"last_overflow_iter": scale.last_overflow, "scale_factor": 2.0, "scale_window": scale.window})
    return entries


def _zero_loss_scaler(engine: Any) -> dict[str, Any]:
    """ZeRO-1/2's loss scaler entry under fp16 (DeepSpeed's ``DynamicLossScaler``, or a static
    ``LossScaler``): the scale DeepSpeed's math keeps, or the engine's own (fp16 under autocast,
    the same update rule); nothing without fp16."""
    optimizer = engine.optimizer
    scale = optimizer.loss_scale if isinstance(optimizer, MasterWeightsOptimizer) else None
    if scale is not None:
        if not scale.dynamic:
            return {"loss_scaler": files.StaticLossScaler(scale.scale)}
        return {"loss_scaler": files.DynamicLossScalerState(scale.state_dict(), scale.window, scale.min_scale,
                                                             scale.hysteresis, scale.consecutive_hysteresis)}
    scaler = engine.scaler
    if scaler is None:
        return {}
    if not scaler.dynamic:
        return {"loss_scaler": files.StaticLossScaler(scaler.scale)}
    state = scaler.state_dict()
    named = {"cur_scale": state["scale"], "cur_iter": state["step"], "last_overflow_iter": state["last_overflow_step"],
             "cur_hysteresis": state["hysteresis_left"]}
    return {"loss_scaler": files.DynamicLossScalerState(named, scaler.window, scaler.min_scale, scaler.hysteresis,
                                                         False)}


def _flat_groups_state(snapshot: EngineSnapshot) -> dict[str, Any]:
    """The state dict of a basic optimizer over one flat master per group (``FP16_Optimizer``
    flattens each group): per-parameter tensors concatenated, scalars (the step) as they are."""
    state: dict[int, dict[str, Any]] = {}
    for index, group in enumerate(snapshot.groups):
        entries = [entry for _, entry in group]
        if entries and all(entries):
            shape = snapshot.fp32(group[0][0]).shape
            state[index] = {key: flat.flatten([e[key] for e in entries]) if per_element(key, first, shape)
                            else _plain_number(first) for key, first in entries[0].items()}
    # DeepSpeed's FusedAdam reads bias_correction from each group (a torch Adam has none: always on).
    groups = [{"bias_correction": True, **hypers, "params": [i]} for i, hypers in enumerate(snapshot.hypers)]
    return {"state": state, "param_groups": groups}


def _plain_number(value: Any) -> Any:
    """A one-element tensor (torch's Adam step) as the Python number FusedAdam keeps."""
    if torch.is_tensor(value) and value.dim() == 0:
        return int(value) if float(value).is_integer() else float(value)
    return value


def _torch_optimizer_state(snapshot: EngineSnapshot) -> dict[str, Any]:
    """Without ZeRO DeepSpeed saves the torch optimizer's own state dict (parameters by index)."""
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    index = 0
    for hypers, group in zip(snapshot.hypers, snapshot.groups, strict=True):
        indices = []
        for _, entry in group:
            if entry:
                state[index] = entry
            indices.append(index)
            index += 1
        param_groups.append({**hypers, "params": indices})
    return {"state": state, "param_groups": param_groups}


def _zero_state(snapshot: EngineSnapshot, config: Any, dp: int, rank: int) -> dict[str, Any]:
    """Data-parallel rank ``rank``'s ZeRO-1/2 optimizer state dict, as DeepSpeed's
    ``Stage1And2ZeroOptimizer.state_dict()`` gives it (non-elastic: the base optimizer's
    state over each group's flat slice, end padding included)."""
    masters, paddings, base_state = [], [], {}
    for index, group in enumerate(snapshot.groups):
        flat_masters = flat.flatten([snapshot.fp32(name) for name, _ in group])
        total = flat_masters.numel()
        masters.append(flat.rank_slice(flat_masters, dp, rank, padded=False))
        paddings.append(flat.paddings(total, dp)[rank])
        entries = [entry for _, entry in group]
        merged: dict[str, Any] = {}
        for key, first in (entries[0].items() if entries and all(entries) else ()):
            if per_element(key, first, snapshot.fp32(group[0][0]).shape):
                merged[key] = flat.rank_slice(flat.flatten([e[key] for e in entries]), dp, rank, padded=True)
            else:
                merged[key] = first
        if merged:
            base_state[index] = merged
    base = {"state": base_state,
            "param_groups": [{**hypers, "params": [i]} for i, hypers in enumerate(snapshot.hypers)]}
    return {
        "dynamic_loss_scale": bool(config.fp16.enabled), "overflow": False,
        "clip_grad": float(config.gradient_clipping),
        "base_optimizer_state": base,
        "single_partition_of_fp32_groups": masters,
        "zero_stage": int(config.zero_optimization.stage),
        "group_paddings": paddings,
        "param_alignment_paddings": [[0] * len(group) for group in snapshot.groups],
        "partition_count": [dp] * len(snapshot.groups),
        "ds_version": files.DS_VERSION_WRITTEN,
    }


_RECOVERY_SCRIPT = '''#!/usr/bin/env python
"""Recover the whole fp32 model from the DeepSpeed checkpoint in this directory:
    python zero_to_fp32.py . OUTPUT_DIR [-t TAG] [--safe_serialization] [--exclude_frozen_parameters]
Written by hybridtrain's DeepSpeed drop-in; runs on hybridtrain, else on the real DeepSpeed."""
import runpy
import sys

try:
    from hybridtrain.deepspeed.utils.zero_to_fp32 import main
except ImportError:
    runpy.run_module("deepspeed.utils.zero_to_fp32", run_name="__main__")
else:
    sys.exit(main())
'''


def _write_recovery_script(save_dir: Path) -> None:
    """``zero_to_fp32.py`` beside the tags, executable, as DeepSpeed leaves it."""
    script = save_dir / files.RECOVERY_SCRIPT
    script.write_text(_RECOVERY_SCRIPT)
    script.chmod(script.stat().st_mode | 0o111)
