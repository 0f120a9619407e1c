"""DeepSpeed's fp16 loss scale, as its optimizer wrappers keep it (DeepSpeed 0.19.8).

Two rules, one per kind of wrapper:

- ``stage0``: ZeRO stage 0's ``FP16_Optimizer`` and ``FP16_UnfusedOptimizer``
  (``runtime/fp16/fused_optimizer.py`` and ``unfused_optimizer.py``, ``_update_scale`` over a
  ``LossScaleConfig``): every overflow halves the scale (not below ``min_loss_scale``, and a
  step overflowing at the floor only stays there); ``hysteresis`` and
  ``consecutive_hysteresis`` are not read.
- ``zero``: ZeRO stages 1 and 2 (``runtime/zero/stage_1_and_2.py`` over
  ``runtime/fp16/loss_scaler.py`` ``DynamicLossScaler``): an overflow first uses up the
  hysteresis (``hysteresis`` overflows, the last one halving), and one at ``min_loss_scale``
  with the hysteresis spent ends the run. ``consecutive_hysteresis`` refills the hysteresis
  after every clean step, else it is refilled when the scale grows.

Both grow the scale by 2 at every clean step whose distance from the last overflow minus one
is a positive multiple of ``loss_scale_window``. A positive ``loss_scale`` is a static scale:
nothing changes it. Every step, clean or not, advances the iteration count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ScaleRule = Literal["stage0", "zero"]
"""Which DeepSpeed wrapper keeps the scale (see the module)."""


class LossScaleAtMinimumError(FloatingPointError):
    """A ZeRO-1/2 fp16 step overflowed with the scale at ``min_loss_scale`` and the hysteresis
    spent: DeepSpeed's ``DynamicLossScaler`` ends the run there."""


@dataclass
class DeepSpeedLossScale:
    """The loss scale and its DeepSpeed update rule (see the module).

    Args:
        rule: ``stage0`` or ``zero``.
        scale: the current scale (``2**initial_scale_power``, or the static ``loss_scale``).
        dynamic: False for a static ``loss_scale``.
        window: ``loss_scale_window``.
        min_scale: ``min_loss_scale``.
        hysteresis: ``hysteresis`` (``zero`` only).
        consecutive_hysteresis: ``consecutive_hysteresis`` (``zero`` only).
    """

    rule: ScaleRule
    scale: float
    dynamic: bool = True
    window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    iteration: int = 0
    last_overflow: int = -1
    hysteresis_left: int = 2

    def __post_init__(self) -> None:
        self.hysteresis_left = self.hysteresis

    @classmethod
    def from_config(cls, rule: ScaleRule, fp16: Any, consecutive_hysteresis: bool) -> DeepSpeedLossScale:
        """The scale DeepSpeed starts from for the config's ``fp16`` section (its attributes
        ``loss_scale``, ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
        ``min_loss_scale``)."""
        dynamic = fp16.loss_scale <= 0
        return cls(rule=rule, scale=float(2**fp16.initial_scale_power) if dynamic else float(fp16.loss_scale),
                   dynamic=dynamic, window=int(fp16.loss_scale_window), min_scale=float(fp16.min_loss_scale),
                   hysteresis=int(fp16.hysteresis), consecutive_hysteresis=consecutive_hysteresis)

    def update(self, overflow: bool) -> None:
        """Advance after a step (``overflow``: its gradients were not finite and it was skipped)."""
        if self.dynamic:
            if overflow:
                self._shrink()
                self.last_overflow = self.iteration
            else:
                self._grow()
        self.iteration += 1

    def _shrink(self) -> None:
        if self.rule == "stage0":
            self.scale = max(self.scale / 2, self.min_scale)
        elif self.hysteresis == 1 or self.hysteresis_left == 1:
            if self.scale == self.min_scale:
                raise LossScaleAtMinimumError(
                    f"fp16 step {self.iteration + 1} overflowed with the loss scale already at its minimum "
                    f"(fp16.min_loss_scale = {self.min_scale:g}), as DeepSpeed stops: lower the learning rate, "
                    "or train in bf16")
            self.scale = max(self.scale / 2, self.min_scale)
        else:
            self.hysteresis_left -= 1

    def _grow(self) -> None:
        if self.rule == "zero" and self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        stable = self.iteration - self.last_overflow - 1
        if stable > 0 and stable % self.window == 0:
            if self.rule == "zero" and not self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            self.scale *= 2

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs, under DeepSpeed's names where its files have them."""
        return {"cur_scale": self.scale, "cur_iter": self.iteration, "last_overflow_iter": self.last_overflow,
                "cur_hysteresis": self.hysteresis_left, "dynamic_loss_scale": self.dynamic}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or the same names read from DeepSpeed's files)."""
        self.scale = float(state["cur_scale"])
        self.iteration = int(state.get("cur_iter", self.iteration))
        self.last_overflow = int(state.get("last_overflow_iter", self.last_overflow))
        self.hysteresis_left = int(state.get("cur_hysteresis", self.hysteresis_left))
