"""``PipelineEngine``: DeepSpeed's pipeline engine surface (``train_batch``, ``eval_batch``,
the stage queries, the data iterator) over a hybridtrain engine.

``train_batch()`` pulls ``gradient_accumulation_steps`` micro-batches ``(inputs, labels)``
from the data iterator, as DeepSpeed's ``PipelineEngine.train_batch`` does, and runs them
as one hybridtrain step: concatenated, the engine splits them back into the same
micro-batches, each loss weighted ``1 / gradient_accumulation_steps``, one optimizer step;
the value returned is the micro-batches' mean loss, averaged over the data-parallel
replicas, on every rank (DeepSpeed's ``_aggregate_total_loss`` and its broadcast to the
pipeline's ranks).

A pipeline split over several processes needs one micro-batch to trace the activation
shapes between stages. With ``training_data`` the engine is built inside ``initialize``;
with a data iterator given to ``train_batch(data_iter=…)`` only (Megatron's way) it is
built from the first micro-batch of the first ``train_batch``/``eval_batch``; until then
``engine.optimizer`` is the caller's optimizer (or None) and checkpoints cannot be loaded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from hybridtrain.config import BatchSizes, Config
from hybridtrain.deepspeed.engine import DeepSpeedEngine
from hybridtrain.deepspeed.pipe.module import PipelineModule
from hybridtrain.engine import Engine
from hybridtrain.runtime.batch import Batch, batch_size

log = logging.getLogger("hybridtrain.deepspeed")


class PipelineError(Exception):
    """A DeepSpeed call that a pipeline engine does not take (DeepSpeed's ``PipelineError``)."""


class PipelineLoss:
    """The engine's ``loss_fn(outputs, batch)`` for a :class:`PipelineModule`: the module's
    ``loss_fn(outputs, labels)`` on the last stage, or the last layer's output itself.
    It can keep the outputs it sees (``eval_batch(return_logits=True)``)."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> None:
        self.loss_fn = loss_fn
        self.keep_outputs = False
        self.outputs: Any = None

    def __call__(self, outputs: Any, batch: Batch) -> torch.Tensor:
        if self.keep_outputs:
            self.outputs = outputs.detach() if isinstance(outputs, torch.Tensor) else outputs
        loss = self.loss_fn(outputs, batch[1]) if self.loss_fn is not None else outputs
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"PipelineModule: the loss must be one-element tensor, got {_describe(loss)} "
                            "(several losses per micro-batch are not supported)")
        return loss.reshape(())


@dataclass(frozen=True)
class StagePlace:
    """Where this process sits: its stage among ``num_stages`` and its global rank."""

    stage_id: int
    num_stages: int
    rank: int
    world_size: int


class PipelineEngine(DeepSpeedEngine):
    """What ``deepspeed.initialize`` returns for a :class:`PipelineModule`.

    Args:
        module: the pipeline module.
        config: the config the engine is built from.
        batch: the resolved batch sizes.
        place: this process's stage and rank.
        build: builds the hybridtrain engine from one example micro-batch.
        loss: the loss function handed to the engine.
        optimizer / lr_scheduler: what ``engine.optimizer``/``engine.lr_scheduler`` are
            before the engine is built (the caller's, or None).
    """

    def __init__(self, module: PipelineModule, config: Config, batch: BatchSizes, place: StagePlace,
                 build: Callable[[Batch], Engine], loss: PipelineLoss, optimizer: Any = None,
                 lr_scheduler: Any = None) -> None:
        self._built: Engine | None = None
        super().__init__(cast(Engine, None), config)  # the hybridtrain engine comes from _build
        self._module = module
        self._batch = batch
        self.place = place
        self._build = build
        self._loss = loss
        self._given = (optimizer, lr_scheduler)
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self._print_clock = (time.perf_counter(), 0)
        self.num_stages = place.num_stages
        self.stage_id = place.stage_id
        self.micro_batches = batch.accumulation_steps
        self.micro_batch_size = batch.micro_batch

    def writes_deepspeed_layout(self) -> bool:
        """Never: DeepSpeed saves a pipeline by layer files (``layer_NN-model_states.pt``), a
        layout not written here; hybridtrain's sharded checkpoint goes in the tag directory."""
        return False

    # ------------------------------------------------------------------ the engine
    @property
    def engine(self) -> Engine:
        """The hybridtrain engine.

        Raises:
            RuntimeError: not built yet (no training_data was given, no batch run yet).
        """
        if self._built is None:
            raise RuntimeError("the pipeline engine is built at the first train_batch/eval_batch (initialize got no "
                               "training_data to take the activation shapes from); call this after it")
        return self._built

    @engine.setter
    def engine(self, value: Engine | None) -> None:
        self._built = value

    @property
    def built(self) -> bool:
        """Whether the hybridtrain engine exists (see the module docstring)."""
        return self._built is not None

    def build(self, example: Batch) -> Engine:
        """Build the hybridtrain engine from one micro-batch ``(inputs, labels)`` (once)."""
        if self._built is None:
            self._built = self._build(example)
        return self._built

    # ------------------------------------------------------------------ training
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from
        ``data_iter`` (or the iterator set before, or the ``training_data`` loader).

        Returns:
            The mean of the micro-batches' losses, averaged over the replicas (every rank).

        Raises:
            RuntimeError: gradients are disabled, or there is no data iterator.
            StopIteration: the iterator ran out (wrap it in ``RepeatingLoader``).
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        micro = self._pull(self.data_iterator, self.micro_batches, "train_batch")
        value = self.build(micro[0]).train_batch(_concat(micro))
        self.agg_train_loss = torch.tensor(value, device=self.device)
        self._report(value)
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """The mean loss of ``num_micro_batches`` (default: gradient_accumulation_steps)
        micro-batches from ``data_iter``, without gradients.

        Returns:
            The loss (every rank; with ``bcast_loss=False`` only the last stage, None
            elsewhere), and with ``return_logits`` also the last micro-batch's outputs
            (last stage; None elsewhere).

        Raises:
            ValueError: an option this engine does not implement.
        """
        if reduce_output != "avg":
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}) is not supported; allowed: 'avg'")
        if not compute_loss and self._module.loss_fn is not None:
            raise ValueError("eval_batch(compute_loss=False) with a loss_fn is not supported (it averages the raw "
                             "outputs); allowed: compute_loss=True")
        count = self.micro_batches if num_micro_batches is None else num_micro_batches
        if count != self.micro_batches and self.num_stages > 1 and self.place.world_size > 1:
            raise ValueError(f"eval_batch(num_micro_batches={count}): across pipeline processes evaluation runs "
                             f"gradient_accumulation_steps={self.micro_batches} micro-batches; leave it None")
        micro = self._pull(data_iter, count, "eval_batch")
        engine = self.build(micro[0])
        self._loss.keep_outputs, self._loss.outputs = return_logits, None
        try:
            value = engine.eval_batch(_concat(micro))
        finally:
            self._loss.keep_outputs = False
        loss = torch.tensor(value, device=self.device) if bcast_loss or self.is_last_stage() else None
        if return_logits:
            outputs, self._loss.outputs = self._loss.outputs, None
            return loss, outputs
        return loss

    def _pull(self, iterator: Iterator[Any] | None, count: int, caller: str) -> list[tuple[Any, Any]]:
        if iterator is None:
            raise RuntimeError(f"{caller}: no data; pass data_iter=… or give initialize training_data=…")
        micro = []
        for _ in range(count):
            batch = next(iterator)
            if self.batch_fn is not None:
                batch = self.batch_fn(batch)
            if not isinstance(batch, list | tuple) or len(batch) < 2:
                raise TypeError(f"{caller}: a micro-batch must be (inputs, labels), got {_describe(batch)}")
            micro.append((batch[0], batch[1]))
        sizes = [batch_size(m) for m in micro]
        if len(set(sizes)) > 1:
            raise ValueError(f"{caller}: micro-batches of {sizes} samples; they must be equal (set "
                             "dataloader_drop_last: true, or a dataset size that is a multiple of the micro-batch)")
        return micro

    def _report(self, loss: float) -> None:
        """DeepSpeed's line every ``steps_per_print`` steps, on rank 0."""
        started, steps = self._print_clock
        steps += 1
        every = self.steps_per_print()
        if self.global_steps % every:
            self._print_clock = (started, steps)
            return
        now = time.perf_counter()
        self._print_clock = (now, 0)
        if self.global_rank == 0:
            step_time = (now - started) / max(steps, 1)
            print(f"steps: {self.global_steps} loss: {loss:0.4f} iter time (s): {step_time:0.3f} "
                  f"samples/sec: {self.train_batch_size() / step_time:0.3f}", flush=True)

    # ------------------------------------------------------------------ DeepSpeed's pipeline surface
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def set_dataloader(self, loader: Iterable[Any]) -> None:
        """Train from ``loader`` (iterated now)."""
        self.training_dataloader = loader
        self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """Train from ``iterator``."""
        self.training_dataloader = None
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Apply ``fn`` to every micro-batch pulled from the iterator."""
        self.batch_fn = fn

    def is_gradient_accumulation_boundary(self) -> bool:
        """False: the pipeline steps inside ``train_batch`` only (as DeepSpeed's)."""
        return False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    # ------------------------------------------------------------------ readings before the build
    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def device(self) -> torch.device:
        if self._built is not None:
            return self._built.device
        from hybridtrain.deepspeed.accelerator import get_accelerator

        return get_accelerator().device(get_accelerator().current_device())

    @property
    def optimizer(self) -> Any:
        return self._built.optimizer if self._built is not None else self._given[0]

    @property
    def lr_scheduler(self) -> Any:
        return self._built.scheduler if self._built is not None else self._given[1]

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        if self._built is not None:
            self._built.scheduler = scheduler
        else:
            self._given = (self._given[0], scheduler)

    @property
    def global_steps(self) -> int:
        return self._built.global_step if self._built is not None else 0

    @property
    def micro_steps(self) -> int:
        return self.global_steps * self.micro_batches

    @property
    def skipped_steps(self) -> int:
        return self._built.skipped_steps if self._built is not None else 0

    @property
    def global_rank(self) -> int:
        return self.place.rank

    @property
    def world_size(self) -> int:
        return self.place.world_size

    @property
    def dp_world_size(self) -> int:
        return self._batch.data_parallel

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self._batch.accumulation_steps

    def train_batch_size(self) -> int:
        return self._batch.global_batch

    def __getattr__(self, name: str) -> Any:
        # nn.Module's own (the module is a child), then unknown attributes read through to the
        # module, built or not (as DeepSpeed's engine).
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            pass
        # (no children yet while nn.Module.__init__ runs: named_children would come back here)
        module = dict(self.named_children()).get("_module") if "_modules" in self.__dict__ else None
        if not name.startswith("__") and module is not None and hasattr(module, name):
            return getattr(module, name)
        raise AttributeError(f"'PipelineEngine' (hybridtrain.deepspeed) has no attribute {name!r}, and the "
                             "module has none either")


def _concat(micro: Sequence[Any], size: int | None = None) -> Any:
    """The micro-batches as one batch, which the engine splits back into the same
    micro-batches: tensors with the batch first are concatenated along it; a tensor without
    it (a mask shared by the samples) must be the same in every micro-batch and is kept
    once; tuples and lists go position by position.

    Raises:
        ValueError: a tensor without the batch dimension differs between micro-batches, or
            its first dimension equals the whole batch (the split would cut it).
    """
    size = batch_size(micro[0]) if size is None else size
    first = micro[0]
    if isinstance(first, torch.Tensor):
        if first.dim() and first.shape[0] == size:
            return torch.cat(list(micro))
        if any(not torch.equal(first, other) for other in micro[1:]):
            raise ValueError(f"a micro-batch tensor of shape {tuple(first.shape)} has no batch dimension first "
                             f"(micro-batch size {size}) and differs between micro-batches; put the batch first")
        if first.dim() and first.shape[0] == size * len(micro):
            raise ValueError(f"a micro-batch tensor of shape {tuple(first.shape)} has no batch dimension first and its "
                             f"first dimension equals the step's {size * len(micro)} samples; put the batch first")
        return first
    if isinstance(first, list | tuple):
        return type(first)(_concat([m[i] for m in micro], size) for i in range(len(first)))
    raise TypeError(f"a micro-batch holds a {type(first).__name__}; allowed: tensors and tuples/lists of tensors")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
