"""DeepSpeed's ZeRO-3 checkpoints (``zero_pp_rank_R_mp_rank_00_model_states.pt`` and
``…_optim_states.pt`` per data-parallel rank): read into whole, named tensors, and each
rank's slices cut from whole tensors to write them (:func:`rank_flat`).

ZeRO-3 cuts every parameter on its own: rank ``r`` holds elements ``[r·p, (r+1)·p)`` of it,
``p = ceil(numel / dp)`` (the last rank's slice padded), and its flat fp32 buffer per
optimizer sub-group is its slices of the sub-group's parameters in order
(``fp32_flat_groups``); the base optimizer's state (``exp_avg`` …) is laid out the same way.
The parameters, in order, are those of the model-states file's ``param_shapes``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from hybridtrain.deepspeed.checkpoint import files


def model_states_name(dp_rank: int) -> str:
    """Rank ``dp_rank``'s ZeRO-3 model-states file."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_00_model_states.pt"


def is_zero3_layout(tag_dir: Path) -> bool:
    """Whether ``tag_dir`` holds a ZeRO-3 checkpoint's files."""
    return (tag_dir / model_states_name(0)).is_file()


def read_ranks(tag_dir: Path, dp: int) -> list[dict[str, Any]]:
    """Every rank's ZeRO-3 optimizer state dict.

    Raises:
        UnreadableDeepSpeedFile: a rank's file is missing or not plain data.
    """
    found = []
    for rank in range(dp):
        path = files.optim_states_path(tag_dir, rank)
        if path is None:
            raise files.UnreadableDeepSpeedFile(f"{tag_dir} lacks {files.optim_states_name(rank, False)} "
                                                f"(saved by {dp} data-parallel ranks)")
        found.append(files.read(path)[files.OPTIMIZER_STATE_DICT])
    return found


def rank_flat(tensors: list[torch.Tensor], dp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s flat buffer of a sub-group's whole ``tensors`` (in order): its slice of
    each, ``ceil(numel / dp)`` elements, zeros past a tensor's end (``fp32_flat_groups``, and
    the base optimizer's state laid out the same way)."""
    pieces = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        part = math.ceil(flat.numel() / dp)
        piece = flat[rank * part:(rank + 1) * part]
        pieces.append(torch.cat([piece, piece.new_zeros(part - piece.numel())]) if piece.numel() < part else piece)
    return torch.cat(pieces).clone() if pieces else torch.zeros(0)


def _whole(flats: list[torch.Tensor], shapes: list[torch.Size], dp: int) -> list[torch.Tensor]:
    """The parameters whose ZeRO-3 slices each rank's ``flats[r]`` holds, in order."""
    out, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        part = math.ceil(numel / dp)
        pieces = [flat[offset:offset + part] for flat in flats]
        out.append(torch.cat(pieces)[:numel].reshape(shape).clone())
        offset += part
    return out


def unflatten(ranks: list[dict[str, Any]], param_shapes: list[dict[str, torch.Size]],
              with_optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]],
                                             list[dict[str, Any]]]:
    """The fp32 masters by name, the optimizer state by name, each sub-group's hyperparameters."""
    dp = len(ranks)
    names = [n for shapes in param_shapes for n in shapes]
    shapes = [s for group in param_shapes for s in group.values()]
    rank_flats = [torch.cat([g.reshape(-1).float() for g in r["fp32_flat_groups"]]) for r in ranks]
    fp32 = dict(zip(names, _whole(rank_flats, shapes, dp), strict=True))
    optimizer_state: dict[str, dict[str, Any]] = {name: {} for name in names}
    base = [r["optimizer_state_dict"] for r in ranks]
    hypers = [{k: v for k, v in g.items() if k != "params"} for g in base[0].get("param_groups", [])]
    if not with_optimizer:
        return fp32, {}, hypers
    sub_groups = [base[0]["state"].get(g["params"][0], {}) for g in base[0]["param_groups"]]
    for key, first in (sub_groups[0].items() if sub_groups and all(sub_groups) else ()):
        if torch.is_tensor(first) and first.dim() == 1:
            flats = [torch.cat([b["state"][g["params"][0]][key].reshape(-1) for g in b["param_groups"]]) for b in base]
            for name, value in zip(names, _whole(flats, shapes, dp), strict=True):
                optimizer_state[name][key] = value
        else:  # a scalar such as Adam's step
            for name in names:
                optimizer_state[name][key] = first.clone() if torch.is_tensor(first) else torch.tensor(float(first))
    return fp32, optimizer_state, hypers
