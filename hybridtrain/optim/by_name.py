"""Optimizers by name and learning-rate schedules (DeepSpeed names and our short aliases).

DeepSpeed's own optimizers and schedules live apart (:mod:`hybridtrain.optim.deepspeed`); this
module chooses by name among them, torch's classes and our short schedule names."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.optim.lr_scheduler import LambdaLR

from hybridtrain.optim.deepspeed import (
    DEEPSPEED_OPTIMIZERS,
    DEEPSPEED_SCHEDULES,
    REFUSED_DEEPSPEED_OPTIMIZERS,
    DeepSpeedSchedule,
)
from hybridtrain.optim.uncorrected_adam import AdamWithoutBiasCorrection


def optimizer_state_bytes(optimizer_type: str, params: dict[str, Any] | None = None) -> int:
    """Bytes of optimizer state per fp32 parameter element: two moments for the Adam and Lamb
    families (a third with ``amsgrad``), one for SGD with momentum, none without. The one
    count the planner, optimizer offload's host-memory check and the trainer's model-size
    check use.

    Args:
        optimizer_type: a config's ``optimizer.type`` or an optimizer's class name.
        params: its settings (``momentum``, ``amsgrad``), or an optimizer's ``defaults``.
    """
    name = optimizer_type.lower()
    params = params or {}
    if "adam" in name:
        return 8 + (4 if params.get("amsgrad") else 0)
    if name == "sgd":
        return 4 if float(params.get("momentum", 0.0) or 0.0) else 0
    if name in ("adagrad", "rmsprop"):
        return 4
    return 8


def build_optimizer(params: Iterable[torch.nn.Parameter], type_name: str,
                    kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """Instantiate an optimizer by name as DeepSpeed builds it: ``Adam``/``AdamW`` follow
    DeepSpeed's rules (``adam_w_mode`` defaults to true, so ``Adam`` with weight decay is
    decoupled AdamW; ``weight_decay`` defaults to 0 as in DeepSpeed's FusedAdam, unless
    ``torch_adam`` asks for torch's class and its defaults; ``bias_correction: false`` is
    :class:`AdamWithoutBiasCorrection`); ``Lamb``, ``OneBitAdam``, ``ZeroOneAdam`` and
    ``OneBitLamb`` are DeepSpeed's (:data:`DEEPSPEED_OPTIMIZERS`; the 1-bit ones on one
    process); any other name is the ``torch.optim`` class of that name (case-insensitive).
    DeepSpeed's fp16 init step is no optimizer argument: the plan asks for it
    (:attr:`hybridtrain.plan.types.OptimizerSettings.fp16_init_step`) and
    :func:`hybridtrain.optim.init_step.take_fp16_init_step` takes it.

    Raises:
        ValueError: unknown optimizer, one whose math torch lacks, or an invalid keyword
            (one line naming it).
    """
    kwargs = dict(kwargs)
    if "max_grad_norm" in kwargs:  # deepspeed/runtime/engine.py, _configure_basic_optimizer
        raise ValueError(f"optimizer.params.max_grad_norm = {kwargs['max_grad_norm']!r}: DeepSpeed refuses it as an "
                         "optimizer parameter too ('please switch to using the deepspeed parameter "
                         "gradient_clipping'); use gradient_clipping")
    return _build(params, type_name, kwargs)


def _build(params: Iterable[torch.nn.Parameter], type_name: str, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    betas = kwargs.get("betas")
    if betas is not None and not (isinstance(betas, list | tuple) and len(betas) == 2
                                  and all(isinstance(b, int | float) for b in betas)):
        raise ValueError(f"optimizer.params.betas = {betas!r} must be two numbers [beta1, beta2]")
    name = type_name.lower()
    if name in REFUSED_DEEPSPEED_OPTIMIZERS:
        raise ValueError(f"optimizer.type = {type_name!r} ({REFUSED_DEEPSPEED_OPTIMIZERS[name]}) is a DeepSpeed "
                         "optimizer hybridtrain does not implement; the nearest is AdamW")
    if name in DEEPSPEED_OPTIMIZERS:
        try:
            return DEEPSPEED_OPTIMIZERS[name](params, **kwargs)
        except TypeError as exc:  # an unknown keyword; the classes' own ValueErrors name their field
            raise ValueError(f"optimizer.params {kwargs} rejected by DeepSpeed's {type_name}: {exc}") from None
    if name in ("adam", "adamw"):
        decoupled = kwargs.pop("adam_w_mode", True) if name == "adam" else True
        kwargs.pop("adam_w_mode", None)
        torch_adam = kwargs.pop("torch_adam", False)
        corrected = kwargs.pop("bias_correction", True)
        if not torch_adam:
            kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed's FusedAdam/DeepSpeedCPUAdam default
        if not corrected:
            try:
                return AdamWithoutBiasCorrection(params, decoupled=bool(decoupled), **kwargs)
            except (TypeError, ValueError, IndexError) as exc:  # torch indexes betas[1] unchecked
                raise ValueError(f"optimizer.params {kwargs} rejected by Adam without bias correction: "
                                 f"{exc}") from None
        type_name = "AdamW" if decoupled else "Adam"
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
            + "; DeepSpeed's Lamb, OneBitAdam, ZeroOneAdam, OneBitLamb"
        )
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError, IndexError) as exc:  # torch indexes betas[1] unchecked
        raise ValueError(f"optimizer.params {kwargs} rejected by {cls.__name__}: {exc}") from None


# Our short names: warm-up (linear unless warmup_type: log) then constant, linear decay or
# cosine decay, with the rate of optimizer step n computed from n.
_SCHEDULE_ALIASES = {
    "constant": "WarmupLR",
    "linear": "WarmupDecayLR",
    "cosine": "WarmupCosineLR",
}
_SCHEDULE_PARAMS = {
    "WarmupLR": {"warmup_num_steps", "warmup_min_ratio", "warmup_type", "warmup_min_lr", "warmup_max_lr",
                 "last_batch_iteration"},
    "WarmupDecayLR": {"warmup_num_steps", "warmup_min_ratio", "warmup_type", "warmup_min_lr",
                      "warmup_max_lr", "total_num_steps", "last_batch_iteration"},
    "WarmupCosineLR": {"warmup_num_steps", "warmup_min_ratio", "warmup_type", "total_num_steps",
                       "cos_min_ratio", "last_batch_iteration"},
}


def lr_factor_fn(type_name: str, params: dict[str, Any]) -> Callable[[int], float]:
    """The multiplier of the base learning rate at optimizer step ``n`` for one of our
    short-named schedules (``constant``, ``linear``, ``cosine``).

    Raises:
        ValueError: unknown schedule, unknown or missing parameter.
    """
    kind = _SCHEDULE_ALIASES.get(type_name.lower())
    if kind is None:
        raise ValueError(
            f"scheduler.type = {type_name!r} is unknown; allowed: constant, linear, cosine (ours), "
            f"{', '.join(DEEPSPEED_SCHEDULES)} (DeepSpeed's, exact)"
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


class Scheduler(Protocol):
    """What the engine asks of a learning-rate schedule (torch's and DeepSpeed's)."""

    def step(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def build_scheduler(optimizer: torch.optim.Optimizer, type_name: str,
                    params: dict[str, Any]) -> Scheduler:
    """The named schedule: DeepSpeed's names (``WarmupLR``, ``WarmupDecayLR``,
    ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``) with DeepSpeed's exact formulas,
    defaults and step indexing (:mod:`hybridtrain.optim.deepspeed.schedules`); our
    short names (``constant``, ``linear``, ``cosine``) as a ``LambdaLR`` over
    :func:`lr_factor_fn`, where ``warmup_max_lr`` sets the base learning rate and
    ``warmup_min_lr`` the warm-up start.

    Raises:
        ValueError: unknown schedule or parameter (one line naming it).
    """
    if type_name in DEEPSPEED_SCHEDULES:
        return DeepSpeedSchedule(optimizer, type_name, params)
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
