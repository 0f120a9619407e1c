"""Optimizer offload's answers to the engine's step protocol
(:class:`~hybridtrain.runtime.step_optimizer.StepOptimizer`): the host worker unscales and
checks gradients as they land, clips them off the critical path, and may update in the
background while the next forward runs."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from hybridtrain.runtime.precision.scaling import LossScaler
from hybridtrain.runtime.step_optimizer import ClipAcross


class OffloadSteps:
    """The :class:`~hybridtrain.runtime.step_optimizer.StepOptimizer` of an
    :class:`OffloadOptimizer`.

    Args:
        optimizer: the host optimizer.
        clips_locally: the parallel runtime's clip is the local norm (one process, or
            replicated gradients), so the host optimizer clips its own gradients: the same
            result, off the critical path. Otherwise the runtime clips across processes.
    """

    def __init__(self, optimizer: OffloadOptimizer, clips_locally: bool) -> None:
        self.optimizer = optimizer
        self.clips_locally = clips_locally

    def unscale_on_landing(self, scaler: LossScaler) -> None:
        """The host worker unscales as the last backward lands."""
        self.optimizer.unscale_on_landing(scaler)

    def unscale_and_check(self, scaler: LossScaler, params: list[nn.Parameter]) -> bool:
        """The worker unscaled and checked as buckets landed; this thread does the rest."""
        return self.optimizer.unscale_and_check(scaler)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float, clip_across: ClipAcross) -> torch.Tensor:
        """The host optimizer's clip where the rule is the local norm, else the runtime's."""
        return self.optimizer.clip_grad_norm(max_norm) if self.clips_locally else clip_across(params, max_norm)

    def set_overlap(self, background: bool, resident: bool) -> None:
        """Let the coming step's updates run in the background (and the device-kept ones)."""
        self.optimizer.background = background
        self.optimizer.background_resident = background and resident

    def reads_wait(self) -> AbstractContextManager[Any]:
        """The first read of a device weight still updating waits for its update."""
        return self.optimizer.reads_wait()

    def wait_for_resident_updates(self) -> None:
        """Wait where device weights are still updating in the background."""
        if self.optimizer.resident_pending:
            self.optimizer.wait_for_updates()

    def wait_for_updates(self) -> None:
        """Wait for every background update."""
        self.optimizer.wait_for_updates()

    def make_weights_exact(self) -> None:
        """Weights that went up in half get their exact fp32 values."""
        self.optimizer.half_uploads.exact()

    def refresh_masters(self) -> None:
        """Copy the device weights into the host masters."""
        self.optimizer.refresh_masters()
