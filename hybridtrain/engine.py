"""The training engine: one optimizer step over a batch, the familiar forward/backward/step
trio, evaluation, and checkpoints. Build one with :func:`hybridtrain.initialize`.

A step (``train_batch``)::

    batch ─► split into k micro-batches ─► for each: autocast forward, loss × (n_i / n),
             × loss scale, backward (gradients accumulate) ─► unscale + inf check (fp16)
             ─► clip ─► optimizer.step ─► scheduler.step

Weighting each micro-batch's mean loss by its share of the batch makes the accumulated
gradient the gradient of the whole batch's mean loss: the plain loop's math.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from hybridtrain import checkpoint as ckpt
from hybridtrain.config import BatchSizes
from hybridtrain.optim import Scheduler
from hybridtrain.parallel.mesh import Topology
from hybridtrain.parallel.replicated import ReplicatedRuntime
from hybridtrain.parallel.runtime import ParallelRuntime
from hybridtrain.runtime import transfer
from hybridtrain.runtime.batch import (
    Batch,
    LossFn,
    batch_size,
    chunk_batch,
    compute_loss,
    run_model,
    split_batch,
    to_device,
)
from hybridtrain.runtime.precision import LossScaler, autocast, reported_loss
from hybridtrain.runtime.step_optimizer import PlainSteps, StepOptimizer
from hybridtrain.runtime.step_parts import PartClock, step_part
from hybridtrain.runtime.step_runner import (
    BackwardObserver,
    MicroBatchRunner,
    StepContext,
    StepRunner,
    StepTimings,
    notify_after,
    notify_before,
)

if TYPE_CHECKING:
    from hybridtrain.profiling.profiler import Profile


class NonFiniteLossError(FloatingPointError):
    """The loss became inf/NaN and ``nonfinite_loss`` is ``error``."""


@dataclass
class EngineOptions:
    """What the engine reads from the config, resolved once by :func:`initialize`."""

    batch: BatchSizes
    device: torch.device
    compute_dtype: torch.dtype | None = None
    gradient_clipping: float = 0.0
    nonfinite_loss: str = "error"
    wall_clock_breakdown: bool = False
    setup: dict[str, Any] = field(default_factory=dict)
    parallel: ParallelRuntime | None = None
    """Everything that differs when several processes cooperate (one process: None)."""
    runner: StepRunner | None = None
    """Runs each step's forwards and backwards (None: the plain micro-batch loop)."""
    observers: Sequence[BackwardObserver] = ()
    """Told about every backward of the micro-batch loop and of ``engine.backward``, in this order."""
    autocast_cache: bool = False
    """Autocast's weight-cast cache (:func:`~hybridtrain.runtime.precision.scaling.autocast`)."""
    steps: StepOptimizer | None = None
    """What the step asks of the optimizer beyond torch's API (None: :class:`PlainSteps`)."""


