"""Read a DeepSpeed checkpoint (its layout, any ZeRO stage, any data-parallel size)
into whole, named tensors: what ``load_checkpoint`` restores and ``zero_to_fp32`` exports.

ZeRO-1/2: each optimizer group's flat fp32 masters and flat optimizer state (``exp_avg`` …)
are put back together from every rank's slice and cut into parameters by the names and
shapes the model-states file lists (``param_shapes``). Without ZeRO the model-states file
holds the torch optimizer's own state dict (its parameters by index). ZeRO-3: see :mod:`.zero3`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridtrain.deepspeed.checkpoint import files, flat, zero3

# What the model-states file holds besides the caller's client state (DeepSpeed's own keys).
ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info"})


@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint read whole.

    ``module``: the module's state dict as saved (bit16 under bf16/fp16);
    ``fp32``: each trained parameter's fp32 master by name (ZeRO), empty without ZeRO;
    ``groups``: per optimizer group, its parameter names (ZeRO; empty without);
    ``optimizer_state``: per parameter name, its optimizer state (whole tensors; ZeRO);
    ``torch_optimizer``: the torch optimizer's state dict (no ZeRO);
    ``param_groups``: each group's hyperparameters (no ``params``);
    ``wrapper_masters``: without ZeRO under bf16/fp16, the fp32 masters DeepSpeed's wrapper saved, per
    group in its parameters' order (``FP16_UnfusedOptimizer``: one tensor per parameter;
    ``FP16_Optimizer``: one flat tensor).
    """

    path: Path
    model_states: dict[str, Any]
    stage: int
    module: dict[str, torch.Tensor]
    fp32: dict[str, torch.Tensor] = field(default_factory=dict)
    groups: list[list[str]] = field(default_factory=list)
    optimizer_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    torch_optimizer: dict[str, Any] | None = None
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    loss_scale: float | None = None
    wrapper_masters: list[Any] | None = None
    scaler_state: dict[str, Any] | None = None

    @property
    def client_state(self) -> dict[str, Any]:
        """What the caller passed as ``client_state`` when saving."""
        return {k: v for k, v in self.model_states.items() if k not in ENGINE_KEYS}

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in fp32: masters where ZeRO kept them, else the module's entries
        (floating ones cast to fp32); shared parameters under each of their names."""
        state = {k: (v.float() if v.is_floating_point() else v) for k, v in self.module.items()}
        state.update(self.fp32)
        for alias, owner in (self.model_states.get("shared_params") or {}).items():
            if owner in state:
                state[alias] = state[owner]
        return state


def read(tag_dir: Path, with_optimizer: bool = True) -> DeepSpeedState:
    """Read DeepSpeed's checkpoint ``tag_dir`` (a ``global_stepN`` directory).

    Raises:
        UnreadableDeepSpeedFile: a file is missing or holds more than checkpoint data.
        NotImplementedError: a model-parallel checkpoint.
    """
    if zero3.is_zero3_layout(tag_dir):
        return _read_zero3(tag_dir, with_optimizer)
    if not (tag_dir / files.MODEL_STATES).is_file():
        raise files.UnreadableDeepSpeedFile(f"{tag_dir} has no {files.MODEL_STATES}")
    model_states = files.read(tag_dir / files.MODEL_STATES)
    if int(model_states.get("mp_world_size", 1)) != 1:
        raise NotImplementedError(f"{tag_dir} was saved with model parallelism "
                                  f"(mp_world_size={model_states['mp_world_size']}); not supported")
    state = DeepSpeedState(tag_dir, model_states, 0, dict(model_states.get("module") or {}))
    if model_states.get("param_shapes") is None:
        torch_optimizer = model_states.get("optimizer")
        if isinstance(torch_optimizer, dict) and files.OPTIMIZER_STATE_DICT in torch_optimizer:
            # DeepSpeed's fp16/bf16 wrapper: its basic optimizer's state dict and its fp32 masters.
            state.wrapper_masters = torch_optimizer.get("fp32_groups", torch_optimizer.get("fp32_groups_flat"))
            state.scaler_state = _scale_entries(torch_optimizer)
            torch_optimizer = torch_optimizer[files.OPTIMIZER_STATE_DICT]
        if isinstance(torch_optimizer, dict) and "state" in torch_optimizer:
            state.torch_optimizer = torch_optimizer
            state.param_groups = [{k: v for k, v in g.items() if k != "params"}
                                  for g in torch_optimizer.get("param_groups", [])]
        return state
    _read_zero(state, int(model_states["dp_world_size"]), with_optimizer)
    return state


def _scale_entries(saved: dict[str, Any]) -> dict[str, Any] | None:
    """A loss scale's entries (``cur_scale`` and, where kept, ``cur_iter``, ``last_overflow_iter``,
    ``cur_hysteresis``) from a wrapper's state dict or a saved scaler's attributes."""
    if "cur_scale" not in saved:
        return None
    names = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    return {k: saved[k] for k in names if isinstance(saved.get(k), int | float)}


def _read_zero3(tag_dir: Path, with_optimizer: bool) -> DeepSpeedState:
    """A ZeRO-3 checkpoint (:mod:`.zero3`): rank 0's model states, every rank's slices."""
    model_states = files.read(tag_dir / zero3.model_states_name(0))
    ranks = zero3.read_ranks(tag_dir, int(model_states["dp_world_size"]))
    state = DeepSpeedState(tag_dir, model_states, 3, dict(model_states.get("module") or {}))
    param_shapes: list[dict[str, torch.Size]] = model_states["param_shapes"]
    state.fp32, state.optimizer_state, hypers = zero3.unflatten(ranks, param_shapes, with_optimizer)
    state.groups = [list(shapes) for shapes in param_shapes]
    state.param_groups = hypers if len(hypers) == len(param_shapes) else []
    scaler = ranks[0].get("loss_scaler")
    state.loss_scale = float(getattr(scaler, "cur_scale", 1.0)) if scaler is not None else None
    state.scaler_state = _scale_entries(vars(scaler)) if scaler is not None else None
    return state


def _read_zero(state: DeepSpeedState, dp: int, with_optimizer: bool) -> None:
    """Fill ``state`` from every rank's ZeRO-1/2 optimizer file."""
    ranks = []
    for rank in range(dp):
        path = files.optim_states_path(state.path, rank)
        if path is None:
            raise files.UnreadableDeepSpeedFile(f"{state.path} lacks {files.optim_states_name(rank, False)} "
                                                f"(saved by {dp} data-parallel ranks)")
        ranks.append(files.read(path)[files.OPTIMIZER_STATE_DICT])
    state.stage = int(ranks[0].get("zero_stage", 2))
    scaler = ranks[0].get("loss_scaler")
    state.loss_scale = float(getattr(scaler, "cur_scale", 1.0)) if scaler is not None else None
    state.scaler_state = _scale_entries(vars(scaler)) if scaler is not None else None
    param_shapes: list[dict[str, torch.Size]] = state.model_states["param_shapes"]
    gaps = ranks[0].get("param_alignment_paddings") or [None] * len(param_shapes)
    for index, shapes in enumerate(param_shapes):
        names = list(shapes)
        state.groups.append(names)
        merged = torch.cat([r["single_partition_of_fp32_groups"][index].reshape(-1).float() for r in ranks])
        state.fp32.update(zip(names, flat.split(merged, list(shapes.values()), gaps[index]), strict=True))
        if with_optimizer:
            _read_group_optimizer_state(state, ranks, index, names, list(shapes.values()), gaps[index])


