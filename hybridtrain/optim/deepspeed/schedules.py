"""DeepSpeed's learning-rate schedules with DeepSpeed's own formulas, defaults and step
indexing, so that a ``ds_config.json`` schedule gives every step the learning rate
DeepSpeed gives it (``deepspeed/runtime/lr_schedules.py``).

DeepSpeed's schedulers keep ``last_batch_iteration`` (−1 before the first step) and the
engine calls ``step()`` after every optimizer step that was not skipped, so optimizer step
``n`` (0-based) runs with the rate for iteration ``n − 1``::

    WarmupLR        lr(i) = min + (max − min) · γ(i),  γ(−1) = 0,
                    γ(i) = log(i + 1) / log(W)  (warmup_type log, the default)  or  i / W  (linear)
                    for i < W, else 1;  W = max(2, warmup_num_steps), default 1000
    WarmupDecayLR   as WarmupLR, then γ(i) = max(0, (T − i) / max(1, T − W)); warmup_max_lr 0.001
    WarmupCosineLR  lr(i) = lr₀ · ρ(i),  ρ(−1) = 0,  ρ(i) = r + (1 − r) · γ(i) in warm-up,
                    then c + (1 − c) · (1 + cos(π · min(1, (i − W + 1) / max(1, T − W)))) / 2
                    (r = warmup_min_ratio 0, c = cos_min_ratio 0.0001)
    LRRangeTest     lr(i) = min · (1 + rate · k),  k = (i + 1) / step (floored when staircase)
    OneCycle        a triangle from cycle_min_lr to cycle_max_lr and back over the first and
                    second step sizes (optionally in stairs), then decay; β₁ cycles inversely
                    between cycle_max_mom and cycle_min_mom (β₂ is 0.99, as in DeepSpeed)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

DEEPSPEED_SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest", "OneCycle")

_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
                 "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False, "last_batch_iteration": -1},
    "OneCycle": {"cycle_min_lr": None, "cycle_max_lr": None, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
                 "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
                 "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                 "decay_mom_rate": 0.0, "last_batch_iteration": -1},
}

# (learning rate, β₁ or None) at iteration i, given the optimizer's initial learning rate.
Rule = Callable[[int, float], tuple[float, float | None]]


def deepspeed_params(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` completed with DeepSpeed's defaults for schedule ``kind``.

    Raises:
        ValueError: an unknown or missing parameter (one line naming it).
    """
    defaults = _PARAMS[kind]
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise ValueError(f"scheduler.params {unknown} are not parameters of DeepSpeed's {kind}; allowed: "
                         f"{sorted(defaults)}")
    merged = {**defaults, **params}
    missing = [k for k in ("total_num_steps", "cycle_min_lr", "cycle_max_lr")
               if k in defaults and merged[k] is None]
    if missing:
        raise ValueError(f"scheduler.params.{missing[0]} is required by DeepSpeed's {kind}")
    if "warmup_type" in merged and merged["warmup_type"] not in ("log", "linear"):
        raise ValueError(f"scheduler.params.warmup_type = {merged['warmup_type']!r}; allowed: log, linear")
    if "warmup_num_steps" in merged and (not isinstance(merged["warmup_num_steps"], int)
                                        or merged["warmup_num_steps"] <= 0):
        raise ValueError(f"scheduler.params.warmup_num_steps = {merged['warmup_num_steps']!r} must be a "
                         "positive integer (DeepSpeed)")
    return merged


def _warmup(p: dict[str, Any]) -> tuple[int, Callable[[int], float]]:
    steps = max(2, int(p["warmup_num_steps"]))
    if p["warmup_type"] == "log":
        inverse = 1.0 / math.log(steps)  # DeepSpeed's inverse_log_warm_up: the same bits as its rates
        return steps, lambda i: inverse * math.log(i + 1)
    return steps, lambda i: i / steps


def rule(kind: str, p: dict[str, Any]) -> Rule:
    """The schedule's (learning rate, β₁) at iteration ``i`` (see the module docstring)."""
    if kind in ("WarmupLR", "WarmupDecayLR"):
        steps, gamma = _warmup(p)
        total = float(p.get("total_num_steps") or 0)  # WarmupDecayLR only (required there)

        def warmup_lr(i: int, lr0: float) -> tuple[float, float | None]:
            low, high = float(p["warmup_min_lr"]), float(p["warmup_max_lr"] if p["warmup_max_lr"] is not None
                                                            else lr0)
            if i < 0:
                return low, None
            if i < steps:
                g = gamma(i)
            elif kind == "WarmupLR":
                g = 1.0
            else:
                g = max(0.0, (total - i) / max(1.0, total - steps))
            return low + (high - low) * g, None
        return warmup_lr
    if kind == "WarmupCosineLR":
        steps, gamma = _warmup(p)

        def cosine_lr(i: int, lr0: float) -> tuple[float, float | None]:
            if i < 0:
                return 0.0, None
            if i < steps:
                start = float(p["warmup_min_ratio"])
                return lr0 * (start + gamma(i) * (1.0 - start)), None
            progress = min(1.0, (i - steps + 1) / max(1, int(p["total_num_steps"]) - steps))
            floor = float(p["cos_min_ratio"])
            return lr0 * max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2), None
        return cosine_lr
    if kind == "LRRangeTest":
        def range_test_lr(i: int, lr0: float) -> tuple[float, float | None]:
            k = (i + 1) / int(p["lr_range_test_step_size"])
            k = math.floor(k) if p["lr_range_test_staircase"] else k
            return float(p["lr_range_test_min_lr"]) * (1 + float(p["lr_range_test_step_rate"]) * k), None
        return range_test_lr
    return _one_cycle(p)


