"""Lightning's ``DeepSpeedStrategy`` on hybridtrain, on CUDA or on the CPU.

Lightning's own strategy runs unchanged on the drop-in (``python -m hybridtrain.deepspeed
script.py``) wherever Lightning lets it run: on CUDA accelerators only. This subclass is the
same strategy — Lightning's config handling, ZeRO stages, checkpoints, precision — with the
drop-in installed by importing it, and the CPU allowed::

    from hybridtrain.deepspeed.lightning import DeepSpeedStrategy
    trainer = Trainer(accelerator="cpu", strategy=DeepSpeedStrategy(stage=2, offload_optimizer=True), ...)

Importing this module installs the drop-in in this process (see
:mod:`hybridtrain.deepspeed.dropin`); it needs ``lightning``.
"""

from __future__ import annotations

from typing import Any

import lightning.fabric.strategies.deepspeed as fabric_deepspeed
import lightning.pytorch.strategies.deepspeed as pytorch_deepspeed
import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy
from lightning_utilities.core.imports import RequirementCache

from hybridtrain.deepspeed.dropin import install

__all__ = ["DeepSpeedStrategy"]

install()
# Lightning remembers whether `deepspeed` is installed the first time it asks (maybe before
# this import): it asks again, and finds the drop-in.
for _module in (fabric_deepspeed, pytorch_deepspeed):
    _module._DEEPSPEED_AVAILABLE = RequirementCache("deepspeed")  # type: ignore[attr-defined]
    _module._DEEPSPEED_GREATER_EQUAL_0_16 = RequirementCache("deepspeed>=0.16.0")  # type: ignore[attr-defined]


class DeepSpeedStrategy(LightningDeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` (same arguments) on hybridtrain's drop-in; on the CPU
    too. Registered as ``hybridtrain_deepspeed`` (and ``hybridtrain_deepspeed_stage_2_offload``,
    … for each of Lightning's ``deepspeed_*`` names)."""

    strategy_name = "hybridtrain_deepspeed"

    def setup_environment(self) -> None:
        if self.root_device.type == "cuda":
            super().setup_environment()
        else:  # Lightning's CUDA-only check, skipped: what runs after it
            DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if self.root_device.type == "cuda":
            super().setup_distributed()
            return
        # As Lightning's, less the check that each process has its own device index.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def root_device(self) -> torch.device:
        device = super().root_device
        # The CPU is device 0 (Lightning passes its index to deepspeed.initialize).
        return torch.device("cpu", 0) if device.type == "cpu" else device

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's ``deepspeed*`` names, prefixed ``hybridtrain_``, for this class."""
        mine = type(strategy_registry)()
        LightningDeepSpeedStrategy.register_strategies.__func__(cls, mine)  # type: ignore[attr-defined]
        for name, entry in mine.items():
            strategy_registry.register(f"hybridtrain_{name}", cls, description=f"{entry['description']} "
                                       "(hybridtrain)", **entry["init_params"])


DeepSpeedStrategy.register_strategies(StrategyRegistry)
