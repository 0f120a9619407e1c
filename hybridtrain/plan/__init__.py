"""Deciding how to train, as a value: :func:`resolve` makes a :class:`TrainingPlan` (and
raises every ``ConfigError``) without touching the model; :func:`build` applies one."""

from hybridtrain.plan.resolve import resolve
from hybridtrain.plan.types import (
    BlockPlan,
    OptimizerPlan,
    ParallelSizes,
    PipelinePlan,
    TrainingPlan,
)

__all__ = ["BlockPlan", "OptimizerPlan", "ParallelSizes", "PipelinePlan", "TrainingPlan", "resolve"]
