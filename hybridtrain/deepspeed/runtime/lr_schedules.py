"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedulers by their class names, with
DeepSpeed's formulas, defaults and step indexing (:mod:`hybridtrain.optim.deepspeed.schedules`)."""

from __future__ import annotations

from typing import Any

import torch

from hybridtrain.optim.deepspeed.schedules import DeepSpeedSchedule

__all__ = ["LR_RANGE_TEST", "ONE_CYCLE", "VALID_LR_SCHEDULES", "WARMUP_COSINE_LR", "WARMUP_DECAY_LR", "WARMUP_LR",
           "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR = "LRRangeTest", "OneCycle", "WarmupLR"
WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]


class _Schedule(DeepSpeedSchedule):
    """A DeepSpeed scheduler class: ``Kind(optimizer, **params)``; ``step()`` after each
    optimizer step, ``get_last_lr()``, ``state_dict()``/``load_state_dict()``."""

    kind = ""

    def __init__(self, optimizer: torch.optim.Optimizer, **params: Any) -> None:
        super().__init__(optimizer, self.kind, params)

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def step(self, last_batch_iteration: int | None = None) -> None:
        """The next iteration's rates (or those of ``last_batch_iteration``)."""
        if last_batch_iteration is None:
            super().step()
        else:
            self.last_batch_iteration = last_batch_iteration
            self._apply()


class WarmupLR(_Schedule):
    kind = WARMUP_LR


class WarmupDecayLR(_Schedule):
    kind = WARMUP_DECAY_LR


class WarmupCosineLR(_Schedule):
    kind = WARMUP_COSINE_LR


class OneCycle(_Schedule):
    kind = ONE_CYCLE


class LRRangeTest(_Schedule):
    kind = LR_RANGE_TEST
