"""Lift Lightning's CUDA-only checks of ``DeepSpeedStrategy`` so the same script runs on this
CPU, on the real DeepSpeed and on hybridtrain alike; nothing else of the strategy changes."""

import lightning.pytorch.strategies.deepspeed as strategy_module
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy


def _setup_environment(self: DeepSpeedStrategy) -> None:
    DDPStrategy.setup_environment(self)  # what it runs after the accelerator check


DeepSpeedStrategy.setup_environment = _setup_environment
strategy_module._validate_device_index_selection = lambda devices: None  # CPU devices have no index
# deepspeed.initialize(args=Namespace(device_rank=root_device.index)): a CPU device has no
# index, and DeepSpeed compares it with 0; the CPU is device 0 of its accelerator.
DeepSpeedStrategy.root_device = property(lambda self: torch.device("cpu", 0))  # type: ignore[assignment]
