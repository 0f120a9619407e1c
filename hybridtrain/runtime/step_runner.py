"""Who runs a training step's forwards and backwards: the one extension point.

The engine splits the batch, then hands the micro-batches to its :class:`StepRunner`:

- :class:`MicroBatchRunner` (the default): one micro-batch after the other, forward then
  backward, gradients accumulating — the plain loop;
- layer-major streaming (:mod:`hybridtrain.runtime.streaming.layer_major`): every micro-batch through
  one block before the next;
- a pipeline schedule (:mod:`hybridtrain.parallel.pipeline`): stages interleave the
  micro-batches' forwards and backwards across ranks.

Every runner leaves the gradients where the plain loop leaves them and returns the
weighted sum of the micro-batches' losses; the engine then runs the optimizer step.
Backward observers (optimizer offload, streaming, gradient synchronisation of split
models) are told about every backward the default runner runs, in list order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridtrain.runtime.batch import Batch
from hybridtrain.runtime.precision.scaling import reported_loss


class BackwardObserver(Protocol):
    """Told about every micro-batch's backward (optimizer offload and layer streaming move
    gradients to the host as they complete). ``final``: the last micro-batch of the step."""

    def before_backward(self, final: bool, loss: torch.Tensor) -> None: ...

    def after_backward(self, final: bool) -> None: ...


@dataclass
class StepTimings:
    """Wall-clock seconds of the parts of the last step (``wall_clock_breakdown``).

    Attributes:
        forward / backward: the micro-batch loop's forwards and backwards.
        interleaved: forwards and backwards a runner interleaves and cannot tell apart
            (pipeline schedules, layer-major streaming).
        step: unscale, clip, optimizer and scheduler step.
        transfer / communication / host_optimizer: host↔device copies, collectives and
            waits for the offloaded optimizer's host step inside the parts above, counted
            here instead of there (:mod:`hybridtrain.runtime.step_parts`).
        total: the whole ``train_batch``.
        transfer_bytes: see below.
    """

    forward: float = 0.0
    backward: float = 0.0
    interleaved: float = 0.0
    step: float = 0.0
    transfer: float = 0.0
    communication: float = 0.0
    host_optimizer: float = 0.0
    total: float = 0.0
    transfer_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes copied between host and device in the step, by kind
    (:data:`hybridtrain.runtime.transfer.TRANSFER_KINDS`); counted in every step, also
    without ``wall_clock_breakdown``."""


@dataclass(frozen=True)
class StepContext:
    """What a runner needs from the engine for one step.

    Attributes:
        loss_of: one micro-batch's loss under the engine's precision (moved to the device).
        backward: ``backward(weighted_loss, final)``: loss scaling and the backward
            observers around ``.backward()``.
        weight: each micro-batch's share of the batch (its loss is multiplied by it).
        scale: the fp16 loss scale (1.0 otherwise).
        timed: ``with timed("forward"):`` adds the block's seconds to that timing.
    """

    loss_of: Callable[[Batch], torch.Tensor]
    backward: Callable[[torch.Tensor, bool], None]
    weight: float
    scale: float
    timed: Callable[[str], AbstractContextManager[None]]


class StepRunner(Protocol):
    """Runs a step's forwards and backwards (see the module docstring).

    Attributes:
        whole_steps_only: the model runs only through this runner (a pipeline): the
            engine refuses ``engine(x)``/``backward``/``step`` and evaluates through
            :meth:`evaluate`.
    """

    whole_steps_only: bool

    def forward_backward(self, micro_batches: Sequence[Batch], step: StepContext) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the weighted loss sum (detached)."""
        ...

    def evaluate(self, batch: Batch) -> torch.Tensor:
        """Mean loss of ``batch`` without gradients (only when ``whole_steps_only``)."""
        ...


class MicroBatchRunner:
    """The plain loop: each micro-batch's forward then backward, gradients accumulating.

    Args:
        set_grad_sync: told before each micro-batch whether gradients cross processes in
            its backward (only after the last one: once per step).
    """

    whole_steps_only = False

    def __init__(self, set_grad_sync: Callable[[bool], None]) -> None:
        self.set_grad_sync = set_grad_sync

    def forward_backward(self, micro_batches: Sequence[Batch], step: StepContext) -> torch.Tensor:
        """See :class:`StepRunner`."""
        total: torch.Tensor | None = None
        for index, micro in enumerate(micro_batches):
            final = index == len(micro_batches) - 1
            self.set_grad_sync(final)
            with step.timed("forward"):
                loss = step.loss_of(micro)
            weighted = reported_loss(loss) * step.weight
            total = weighted if total is None else total + weighted
            with step.timed("backward"):
                step.backward(loss * step.weight, final)
        assert total is not None
        return total

    def evaluate(self, batch: Batch) -> torch.Tensor:
        """Not used: the engine evaluates a whole model itself."""
        raise NotImplementedError


def notify_before(observers: Sequence[BackwardObserver], final: bool, loss: torch.Tensor) -> None:
    """Tell every observer a backward starts."""
    for observer in observers:
        observer.before_backward(final, loss)


def notify_after(observers: Sequence[BackwardObserver], final: bool) -> None:
    """Tell every observer a backward ended (same order as :func:`notify_before`)."""
    for observer in observers:
        observer.after_backward(final)