class OwnPrecision(Protocol):
    """An optimizer that keeps the mixed-precision math itself: fp32 masters over half module
    weights, its own loss scale and its own overflow check (the DeepSpeed drop-in's wrapper).
    The engine then runs no autocast, scaler or clipping of its own; it asks this object to
    scale each micro-batch's loss, tells it of every backward, and after ``optimizer.step()``
    asks whether the update was applied: a skipped one counts in ``skipped_steps`` and holds
    the learning-rate schedule back a step."""

    last_step_skipped: bool
    """Whether the latest ``step()`` skipped the update (gradients not finite)."""

    def scaled_for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as backward should see it (the loss scale applied in its backward)."""

    def after_backward(self, boundary: bool) -> None:
        """After every backward; ``boundary``: the backward ends the accumulation window."""

    def skip(self) -> None:
        """The engine skips this step (a non-finite loss): drop the gradients, count an overflow."""


class Engine:
    """Trains ``module`` with the techniques :func:`hybridtrain.initialize` applied.

    Attributes:
        module: the user's model (on ``device``; same parameter names as given).
        optimizer / scheduler / scaler: the step's parts (scheduler and scaler may be None).
        global_step: ``train_batch`` calls (and manual accumulation boundaries) so far.
        micro_batch_done: when set, ``train_batch`` calls it with ``(done, of)`` after each
            micro-batch's backward, so a step of hundreds of micro-batches can show its
            progress (``hybridtrain train``'s progress bar does). The default runner only:
            layer-major streaming and pipeline schedules interleave the micro-batches.
        own_precision: the optimizer's own mixed-precision math (:class:`OwnPrecision`),
            set by whoever built it (None: the engine's autocast and loss scaler).
        overlap_updates: under optimizer offload or layer streaming, let a step whose host
            update must wait for every gradient (gradient clipping, fp16 loss scaling,
            ``nonfinite_loss: skip``) return before the updates finish: they run on the host
            while the next forward starts, in the order it reads the weights; a streamed
            block's upload, or the first op that reads a device weight (``train_batch``,
            one process), waits for that weight's update only — the same math.
            The engine's methods wait where they read the result (checkpoints,
            ``model_state_dict``, ``profile``); code of yours that reads the parameters
            between steps calls :meth:`wait_for_updates` first. ``hybridtrain train`` sets it.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Scheduler | None,
                 scaler: LossScaler | None, loss_fn: LossFn | None, options: EngineOptions) -> None:
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.loss_fn = loss_fn
        self.options = options
        self.device = options.device
        self.global_step = 0
        self.micro_batch_done: Callable[[int, int], None] | None = None
        self.overlap_updates = False
        self.own_precision: OwnPrecision | None = None
        self.last_timings = StepTimings()
        # Everything that differs when several processes cooperate goes through this object.
        self.parallel: ParallelRuntime = options.parallel or ReplicatedRuntime(module)
        self.runner: StepRunner = options.runner or MicroBatchRunner(self.parallel.set_grad_sync)
        # Whatever the optimizer does around its step (optimizer offload's host worker) goes
        # through this object: the engine never asks which optimizer it holds.
        self.steps: StepOptimizer = options.steps or PlainSteps()
        self._nonfinite_skips = 0
        self._manual_micro_steps = 0
        self._manual_loss: torch.Tensor | None = None
        self._boundary: bool | None = None
        self.last_grad_norm: torch.Tensor | None = None
        """The global gradient norm before clipping at the latest step (None without clipping)."""

    # ------------------------------------------------------------------ training step
    def train_batch(self, batch: Batch) -> float:
        """One optimizer step over ``batch`` (this process's share of the global batch).

        The batch is split into ``gradient_accumulation_steps`` equal micro-batches.

        Returns:
            The batch's mean loss.

        Raises:
            ValueError: the batch does not split into the micro-batches.
            NonFiniteLossError: inf/NaN loss with ``nonfinite_loss: error``.
        """
        start = time.perf_counter()
        transfer.take_counts()  # what moved outside a step (evaluation) is not this step's
        self.module.train()
        micro_batches = split_batch(batch, self.options.batch.accumulation_steps)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.steps.unscale_on_landing(self.scaler)
        backward = self._scaled_backward if self.micro_batch_done is None else \
            _counted(self._scaled_backward, self.micro_batch_done, len(micro_batches))
        step = StepContext(self._micro_loss, backward, 1.0 / len(micro_batches), self.loss_scale, self._timed)
        # wall_clock_breakdown: the parts of this step, transfers and collectives included.
        with PartClock().running() if self.options.wall_clock_breakdown else nullcontext() as clock:
            with self.steps.reads_wait():
                total = self.runner.forward_backward(micro_batches, step)
            value = float(self.parallel.mean_loss(total).item())
            with self._timed("step"):
                # The plain loop runs the next forward here, under reads_wait: the resident
                # weights may update in the background too.
                self._optimizer_step(value, resident=isinstance(self.runner, MicroBatchRunner)
                                     and not self.parallel.distributed)
        self.last_timings = StepTimings(**clock.seconds) if clock else StepTimings()  # type: ignore[arg-type]
        self.last_timings.total = time.perf_counter() - start
        self.last_timings.transfer_bytes = transfer.take_counts()
        return value

    def eval_batch(self, batch: Batch) -> float:
        """Mean loss of ``batch`` without gradients (in micro-batches of the training size)."""
        self.steps.wait_for_resident_updates()  # outside train_batch no read waits per weight
        if self.runner.whole_steps_only:
            return float(self.parallel.mean_loss(self.runner.evaluate(to_device(batch, self.device))))
        was_training = self.module.training
        self.module.eval()
        size = batch_size(batch)
        total = 0.0
        try:
            with torch.no_grad():
                # No gradient depends on equal sizes here, so the last chunk may be smaller.
                for micro, samples in chunk_batch(batch, self.options.batch.micro_batch):
                    micro = to_device(micro, self.device)
                    # Without gradients the cache changes no result, only holds copies.
                    with autocast(self.device, self.options.compute_dtype):
                        loss = compute_loss(run_model(self.parallel.module, micro), micro, self.loss_fn)
                    total += float(self.parallel.mean_loss(reported_loss(loss))) * samples / size
        finally:
            self.module.train(was_training)
        return total

    # ------------------------------------------------------- forward / backward / step
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward pass under the engine's precision: ``outputs = engine(inputs)``."""
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward pass under the engine's precision (inputs are moved to the device).
        The module's train/eval mode is the caller's, as with a plain ``nn.Module``.

        Raises:
            RuntimeError: under pipeline parallel, whose schedule runs whole steps.
        """
        if self.runner.whole_steps_only:
            raise RuntimeError("pipeline parallel runs forward and backward of all micro-batches in its "
                               "schedule; use engine.train_batch(batch) instead of engine(...)/backward/step")
        self.steps.wait_for_resident_updates()  # outside train_batch no read waits per weight
        args, kwargs = to_device((args, kwargs), self.device)
        self.parallel.set_grad_sync(self.is_gradient_accumulation_boundary())
        with self._autocast():
            return self.parallel.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, scaled by 1/accumulation (and the loss scale);
        gradients add up until :meth:`step` updates at the accumulation boundary and clears them."""
        weight = 1.0 / self.options.batch.accumulation_steps
        loss = self._for_backward(loss)
        detached = reported_loss(loss) * weight
        self._manual_loss = detached if self._manual_loss is None else self._manual_loss + detached
        self._scaled_backward(loss * weight, self.is_gradient_accumulation_boundary())

    def step(self) -> bool:
        """Finish a micro-batch; at the accumulation boundary run the optimizer step.

        Returns:
            True when this call ran an optimizer step (the boundary was reached).
        """
        boundary = self.is_gradient_accumulation_boundary()
        self._manual_micro_steps += 1
        if not boundary:
            return False
        value = float(self.parallel.mean_loss(self._manual_loss).item()) if self._manual_loss is not None else 0.0
        self._manual_micro_steps, self._manual_loss = 0, None
        self._optimizer_step(value)
        self.last_timings.transfer_bytes = transfer.take_counts()  # since the last step
        # As DeepSpeed: gradients are cleared after the update, so every backward of the
        # next window (several per micro-batch, e.g. a GAN's) adds to a clean slate.
        self.optimizer.zero_grad(set_to_none=True)
        return True

    @property
    def micro_step(self) -> int:
        """Micro-batches :meth:`step` has finished since the last accumulation boundary."""
        return self._manual_micro_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` call runs the optimizer: the caller's word when it
        gave one (:meth:`set_gradient_accumulation_boundary`), else every
        ``gradient_accumulation_steps``-th micro-batch."""
        if self._boundary is not None:
            return self._boundary
        return self._manual_micro_steps + 1 == self.options.batch.accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the current micro-batch ends the accumulation window (its backward
        synchronizes the gradients, its :meth:`step` updates), as a loop that counts the
        micro-batches itself does (Accelerate, Hugging Face's Trainer); None: count them here.
        Every backward is still scaled by 1/``gradient_accumulation_steps``, as in DeepSpeed."""
        self._boundary = is_boundary

    # ------------------------------------------------------------------ internals
    @property
    def _params(self) -> list[torch.nn.Parameter]:
        # Read live: a pipeline drops other stages' parameters from the optimizer at its split.
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _micro_loss(self, micro: Batch) -> torch.Tensor:
        micro = to_device(micro, self.device)
        with self._autocast():
            return self._for_backward(compute_loss(run_model(self.parallel.module, micro), micro, self.loss_fn))

    def _for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        # The optimizer's own loss scale goes on the unweighted loss, where its rule puts it.
        return self.own_precision.scaled_for_backward(loss) if self.own_precision is not None else loss

    def _autocast(self) -> AbstractContextManager[Any]:
        return autocast(self.device, self.options.compute_dtype, self.options.autocast_cache)

    def _scaled_backward(self, loss: torch.Tensor, final: bool) -> None:
        notify_before(self.options.observers, final, loss)
        # Scaled in fp32 as DeepSpeed does (fp16/fused_optimizer.py backward: loss.float() * cur_scale),
        # so a half-precision loss is not itself overflowed by the scale.
        (loss.float() * self.scaler.scale if self.scaler else loss).backward()
        notify_after(self.options.observers, final)
        if self.own_precision is not None:
            self.own_precision.after_backward(final)

    def _optimizer_step(self, loss_value: float, resident: bool = False) -> bool:
        """Unscale, check, clip, step, schedule; returns False when the step was skipped.
        ``resident``: the next forward runs under ``steps.reads_wait()`` on this thread."""
        self.global_step += 1
        if self.scaler is not None:
            local = self.steps.unscale_and_check(self.scaler, self._params)
            finite = self.parallel.all_finite(local)
            self.scaler.update(overflow=not finite)
            if not finite:
                self.optimizer.zero_grad(set_to_none=True)
                return False
        elif not math.isfinite(loss_value):
            if self.options.nonfinite_loss == "error":
                raise NonFiniteLossError(
                    f"loss is {loss_value} at step {self.global_step}; set nonfinite_loss: skip "
                    "to skip such steps, or lower the learning rate"
                )
            self._nonfinite_skips += 1
            self.optimizer.zero_grad(set_to_none=True)
            if self.own_precision is not None:
                self.own_precision.skip()
            return False
        if self.options.gradient_clipping > 0:
            self.last_grad_norm = self.steps.clip_grad_norm(self._params, self.options.gradient_clipping,
                                                            self.parallel.clip_grad_norm)
        self.steps.set_overlap(self.overlap_updates, resident)
        self.optimizer.step()
        if self.own_precision is not None and self.own_precision.last_step_skipped:
            self._nonfinite_skips += 1  # the optimizer's overflow check skipped it: the schedule waits
            return False
        if self.scheduler is not None:
            self.scheduler.step()
        return True

    def _timed(self, part: str) -> AbstractContextManager[None]:
        return step_part(part, self.device)

    def _wait_for_host_updates(self) -> None:
        # Before reading through state_dict (which gives rounded weights' masters) or training on.
        self.steps.wait_for_updates()

    def wait_for_updates(self) -> None:
        """Wait for host updates still running after the last step (:attr:`overlap_updates`),
        and give weights that went up in half their exact fp32 values
        (:mod:`~hybridtrain.runtime.offload.half_uploads`): afterwards the model's parameters and the
        optimizer's state are that step's result."""
        self._wait_for_host_updates()
        self.steps.make_weights_exact()  # also before a checkpoint is loaded in place

    # ------------------------------------------------------------------ readings
    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN (loss-scale overflow or ``nonfinite_loss: skip``)."""
        return self._nonfinite_skips + (self.scaler.skipped_steps if self.scaler else 0)

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler else 1.0

    def get_lr(self) -> list[float]:
        """Learning rate of each parameter group."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full (unsharded) state dict as CPU copies, on every rank.

        Under ZeRO or tensor/pipeline parallel this is a collective: call it on every rank.
        """
        self._wait_for_host_updates()
        return self.parallel.model_state_dict()

    @property
    def topology(self) -> Topology:
        """Sizes and this rank's coordinates in ``dp × tp × pp``."""
        return self.parallel.topology

    def local_batch(self, global_batch: Batch) -> Batch:
        """The part of ``global_batch`` this rank trains on (its data-parallel shard)."""
        return self.parallel.topology.local_batch(global_batch)

    def profile(self, batch: Batch, steps: int = 2, output_dir: str | Path | None = None) -> Profile:
        """Profile ``steps`` training steps on ``batch`` (they train; the first is counted, the
        rest timed): per-module FLOPs, activations and time, the step's parts, MFU, a diagnosis.
        With ``output_dir``: ``profile.json``, ``trace.json`` and ``memory.png`` there.
        See :mod:`hybridtrain.profiling.profiler`."""
        from hybridtrain.profiling.profiler import profile_engine

        self._wait_for_host_updates()
        return profile_engine(self, batch, steps, output_dir)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path, client_state: dict[str, Any] | None = None,
                        async_save: bool = False) -> Path:
        """Atomically save everything an exact resume needs, plus ``client_state``.

        With several processes, call it on every rank: each writes its own shards (see
        :mod:`hybridtrain.checkpoint`), and the checkpoint appears once all have finished.

        Args:
            async_save: return once the state is copied to host memory; the files are
                written in the background (the next save or load waits for them).

        Raises:
            CheckpointError: a rank could not write (the previous checkpoint is untouched).
        """
        self._wait_for_host_updates()
        meta = {"step": self.global_step, "setup": self.options.setup,
                "params": {k: list(v) for k, v in self.parallel.model_state_shapes().items()}}
        counters = {"global_step": self.global_step, "nonfinite_skips": self._nonfinite_skips}
        return ckpt.save(path, self._checkpoint_parts(), counters, client_state or {}, meta, async_save)

    def load_checkpoint(self, path: str | Path, model_only: bool = False) -> dict[str, Any]:
        """Restore a checkpoint saved by :meth:`save_checkpoint` (by any world size and
        layout); returns its ``client_state``.

        Args:
            model_only: restore the model's weights only (optimizer, schedule, counters
                and RNG stay as they are).

        Raises:
            CheckpointError: missing, or made for another model/optimizer/precision (the
                message says what does not match); nothing is modified then.
            IncompleteCheckpointError: incomplete or corrupt; nothing is modified then.
        """
        self.wait_for_updates()
        restored = ckpt.load(path, self._checkpoint_parts(), self._check_compatible, model_only)
        if model_only:
            self.steps.refresh_masters()  # the next update starts from the loaded weights
        if not model_only:
            self.global_step = int(restored.counters["global_step"])
            self._nonfinite_skips = int(restored.counters["nonfinite_skips"])
            self._manual_micro_steps, self._manual_loss = 0, None  # a new accumulation window
            self.optimizer.zero_grad(set_to_none=True)
        return restored.client_state

    def restore_progress(self, global_step: int, skipped_steps: int) -> None:
        """Set the step counters after weights and optimizer state were restored from
        another checkpoint format; a new accumulation window starts, gradients cleared."""
        self.global_step = int(global_step)
        scaler_skips = self.scaler.skipped_steps if self.scaler else 0
        self._nonfinite_skips = max(0, int(skipped_steps) - scaler_skips)
        self._manual_micro_steps, self._manual_loss = 0, None
        self.optimizer.zero_grad(set_to_none=True)

    def _checkpoint_parts(self) -> ckpt.TrainingParts:
        return ckpt.TrainingParts(self.parallel, self.optimizer, self.scheduler, self.scaler)

    def _check_compatible(self, path: Path, meta: dict[str, Any]) -> None:
        mine = {k: list(shape) for k, shape in self.parallel.model_state_shapes().items()}
        theirs: dict[str, list[int]] = meta["params"]
        problems = [f"missing parameter {k!r}" for k in mine if k not in theirs][:3]
        problems += [f"unexpected parameter {k!r}" for k in theirs if k not in mine][:3]
        problems += [f"{k!r} has shape {theirs[k]} in the checkpoint but {v} in the model"
                     for k, v in mine.items() if k in theirs and theirs[k] != v][:3]
        # Format 2 reads any layout: settings that only described format 1's are not compared.
        ignored = ckpt.LAYOUT_SETTINGS if meta["format"] > 1 else frozenset()
        problems += [f"{k} is {meta['setup'].get(k)!r} in the checkpoint but {v!r} now"
                     for k, v in self.options.setup.items() if k not in ignored and meta["setup"].get(k) != v]
        if problems:
            raise ckpt.CheckpointError(f"checkpoint {path} does not match this run: " + "; ".join(problems))


def _counted(backward: Callable[[torch.Tensor, bool], None], report: Callable[[int, int], None],
             of: int) -> Callable[[torch.Tensor, bool], None]:
    """``backward`` that reports ``(done, of)`` after each call (:attr:`Engine.micro_batch_done`)."""
    done = 0

    def counted(loss: torch.Tensor, final: bool) -> None:
        nonlocal done
        backward(loss, final)
        done += 1
        report(done, of)

    return counted
