"""Mixed precision: autocast for bf16/fp16 and DeepSpeed-style dynamic loss scaling.

Parameters stay fp32 (they are the master weights); only the forward and backward math
runs in half precision under ``torch.autocast``. fp16 gradients can overflow, so the loss
is multiplied by a power-of-two scale before backward — exact, because multiplying by a
power of two only moves the exponent — and gradients are divided by it before the step.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hybridtrain.compat import unscale_and_check_


def autocast(device: torch.device, dtype: torch.dtype | None,
             cache: bool = False) -> contextlib.AbstractContextManager[Any]:
    """Autocast context for ``dtype`` (``None`` = full precision, no context).

    ``cache``: torch's weight-cast cache (its default, what a plain loop gets). It keeps the
    half copy of every weight until the forward ends, which decides the math of a weight
    read twice: both reads share one half copy, whose two gradients are summed in half
    before the cast widens them; without the cache each read casts anew and the two widened
    gradients are summed in fp32. Where every block's saved tensors stay on the device they
    hold those copies anyway, and the cache costs nothing (:attr:`TrainingPlan.autocast_cache`);
    checkpointed, swapped or streamed blocks — whose saved tensors are meant to leave the
    device — would still hold two bytes per parameter of the whole model, so there it is off
    (the same results for a weight read once).
    """
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache)


def reported_loss(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` detached, in fp32 or wider, for summing over micro-batches and ranks and
    reporting: a half-precision loss (autocast) becomes fp32; an fp64 model's stays fp64,
    the number its plain loop would show."""
    return loss.detach().to(torch.promote_types(loss.dtype, torch.float32))


def precision_name(dtype: torch.dtype | None) -> str:
    """``fp32`` (no autocast), ``bf16`` or ``fp16``."""
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


class LossScaleAtMinimumError(FloatingPointError):
    """An fp16 step overflowed with the loss scale already at ``min_loss_scale``."""


class LossScaler:
    """Dynamic (or static) loss scaling with DeepSpeed's semantics (its
    ``DynamicLossScaler.update_scale``, ``consecutive_hysteresis`` off, checked against it).

    An overflowing step is skipped. While overflows are left in the hysteresis (it starts
    at ``hysteresis``) an overflow only uses one up; after that every overflow halves the
    scale (not below ``min_scale``; one at ``min_scale`` ends the run, as DeepSpeed's does).
    The scale doubles at every ``window``-th step after the last overflow's next one
    (``stable interval = step − last overflow step − 1``, a positive multiple of ``window``),
    which also refills the hysteresis. A positive ``static_scale`` disables both.
    """

    def __init__(self, static_scale: float = 0.0, initial_scale_power: int = 16,
                 window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0) -> None:
        self.dynamic = static_scale <= 0
        self.scale = float(2**initial_scale_power) if self.dynamic else float(static_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self._hysteresis_left = hysteresis
        self._step = 0
        self._last_overflow = -1
        self.skipped_steps = 0

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale in place; return True when all are finite."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for p in params:
            if p.grad is not None:
                # Sharded (DTensor) gradients are checked and unscaled shard by shard; the
                # parallel runtime then agrees on the verdict across ranks (``all_finite``).
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                groups[(grad.device, grad.dtype)].append(grad)
        found_inf = False
        for (device, _), grads in groups.items():
            flag = found_inf_flag(device)
            unscale_and_check_(grads, flag, self.inverse_scale(device))
            found_inf |= bool(flag.item())
        return not found_inf

    def inverse_scale(self, device: torch.device) -> torch.Tensor:
        """``1 / scale`` as the one-element tensor :meth:`unscale_and_check` multiplies the
        gradients on ``device`` by: whoever unscales gradients elsewhere (the host optimizer's
        worker, :mod:`~hybridtrain.runtime.offload.host_grad_checks`) takes this one, so the same bits."""
        return torch.full((1,), 1.0 / self.scale, device=device)

    def update(self, overflow: bool) -> None:
        """Advance the scale after a step (``overflow``: the step was skipped)."""
        if overflow:
            self.skipped_steps += 1
        if not self.dynamic:
            return
        if overflow:
            if self._hysteresis_left <= 1:
                if self.scale <= self.min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16 step {self._step + 1} overflowed with the loss scale already at its minimum "
                        f"(fp16.min_loss_scale = {self.min_scale:g}); the gradients are inf/NaN at every scale: "
                        "lower the learning rate, or train in bf16")
                self.scale = max(self.scale / 2, self.min_scale)  # the hysteresis stays spent
            else:
                self._hysteresis_left -= 1
            self._last_overflow = self._step
        else:
            stable = self._step - self._last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self.scale *= 2
                self._hysteresis_left = self.hysteresis
        self._step += 1

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the scale trajectory exactly."""
        return {
            "scale": self.scale,
            "hysteresis_left": self._hysteresis_left,
            "step": self._step,
            "last_overflow_step": self._last_overflow,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        if "step" in state:
            self._step, self._last_overflow = int(state["step"]), int(state["last_overflow_step"])
        else:  # saved before the step count: its clean steps since the last overflow
            self._step, self._last_overflow = int(state["good_steps"]), -1
        self.skipped_steps = int(state["skipped_steps"])


def found_inf_flag(device: torch.device) -> torch.Tensor:
    """A cleared found-inf flag for :func:`~hybridtrain.compat.unscale_and_check_` on
    ``device``: it becomes 1 when a gradient unscaled with it is inf or NaN, and stays so."""
    return torch.zeros(1, device=device)
