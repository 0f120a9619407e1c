"""Optimizers and learning-rate schedules by name: torch's classes, our short schedule
names, and DeepSpeed's own optimizers and schedules (kept apart in
:mod:`hybridtrain.optim.deepspeed`). The engine, the plan and the planner use this face."""

from __future__ import annotations

from hybridtrain.optim.by_name import (
    Scheduler,
    build_optimizer,
    build_scheduler,
    lr_factor_fn,
    optimizer_state_bytes,
)
from hybridtrain.optim.deepspeed import DEEPSPEED_OPTIMIZERS, FP16_INIT_STEP, take_fp16_init_step
from hybridtrain.optim.uncorrected_adam import AdamWithoutBiasCorrection

__all__ = [
    "DEEPSPEED_OPTIMIZERS", "FP16_INIT_STEP", "AdamWithoutBiasCorrection", "Scheduler", "build_optimizer",
    "build_scheduler", "lr_factor_fn", "optimizer_state_bytes", "take_fp16_init_step",
]
