"""The per-bucket optimizers of the host optimizer
(:mod:`~hybridtrain.runtime.offload.optimizer`): the user's optimizer class over a part
of the parameters, sharing the outer optimizer's state and following its groups'
hyperparameters (which the LR scheduler edits)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

NOT_HYPERPARAMS = ("params", "fused", "foreach", "capturable", "differentiable")
"""Group entries that are not the update's hyperparameters."""


def groups_over(optimizer: torch.optim.Optimizer, master_of: Mapping[int, nn.Parameter]) -> list[dict[str, Any]]:
    """``optimizer``'s parameter groups with each parameter replaced by its host master
    (``master_of``, by the parameter's ``id``) where it has one."""
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [master_of.get(id(p), p) for p in g["params"]]} for g in optimizer.param_groups]


def state_over(optimizer: torch.optim.Optimizer, master_of: Mapping[int, nn.Parameter]) -> dict[Any, Any]:
    """``optimizer``'s state (one that has stepped), unchanged, keyed as :func:`groups_over`
    keys the parameters: a host master's state moves to the host with it, a parameter
    without one (device-kept, twin-flow) keeps its state where it is."""
    state: dict[Any, Any] = {}
    for p, entry in optimizer.state.items():
        master = master_of.get(id(p))
        if master is None:
            state[p] = entry
        else:
            state[master] = {k: v.to(master.device) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
    return state


def inner_optimizer(cls: Callable[..., torch.optim.Optimizer], outer: torch.optim.Optimizer,
                    params: list[list[nn.Parameter]], group_ids: list[list[int]],
                    fused: bool) -> torch.optim.Optimizer:
    """An optimizer of class ``cls`` over ``params`` (``group_ids``: each one's group in
    ``outer``), one group per outer group, with ``outer``'s state dict (the one
    checkpoints see); ``fused``: torch's fused kernel where the class has one that runs here."""
    by_group: dict[int, list[nn.Parameter]] = {}
    for plist, gids in zip(params, group_ids, strict=True):
        for p, k in zip(plist, gids, strict=True):
            by_group.setdefault(k, []).append(p)
    groups = [{**_hyperparams(outer, k), "params": ps, "_outer": k} for k, ps in by_group.items()]
    accepts_fused = "fused" in inspect.signature(cls).parameters
    kwargs: dict[str, Any] = {"fused": True, "foreach": False} if fused and accepts_fused else {}
    try:
        inner = cls(groups, **kwargs)
    except (RuntimeError, ValueError, TypeError):
        inner = cls(groups)  # no fused kernel for this class on this device
    inner.state = outer.state
    return inner


def sync_hyperparams(inner: torch.optim.Optimizer, outer: torch.optim.Optimizer) -> None:
    """Copy ``outer``'s group hyperparameters into ``inner``'s groups (before each update:
    the LR scheduler edits the outer groups). A tensor value (torch allows a tensor ``lr``,
    which schedulers write in place) is copied too, so an update that runs after the
    scheduler has moved on still sees its own step's value."""
    for group in inner.param_groups:
        for key, value in outer.param_groups[group["_outer"]].items():
            if key not in NOT_HYPERPARAMS:
                group[key] = value.clone() if isinstance(value, torch.Tensor) else value


def _hyperparams(outer: torch.optim.Optimizer, k: int) -> dict[str, Any]:
    return {key: v for key, v in outer.param_groups[k].items() if key not in NOT_HYPERPARAMS}