@dataclass(frozen=True)
class _Cycle:
    first: float
    second: float
    first_stairs: int
    second_stairs: int

    @property
    def total(self) -> float:
        return self.first + self.second

    def scale(self, i: int) -> float:
        batch = i + 1
        x = 1.0 + batch / self.total - math.floor(1 + batch / self.total)
        ratio = self.first / self.total
        up = x <= ratio
        scale = x / ratio if up else (x - 1) / (ratio - 1)
        stairs = self.first_stairs if up else self.second_stairs
        if stairs > 0:
            position = batch % self.total
            scaled = (position * stairs / self.first if position <= self.first
                      else (self.total - position) * stairs / self.second)
            scale = math.floor(scaled) / stairs
        return scale


def _one_cycle(p: dict[str, Any]) -> Rule:
    first = float(p["cycle_first_step_size"])
    second = float(p["cycle_second_step_size"]) if p["cycle_second_step_size"] is not None else first
    first_stairs = int(p["cycle_first_stair_count"])
    second_stairs = first_stairs if p["cycle_second_stair_count"] is None else int(p["cycle_second_stair_count"])
    cycle = _Cycle(first, second, first_stairs, second_stairs)
    low, high = float(p["cycle_min_lr"]), float(p["cycle_max_lr"])
    mom_low, mom_high = float(p["cycle_min_mom"]), float(p["cycle_max_mom"])
    decay_steps = float(p["decay_step_size"])
    skip_lr = math.isclose(decay_steps, 0) or math.isclose(float(p["decay_lr_rate"]), 0)
    skip_mom = math.isclose(decay_steps, 0) or math.isclose(float(p["decay_mom_rate"]), 0)

    def one_cycle(i: int, lr0: float) -> tuple[float, float | None]:
        if i < 0:
            return low, mom_low
        if i < cycle.total:
            s = cycle.scale(i)
            return low + (high - low) * s, mom_high - (mom_high - mom_low) * s
        interval = (i - cycle.total + 1) / decay_steps if decay_steps else 0.0
        lr = low if skip_lr else low / (1 + float(p["decay_lr_rate"]) * interval)
        mom = mom_high if skip_mom else mom_high * (1 + float(p["decay_mom_rate"]) * interval)
        return lr, mom
    return one_cycle


class DeepSpeedSchedule:
    """A DeepSpeed schedule driving an optimizer (see the module docstring).

    Args:
        optimizer: the optimizer whose groups' ``lr`` (and, for ``OneCycle`` with an
            optimizer that has ``betas``, ``betas``) it sets.
        kind: one of :data:`DEEPSPEED_SCHEDULES`.
        params: the config's ``scheduler.params``.

    Raises:
        ValueError: unknown or missing parameters.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, params: dict[str, Any]) -> None:
        p = deepspeed_params(kind, params)
        self.optimizer = optimizer
        self.kind = kind
        self.rule = rule(kind, p)
        self.cycle_momentum = kind == "OneCycle" and bool(p["cycle_momentum"]) and "betas" in optimizer.defaults
        self.initial_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.last_batch_iteration = int(p["last_batch_iteration"])
        self._apply()

    def step(self) -> None:
        """After an optimizer step: the next iteration's rates."""
        self.last_batch_iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The learning rate of each group now."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's scheduler state: the iteration."""
        return {"last_batch_iteration": self.last_batch_iteration, "initial_lrs": self.initial_lrs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` and the rates it implies."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self.initial_lrs = list(state.get("initial_lrs", self.initial_lrs))
        self._apply()

    def _apply(self) -> None:
        for group, lr0 in zip(self.optimizer.param_groups, self.initial_lrs, strict=True):
            lr, beta1 = self.rule(self.last_batch_iteration, lr0)
            group["lr"] = lr
            if self.cycle_momentum and beta1 is not None:
                group["betas"] = (beta1, 0.99)
