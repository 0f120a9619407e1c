"""Lightning's and Fabric's own ``DeepSpeedStrategy`` (and every ``deepspeed*`` strategy name)
on the CPU under the drop-in.

Lightning lets DeepSpeed run on CUDA accelerators only; DeepSpeed itself refuses the CPU for
Lightning's purposes too, but hybridtrain need not. When the drop-in is installed, the
modules ``lightning.pytorch.strategies.deepspeed`` and ``lightning.fabric.strategies.deepspeed``
get :func:`allow_cpu` right after they load (see :mod:`hybridtrain.deepspeed.dropin`): on a
CPU accelerator the strategy skips its CUDA-only checks; on CUDA nothing changes.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch


def allow_cpu(module: ModuleType) -> None:
    """Let ``module.DeepSpeedStrategy`` run on a CPU accelerator (idempotent)."""
    strategy = getattr(module, "DeepSpeedStrategy", None)
    if strategy is None or getattr(strategy, "_hybridtrain_cpu", False):
        return
    environment = strategy.setup_environment
    device = strategy.root_device

    def setup_environment(self: Any) -> None:
        if self.root_device.type == "cpu":  # what runs after the accelerator check
            super(strategy, self).setup_environment()
        else:
            environment(self)

    def root_device(self: Any) -> torch.device:
        found = device.fget(self)
        # The CPU is device 0 (Lightning passes the index to deepspeed.initialize as device_rank).
        return torch.device("cpu", 0) if found.type == "cpu" else found

    validate = getattr(module, "_validate_device_index_selection", None)
    if validate is not None:
        def validate_devices(devices: list[torch.device]) -> None:
            if not all(d.type == "cpu" for d in devices):  # CPU devices have no index to check
                validate(devices)

        module._validate_device_index_selection = validate_devices  # type: ignore[attr-defined]
    strategy.setup_environment = setup_environment
    strategy.root_device = property(root_device)
    strategy._hybridtrain_cpu = True
