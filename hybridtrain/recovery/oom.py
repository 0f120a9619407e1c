"""Training steps under ``device_memory_limit``, and recovery from out-of-memory errors.

:class:`MemoryGuard` runs ``engine.train_batch`` for a training loop. It enforces the
limit (on CUDA by capping the process's share of the device, on CPU by counting live
tensor bytes with :class:`~hybridtrain.runtime.memory_limit.LiveTensorBytes` during each
step) and, with ``oom_recovery.enabled``, turns an out-of-memory error inside a step into
a plan switch::

    step N ─► OOM ─► the step's tensors are freed (the error unwinds)
            ─► a config that needs less memory and computes the same math: the
               replanner's (the planner, calibrated by the measured peak), else the next
               rung of checkpoint every block → swap activations → offload the optimizer →
               stream layers → halve the micro-batch, doubling accumulation
            ─► state saved through the engine's checkpoint path ─► old engine released
            ─► model rebuilt from the config, new engine built, state loaded
            ─► step N rerun on the same batch from the same state

"The same state" is what the step started from: parameters and optimizer state (untouched
until the optimizer steps: an error after the optimizer began updating cannot be undone
without a copy of both, so it stops, except at the first step, whose state is the model
factory's), the scheduler, the fp16 loss scaler, every RNG, the model's buffers (a forward
may update running statistics) and the step counter, captured before each step (cheap:
no parameter is copied). The data position is the caller's: it passes the same batch.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hybridtrain.compose import check_autocast_math
from hybridtrain.config import (
    Config,
    ConfigError,
    ConfigSource,
    load_config,
    resolve_batch_sizes,
)
from hybridtrain.engine import Engine
from hybridtrain.plan.resolve import resolve
from hybridtrain.plan.variants import describe_changes, draws_random_numbers, ladder
from hybridtrain.prepare import prepare
from hybridtrain.recovery.memory_plans import Replanner
from hybridtrain.runtime import device as dev
from hybridtrain.runtime.batch import Batch, LossFn, split_batch
from hybridtrain.runtime.memory_limit import (
    DeviceMemoryLimitError,
    LiveTensorBytes,
    cap_cuda_memory,
    tensors_alive,
)
from hybridtrain.runtime.offload import in_background_update
from hybridtrain.runtime.step_runner import MicroBatchRunner
from hybridtrain.units import format_bytes

log = logging.getLogger(__name__)

ModelFactory = Callable[[Config], nn.Module]
"""Builds the model for a config, with the same initial weights every time (seeded)."""

# ---------------------------------------------------------------- what a step starts from
@dataclass
class _StepStart:
    """What a failed step may have changed before its optimizer step began, captured
    before it: no parameter or optimizer state is copied (they change only in the step)."""

    global_step: int
    rng: dict[str, Any]
    scaler: dict[str, Any] | None
    buffers: dict[str, torch.Tensor]

    @classmethod
    def capture(cls, engine: Engine) -> _StepStart:
        return cls(engine.global_step, dev.get_rng_state(),
                   engine.scaler.state_dict() if engine.scaler is not None else None,
                   {name: b.detach().to("cpu", copy=True) for name, b in engine.module.named_buffers()})

    def restore(self, engine: Engine) -> None:
        engine.global_step = self.global_step
        if engine.scaler is not None and self.scaler is not None:
            engine.scaler.load_state_dict(self.scaler)
        with torch.no_grad():
            for name, buffer in engine.module.named_buffers():
                if name in self.buffers:
                    buffer.copy_(self.buffers[name])
        dev.set_rng_state(self.rng)


class _OptimizerSteps:
    """Notes whether any optimizer began a step (torch's global step pre-hook) while entered —
    not the background update of a step that already returned (``overlap_updates``): that
    step is complete, and a rerun of this one starts from its result."""

    def __init__(self) -> None:
        self.began = False

    def __enter__(self) -> _OptimizerSteps:
        self._hook = register_optimizer_step_pre_hook(self._began)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()

    def _began(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not in_background_update():
            self.began = True


@dataclass(frozen=True)
class PlanSwitch:
    """One out-of-memory recovery, a switch to another plan: at ``step`` a step needed ``needed_bytes``
    (when known) against ``limit_bytes`` with ``peak_bytes`` measured, and ``change`` was made."""

    step: int
    needed_bytes: int | None
    peak_bytes: int
    limit_bytes: int | None
    change: str


@dataclass(frozen=True)
class _Failure:
    needed_bytes: int | None
    peak_bytes: int
    limit_bytes: int | None

    def numbers(self) -> str:
        needed = f"needs {self.needed_bytes} bytes ({format_bytes(self.needed_bytes)}), " if self.needed_bytes else ""
        limit = (f"limit {self.limit_bytes} bytes ({format_bytes(self.limit_bytes)})" if self.limit_bytes
                 else "no limit set")
        return f"{needed}peak {self.peak_bytes} bytes ({format_bytes(self.peak_bytes)}), {limit}"


# ---------------------------------------------------------------- the guard
class MemoryGuard:
    """Runs a loop's training steps under ``device_memory_limit``, recovering from
    out-of-memory errors when ``oom_recovery.enabled`` (see the module docstring).

    >>> with MemoryGuard(engine, cfg, model_factory) as guard:
    ...     for batch in batches:
    ...         loss = guard.train_batch(batch)   # guard.engine: the engine now in use

    Args:
        engine: the engine built for ``config`` (one process).
        config: its configuration.
        model_factory: builds a fresh model for a config (recovery rebuilds the model,
            since the old one carries the old plan's wrappers); needed for recovery.
        untracked: tensors that are not device memory when training on CPU (the data set).
        scratch_dir: where the state waits on disk during a switch (default: the system's
            temporary directory).
        replan: chooses the next config from the measured peak and the limit (the planner,
            when ``config.model`` is the model the factory builds, as in ``hybridtrain
            train``); without it, or when it finds none, the next rung of
            :func:`hybridtrain.plan.variants.ladder`.

    Raises:
        ValueError: recovery asked for without a model factory, or with several processes
            (every rank would have to switch together); the limit is more than the device has.
    """

    def __init__(self, engine: Engine, config: Config, model_factory: ModelFactory | None = None, *,
                 untracked: Sequence[torch.Tensor] = (), scratch_dir: str | Path | None = None,
                 replan: Replanner | None = None) -> None:
        recovery = config.oom_recovery
        if recovery.enabled and model_factory is None:
            raise ValueError("oom_recovery.enabled needs a model factory to rebuild the model under another "
                             "plan: use hybridtrain train, or MemoryGuard(engine, config, model_factory)")
        if recovery.enabled and engine.topology.world_size > 1:
            raise ValueError(f"oom_recovery.enabled with {engine.topology.world_size} processes: recovery works in "
                             "one process (every rank would have to switch plans together); turn it off")
        self.engine = engine
        self.config = config
        self.switches: list[PlanSwitch] = []
        self._factory = model_factory
        self._untracked = list(untracked)
        self._scratch = scratch_dir
        self._replan = replan
        self._live: LiveTensorBytes | None = None

    @property
    def live(self) -> LiveTensorBytes | None:
        """The live-byte count on CPU under a limit (None otherwise)."""
        return self._live

    def __enter__(self) -> MemoryGuard:
        limit, device = self.config.device_memory_limit, self.engine.device
        if limit is not None and device.type == "cuda":
            cap_cuda_memory(limit, device)
        self._count(ignore=self._untracked)
        # What the engine holds before a step (on CUDA a switch to offload or streaming may
        # still lower it; on CPU none does).
        held = self._live.current_bytes if self._live is not None else (
            int(torch.cuda.memory_allocated(device)) if device.type == "cuda" and not self.config.oom_recovery.enabled
            else 0)
        if limit is not None and held > limit:
            self.__exit__(None, None, None)
            raise ValueError(f"device_memory_limit = {limit} bytes ({format_bytes(limit)}) but the model's parameters, "
                             f"gradients and optimizer state already take {held} bytes ({format_bytes(held)}) on "
                             f"{device} before any step; raise the limit")
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._uncount()
        if self.config.device_memory_limit is not None and self.engine.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, self.engine.device)

    def train_batch(self, batch: Batch) -> float:
        """``engine.train_batch(batch)`` under the limit; on an out-of-memory error, switch
        plans and rerun it (up to ``oom_recovery.max_attempts`` switches).

        Raises:
            torch.OutOfMemoryError: without recovery, as raised; with it, one line with the
                numbers when no attempt is left, no plan needs less memory, or the optimizer
                had begun updating parameters (then the step cannot be rerun exactly).
        """
        attempts = 0
        while True:
            start = _StepStart.capture(self.engine) if self.config.oom_recovery.enabled else None
            with _OptimizerSteps() as optimizer:
                try:
                    return self._step(batch)
                except torch.OutOfMemoryError as error:
                    if start is None:
                        raise
                    failure = self._measure(error)
            # Out of the except block: the traceback, and with it the step's tensors, is gone.
            step = start.global_step + 1
            fresh = start.global_step == 0
            if optimizer.began and not fresh:
                raise torch.OutOfMemoryError(
                    f"step {step} ran out of memory in its optimizer step ({failure.numbers()}): parameters may be "
                    "partly updated, so the step cannot be rerun; start from a plan that needs less memory "
                    "(hybridtrain plan, or zero_optimization.offload_optimizer.device: cpu)")
            attempts += 1
            if attempts > self.config.oom_recovery.max_attempts:
                raise torch.OutOfMemoryError(
                    f"step {step} still ran out of memory after {attempts - 1} plan switches "
                    f"(oom_recovery.max_attempts = {self.config.oom_recovery.max_attempts}): {failure.numbers()}")
            self._switch(batch, start, failure, rebuild_fresh=optimizer.began)

    # ------------------------------------------------------------ internals
    def _step(self, batch: Batch) -> float:
        if self._live is None:
            return self.engine.train_batch(batch)
        self._live.reset_peak()
        self._live.counting = True
        try:
            return self.engine.train_batch(batch)
        finally:
            self._live.counting = False

    def _measure(self, error: torch.OutOfMemoryError) -> _Failure:
        device = self.engine.device
        if self._live is not None:
            needed = error.needed_bytes if isinstance(error, DeviceMemoryLimitError) else self._live.refused_bytes
            return _Failure(needed, self._live.peak_bytes, self._live.limit_bytes)
        peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0
        return _Failure(None, peak, self.config.device_memory_limit)

    def _candidate(self, failure: _Failure) -> tuple[str, Config] | None:
        """The replanner's choice, else the first rung of the ladder, whose config resolves
        for this model (checked on a model built on the meta device: nothing allocated)."""
        limit = failure.limit_bytes or (torch.cuda.get_device_properties(self.engine.device).total_memory
                                        if self.engine.device.type == "cuda" else None)
        chosen = self._replan(self.config, failure.needed_bytes or failure.peak_bytes, limit) \
            if self._replan is not None and limit else None
        planned = [(describe_changes(self.config, chosen), chosen)] if chosen is not None else []
        rungs = ladder(self.config, self.engine.options.batch, self.engine.device,
                       draws_random_numbers(self.engine.module))
        for change, config in [*planned, *rungs]:
            assert self._factory is not None
            try:
                with torch.device("meta"):
                    resolve(config, self._factory(config), world_size=1)
            except (ConfigError, ValueError) as refused:
                log.info("oom_recovery: %s does not apply: %s", change, refused)
                continue
            return change, config
        return None

    def _switch(self, batch: Batch, start: _StepStart, failure: _Failure, rebuild_fresh: bool) -> None:
        step = start.global_step + 1
        candidate = self._candidate(failure)
        if candidate is None:
            raise torch.OutOfMemoryError(f"step {step} ran out of memory ({failure.numbers()}) and no plan "
                                         "computing the same math needs less memory; lower the batch size")
        change, config = candidate
        assert self._factory is not None
        loss_fn = self.engine.loss_fn
        with tempfile.TemporaryDirectory(prefix="hybridtrain-oom-", dir=self._scratch) as scratch:
            state = Path(scratch, "state")
            if not rebuild_fresh:  # parameters and optimizer state are those the step began with
                self.engine.save_checkpoint(state)
            self._uncount()
            _release(self.engine)
            gc.collect()
            if self.engine.device.type == "cuda":
                torch.cuda.empty_cache()
            # Whatever survived the old engine (a caller may hold it) is not the new one's memory.
            survivors = tensors_alive() if self._live_wanted(config) else []
            model = self._factory(config)
            example = split_batch(batch, resolve_batch_sizes(config, 1).accumulation_steps)[0]
            engine = prepare(config, model, loss_fn, None, example, world_size=1).engine
            if not rebuild_fresh:
                engine.load_checkpoint(state)
        start.restore(engine)
        self.engine, self.config = engine, config
        self.switches.append(PlanSwitch(step, failure.needed_bytes, failure.peak_bytes, failure.limit_bytes, change))
        log.warning("oom_recovery: step %d ran out of memory (%s); rerunning it with %s", step, failure.numbers(),
                    change)
        self._count(ignore=[*self._untracked, *survivors])

    def _live_wanted(self, config: Config) -> bool:
        return config.device_memory_limit is not None and self.engine.device.type == "cpu"

    def _count(self, ignore: Sequence[torch.Tensor]) -> None:
        if not self._live_wanted(self.config):
            return
        engine = self.engine
        # At the start only the engine's own tensors count: in a larger program (a notebook,
        # a test suite) other tensors alive in host memory are not this training's memory.
        self._live = LiveTensorBytes(engine.device, self.config.device_memory_limit, ignore=ignore,
                                     held=lambda: engine_tensors(engine))
        self._live.__enter__()
        self._live.counting = False  # only steps count: checkpoints and evaluations are host work

    def _uncount(self) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None


def engine_tensors(engine: Engine) -> Iterator[torch.Tensor]:
    """What an engine holds before a step: its model's parameters and buffers, their
    gradients, and the optimizer's parameters (host masters included) and state."""
    for tensor in (*engine.module.parameters(), *engine.module.buffers(),
                   *(p for group in engine.optimizer.param_groups for p in group["params"])):
        yield tensor
        if tensor.grad is not None:
            yield tensor.grad
    for entry in engine.optimizer.state.values():
        yield from (v for v in entry.values() if isinstance(v, torch.Tensor))


def _release(engine: Engine) -> None:
    """Free a replaced engine's parameters, gradients and optimizer state, even while a
    caller still holds the engine object (its host state too: the next engine's must not be
    allocated beside it)."""
    # Host updates still running in the background finish first (they write the state and
    # queue uploads); then uploads and prefetches queued on side streams may still read or
    # write the memory freed below; the allocator would hand it to the new engine meanwhile.
    engine.wait_for_updates()
    dev.synchronize(engine.device)
    engine.optimizer.zero_grad(set_to_none=True)
    engine.optimizer.state.clear()
    close = getattr(engine.optimizer, "close", None)  # the host optimizer: its worker thread and hooks
    if callable(close):
        close()
    engine.module.to_empty(device="meta")
    # A streamer holds views of its blocks' host masters (and hooks on the model that hold
    # it): close it, then drop the runner and observers.
    for observer in engine.options.observers:
        closing = getattr(observer, "close", None)
        if callable(closing) and observer is not engine.optimizer:
            closing()
    engine.options = dataclasses.replace(engine.options, runner=None, observers=())
    engine.runner = MicroBatchRunner(engine.parallel.set_grad_sync)


def initialize_guarded(model_factory: ModelFactory, config: ConfigSource, loss_fn: LossFn | None = None,
                       example_batch: Batch | None = None) -> MemoryGuard:
    """:func:`hybridtrain.initialize` for a model made by ``model_factory``, with the guard
    that runs its steps under ``device_memory_limit`` and ``oom_recovery`` (enter it around
    the training loop; ``guard.engine`` is the engine in use). The optimizer is built from
    ``config.optimizer`` (a rebuilt model needs a new one). With ``auto: true`` the planner
    chooses the plan, as for :func:`hybridtrain.initialize` (both take the one road,
    :func:`hybridtrain.prepare.prepare`); ``guard.config`` is the config chosen.

    Raises:
        ConfigError / ValueError: as :func:`hybridtrain.initialize` and :class:`MemoryGuard`.
    """
    cfg = load_config(config)
    check_autocast_math(cfg, "initialize_guarded")  # a rebuild takes the one road, autocast only
    prepared = prepare(cfg, model_factory(cfg), loss_fn, None, example_batch)
    return MemoryGuard(prepared.engine, prepared.plan.config, model_factory)
