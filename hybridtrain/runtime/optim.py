"""Optimizers by name and learning-rate schedules (DeepSpeed names and our short aliases)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler


def build_optimizer(params: Iterable[torch.nn.Parameter], type_name: str,
                    kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """Instantiate ``torch.optim.<type_name>(params, **kwargs)``.

    DeepSpeed's ``Adam`` params ``adam_w_mode`` (true → AdamW) and ``torch_adam`` are
    understood; names match case-insensitively.

    Raises:
        ValueError: unknown optimizer or invalid keyword (one line naming it).
    """
    kwargs = dict(kwargs)
    if kwargs.pop("adam_w_mode", False) and type_name.lower() == "adam":
        type_name = "AdamW"
    kwargs.pop("torch_adam", None)
    classes = {
        name.lower(): cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
    }
    cls = classes.get(type_name.lower())
    if cls is None:
        raise ValueError(
            f"optimizer.type = {type_name!r} is not a torch.optim optimizer; allowed: "
            + ", ".join(sorted(c.__name__ for c in classes.values()))
        )
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"optimizer.params {kwargs} rejected by {cls.__name__}: {exc}") from None


_SCHEDULE_ALIASES = {
    "constant": "WarmupLR",
    "warmuplr": "WarmupLR",
    "linear": "WarmupDecayLR",
    "warmupdecaylr": "WarmupDecayLR",
    "cosine": "WarmupCosineLR",
    "warmupcosinelr": "WarmupCosineLR",
}
_SCHEDULE_PARAMS = {
    "WarmupLR": {"warmup_num_steps", "warmup_min_ratio", "warmup_type", "warmup_min_lr", "warmup_max_lr", "last_batch_iteration"},
    "WarmupDecayLR": {"warmup_num_steps", "warmup_min_ratio", "warmup_type", "warmup_min_lr",
                      "warmup_max_lr", "total_num_steps", "last_batch_iteration"},
    "WarmupCosineLR": {"warmup_num_steps", "warmup_min_ratio", "warmup_type", "total_num_steps",
                       "cos_min_ratio", "last_batch_iteration"},
}


def lr_factor_fn(type_name: str, params: dict[str, Any]) -> Callable[[int], float]:
    """The multiplier of the base learning rate at optimizer step ``n`` for a schedule.

    Raises:
        ValueError: unknown schedule, unknown or missing parameter.
    """
    kind = _SCHEDULE_ALIASES.get(type_name.lower())
    if kind is None:
        raise ValueError(
            f"scheduler.type = {type_name!r} is unknown; allowed: constant, linear, cosine, "
            "WarmupLR, WarmupDecayLR, WarmupCosineLR"
        )
    unknown = sorted(set(params) - _SCHEDULE_PARAMS[kind])
    if unknown:
        raise ValueError(f"scheduler.params {unknown} are not parameters of {kind}; allowed: "
                         f"{sorted(_SCHEDULE_PARAMS[kind])}")
    warmup = int(params.get("warmup_num_steps", 0))
    start = float(params.get("warmup_min_ratio", 0.0))
    log_warmup = params.get("warmup_type", "linear") == "log"
    if params.get("warmup_type", "linear") not in ("linear", "log"):
        raise ValueError(f"scheduler.params.warmup_type = {params['warmup_type']!r}; allowed: linear, log")
    total = params.get("total_num_steps")
    if kind != "WarmupLR" and (total is None or int(total) <= warmup):
        raise ValueError(f"scheduler.params.total_num_steps = {total!r} must be given for {kind} "
                         f"and exceed warmup_num_steps = {warmup}")
    floor = float(params.get("cos_min_ratio", 0.0))

    def factor(step: int) -> float:
        if step < warmup:
            progress = math.log(step + 1) / math.log(warmup + 1) if log_warmup else step / warmup
            return start + (1.0 - start) * progress
        if kind == "WarmupLR":
            return 1.0
        done = min(1.0, (step - warmup) / (int(total) - warmup))  # type: ignore[arg-type]
        if kind == "WarmupDecayLR":
            return 1.0 - done
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * done))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, type_name: str,
                    params: dict[str, Any]) -> LRScheduler:
    """A ``LambdaLR`` following the named schedule.

    DeepSpeed's ``warmup_max_lr`` sets the optimizer's base learning rate and
    ``warmup_min_lr`` the warm-up start, so a ``ds_config.json`` schedule means the same.
    """
    params = dict(params)
    params.pop("last_batch_iteration", None)
    max_lr = params.pop("warmup_max_lr", None)
    min_lr = params.pop("warmup_min_lr", None)
    if max_lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = float(max_lr)
    if min_lr is not None:
        base = float(max_lr if max_lr is not None else optimizer.param_groups[0]["lr"])
        params["warmup_min_ratio"] = float(min_lr) / base if base else 0.0
    return LambdaLR(optimizer, lr_factor_fn(type_name, params))
