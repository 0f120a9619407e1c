"""What the engine asks of its optimizer around a step, beyond torch's ``Optimizer`` API:
one protocol with a plain default, so the engine calls it without asking which optimizer
it holds (optimizer offload answers with :class:`~hybridtrain.runtime.offload.steps.OffloadSteps`).

Call order in ``train_batch``::

    unscale_on_landing (fp16, before the backwards) ─► forwards/backwards under reads_wait
    ─► unscale_and_check (fp16) ─► clip_grad_norm (gradient clipping) ─► set_overlap
    ─► optimizer.step()

Between steps: :meth:`StepOptimizer.wait_for_resident_updates` before a forward outside
``train_batch``, :meth:`StepOptimizer.wait_for_updates` before reading parameters or state,
:meth:`StepOptimizer.make_weights_exact` before they are read or overwritten, and
:meth:`StepOptimizer.refresh_masters` after the weights were written directly. All calls
come from the training thread.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from hybridtrain.runtime.precision.scaling import LossScaler

ClipAcross = Callable[[list[nn.Parameter], float], torch.Tensor]
"""The parallel runtime's clip: ``(params, max_norm) -> total norm before clipping``."""


class StepOptimizer(Protocol):
    """The step's optimizer as the engine drives it (see the module docstring)."""

    def unscale_on_landing(self, scaler: LossScaler) -> None:
        """Before a step's backwards: gradients may be unscaled as they are complete."""

    def unscale_and_check(self, scaler: LossScaler, params: list[nn.Parameter]) -> bool:
        """Unscale what is not unscaled yet; whether every gradient is finite (this process)."""

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float, clip_across: ClipAcross) -> torch.Tensor:
        """Clip the gradients' global norm to ``max_norm``; the norm before clipping."""

    def set_overlap(self, background: bool, resident: bool) -> None:
        """Whether the coming ``step()`` may update in the background (``resident``: the
        device-kept weights too, as the next forward waits per read)."""

    def reads_wait(self) -> AbstractContextManager[Any]:
        """A context in which the first read of a weight still updating waits for it."""

    def wait_for_resident_updates(self) -> None:
        """Wait for device weights still updating in the background."""

    def wait_for_updates(self) -> None:
        """Wait for every update still running: parameters and state are the step's result."""

    def make_weights_exact(self) -> None:
        """Give weights that went up rounded their exact values."""

    def refresh_masters(self) -> None:
        """After the weights were written directly: the next update starts from them."""


class PlainSteps:
    """The default :class:`StepOptimizer`: a torch optimizer stepped as the plain loop steps
    it (the loss scaler unscales, the parallel runtime clips, nothing runs in the background)."""

    def unscale_on_landing(self, scaler: LossScaler) -> None:
        """Nothing unscales early."""

    def unscale_and_check(self, scaler: LossScaler, params: list[nn.Parameter]) -> bool:
        """``scaler.unscale_and_check(params)``."""
        return scaler.unscale_and_check(params)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float, clip_across: ClipAcross) -> torch.Tensor:
        """The parallel runtime's clip."""
        return clip_across(params, max_norm)

    def set_overlap(self, background: bool, resident: bool) -> None:
        """Nothing updates in the background."""

    def reads_wait(self) -> AbstractContextManager[Any]:
        """No read waits."""
        return nullcontext()

    def wait_for_resident_updates(self) -> None:
        """Nothing to wait for."""

    def wait_for_updates(self) -> None:
        """Nothing to wait for."""

    def make_weights_exact(self) -> None:
        """Weights are always exact."""

    def refresh_masters(self) -> None:
        """The parameters are the masters."""
