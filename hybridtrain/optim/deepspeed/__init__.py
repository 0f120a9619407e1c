"""DeepSpeed's own optimizers and schedules, and its fp16 init step: the math only DeepSpeed
configs ask for, step for step as DeepSpeed computes it.

:mod:`hybridtrain.optim.by_name` chooses among these by the names DeepSpeed's config gives
them; nothing else in the engine needs to know they are DeepSpeed's.
"""

from __future__ import annotations

import torch

from hybridtrain.optim.deepspeed.init_step import FP16_INIT_STEP, take_fp16_init_step
from hybridtrain.optim.deepspeed.lamb import Lamb
from hybridtrain.optim.deepspeed.onebit_adam import OnebitAdam, ZeroOneAdam
from hybridtrain.optim.deepspeed.onebit_lamb import OnebitLamb
from hybridtrain.optim.deepspeed.schedules import DEEPSPEED_SCHEDULES, DeepSpeedSchedule

DEEPSPEED_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "lamb": Lamb, "onebitadam": OnebitAdam, "zerooneadam": ZeroOneAdam, "onebitlamb": OnebitLamb,
}
"""DeepSpeed's own optimizers, by the lower-case name DeepSpeed's config gives them."""

REFUSED_DEEPSPEED_OPTIMIZERS: dict[str, str] = {
    "muadam": "muP Adam", "muadamw": "muP AdamW", "musgd": "muP SGD",
    "lion": "the Lion optimizer", "fusedlion": "the Lion optimizer",
}
"""DeepSpeed optimizers whose math torch does not have and hybridtrain does not implement."""

__all__ = [
    "DEEPSPEED_OPTIMIZERS", "DEEPSPEED_SCHEDULES", "FP16_INIT_STEP", "REFUSED_DEEPSPEED_OPTIMIZERS",
    "DeepSpeedSchedule", "Lamb", "OnebitAdam", "OnebitLamb", "ZeroOneAdam", "take_fp16_init_step",
]