def _read_group_optimizer_state(state: DeepSpeedState, ranks: list[dict[str, Any]], index: int, names: list[str],
                                shapes: list[torch.Size], gaps: list[int] | None) -> None:
    """Group ``index``'s base optimizer state, put back together per parameter name."""
    base = [r["base_optimizer_state"] for r in ranks]
    if isinstance(base[0], dict):  # rigid: the torch optimizer's state dict over flat slices (padded)
        entries = [b["state"].get(b["param_groups"][index]["params"][0], {}) for b in base]
        hypers = base[0]["param_groups"][index]
        unpadded = [r["single_partition_of_fp32_groups"][index].numel() for r in ranks]
    else:  # elastic: one dict per group, slices without padding, the step beside them
        entries = [b[index] for b in base]
        hypers = {}
        unpadded = [r["single_partition_of_fp32_groups"][index].numel() for r in ranks]
        if "base_optimizer_state_step" in ranks[0]:
            entries = [{**e, "step": ranks[0]["base_optimizer_state_step"]} for e in entries]
    state.param_groups.append({k: v for k, v in hypers.items() if k != "params"})
    per_name: dict[str, dict[str, Any]] = {name: {} for name in names}
    for key, first in entries[0].items():
        if torch.is_tensor(first) and first.dim() == 1 and first.numel() >= unpadded[0] and \
                sum(unpadded) >= sum(math.prod(s) for s in shapes):
            merged = torch.cat([e[key].reshape(-1)[:n] for e, n in zip(entries, unpadded, strict=True)])
            for name, value in zip(names, flat.split(merged, shapes, gaps), strict=True):
                per_name[name][key] = value
        else:  # a scalar such as Adam's step: the same for every parameter of the group
            for name in names:
                per_name[name][key] = first.clone() if torch.is_tensor(first) else torch.tensor(float(first))
    state.optimizer_state.update(per_name)
