"""Layer-major streaming: each streamed block runs over every micro-batch before the next
block does, so a block's weights cross the host⇄device bus once per step (and its
gradients once back) instead of once per micro-batch.

::

    forward    block 0: mb 0 … mb k-1 ─► block 1: mb 0 … mb k-1 ─► … ─► head + loss: mb 0 … mb k-1
               (block i uploaded once; block i+1 … i+p uploading meanwhile)
    backward   loss: mb 0 … mb k-1 ─► block N-1: mb 0 … mb k-1 ─► land N-1 (one D2H, eager host
               step) ─► block N-2: mb 0 … mb k-1 ─► land N-2 ─► … ─► block 0 (+ embeddings)
               ─► land 0

A model's ``forward`` loops over its blocks for one input, and a Hugging Face model's
forward cannot be cut into pieces from outside. So each micro-batch's forward runs
unmodified in its own worker thread and the workers take turns: a forward pre-hook on every
streamed block hands the turn to the next micro-batch (round robin), which makes the order
block-major. Only one worker runs at any moment, so the streamer, the activation swapper and
the random generator see one sequential program; thread-local state (grad mode, autocast,
saved-tensor hooks) belongs to each micro-batch.

A forward hook cuts the autograd graph at every streamed block's output: the rest of the
model sees a detached leaf. Backward then runs segment by segment — the loss's segment for
every micro-batch, then block N-1's for every micro-batch (seeded with the leaf's
``.grad``), and so on. Everything that consumes block i's output ran after it in forward,
so its segment is backwarded before block i's: the leaf's gradient is complete when block i
needs it. Block i's parameter gradients accumulate over the micro-batches in micro-batch
order on the device — the plain accumulation loop's sum — and land on the host in one copy,
where the host optimizer updates block i while block i-1 computes (deferred to the end of
the step when clipping, fp16 or ``nonfinite_loss: skip`` need every gradient first).

With ``keep_blocks_for_backward`` the last blocks are not freed after their forward:
backward reaches them first, so they wait the shortest, and it sends nothing up for them.
With all blocks kept every weight crosses once per step (a half-width one at 2 bytes per
parameter) and the device holds every streamed block at the turn from forward to backward.

Dropout draws from the shared generator in execution order, so with dropout the masks
differ from micro-batch-major order (same distribution); everything else is the plain loop's
math.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from hybridtrain.compat import tree_flatten, tree_unflatten
from hybridtrain.runtime.activations.swapping import ActivationSwapper
from hybridtrain.runtime.batch import Batch
from hybridtrain.runtime.precision.scaling import reported_loss
from hybridtrain.runtime.step_runner import StepContext
from hybridtrain.runtime.streaming.streamer import LayerStreamer
from hybridtrain.runtime.thread_counters import counters_here, counting_with


class _Aborted(BaseException):
    """Raised in a waiting worker when another one failed (a BaseException, so model code
    that catches ``Exception`` does not swallow it)."""


class _Turns:
    """Round-robin turns among the workers of one step: exactly one holds the turn.

    ``wait`` and ``give_turn_to_next`` are called from the worker threads, ``finish`` once by each
    worker as it ends; a failed worker's error makes every waiting worker abort.
    """

    def __init__(self, count: int) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._live = [True] * count
        self.error: BaseException | None = None

    def wait(self, worker: int) -> None:
        """Block until ``worker`` holds the turn.

        Raises:
            _Aborted: another worker failed.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._turn == worker or self.error is not None)
            if self.error is not None:
                raise _Aborted

    def give_turn_to_next(self, worker: int) -> None:
        """The holder ``worker`` gives the turn to the next live worker (itself if alone)."""
        with self._cond:
            self._turn = self._next(worker)
            self._cond.notify_all()

    def finish(self, worker: int, error: BaseException | None) -> None:
        """``worker`` ended (with ``error`` if it failed): the turn moves on."""
        with self._cond:
            self._live[worker] = False
            if error is not None and self.error is None:
                self.error = error
            self._turn = self._next(worker)
            self._cond.notify_all()

    def _next(self, worker: int) -> int:
        count = len(self._live)
        for step in range(1, count + 1):
            if self._live[(worker + step) % count]:
                return (worker + step) % count
        return -1


_Boundary = tuple[list[torch.Tensor], list[torch.Tensor]]
"""A block's output tensors in one micro-batch's graph, and the leaves that replaced them."""


class LayerMajorRunner:
    """Runs a training step's forwards and backwards block-major (see the module docstring);
    a :class:`~hybridtrain.runtime.step_runner.StepRunner`.

    Args:
        streamer: the layer streamer of the model's streamed blocks. Outside
            :meth:`forward_backward` (evaluation, the forward/backward/step trio) its own
            hooks stream the blocks one micro-batch at a time, with the same math.
        swapper: the activation swapper of the blocks (``boundary_activations: host``),
            told the block-major backward order so that it prefetches what comes next.
    """

    def __init__(self, streamer: LayerStreamer, swapper: ActivationSwapper | None = None) -> None:
        self.streamer = streamer
        self.swapper = swapper
        self._scopes: list[list[int | None]] = []
        self._local = threading.local()
        self._turns = _Turns(0)
        self._boundaries: list[list[_Boundary | None]] = []
        self._handles: list[RemovableHandle] = []
        for block in streamer.blocks:
            # Prepended: the turn changes hands before any other hook sees the block start.
            self._handles.append(block.module.register_forward_pre_hook(
                lambda _m, _a, i=block.index: self._before_block(i), prepend=True))
            self._handles.append(block.module.register_forward_hook(
                lambda _m, _a, out, i=block.index: self._after_block(i, out)))

    # ------------------------------------------------------------------ the step
    whole_steps_only = False

    def forward_backward(self, micro_batches: Sequence[Batch], step: StepContext) -> torch.Tensor:
        """Forward and backward of every micro-batch, block-major; gradients end on the host
        (and eagerly updated blocks) as after the engine's micro-batch loop. Timed as
        ``interleaved``.

        Returns:
            The weighted sum of the micro-batches' losses (detached, fp32).
        """
        with step.timed("interleaved"):
            return self._step(micro_batches, step.loss_of, step.weight, step.scale)

    def evaluate(self, batch: Batch) -> torch.Tensor:
        """Not used: outside a step the streamer's own hooks stream the blocks."""
        raise NotImplementedError

    def _step(self, micro_batches: Sequence[Batch], loss_of: Callable[[Batch], torch.Tensor],
              weight: float, scale: float) -> torch.Tensor:
        streamer = self.streamer
        streamer.driven = True
        streamer.optimizer.manual_landing = True
        try:
            losses = self._forward(micro_batches, loss_of)
            total = torch.zeros((), device=losses[0].device)
            for loss in losses:
                total += reported_loss(loss) * weight
            streamer.before_backward(True, torch.stack([reported_loss(loss) for loss in losses]))
            if self.swapper is not None:  # backward: block N-1 for every micro-batch, then N-2, …
                self.swapper.expect_backward_order(
                    [seq for scopes in reversed(self._scopes) for seq in scopes if seq is not None])
            for loss in losses:
                scaled = loss * weight
                (scaled * scale if scale != 1.0 else scaled).backward()
            del losses
            for index in reversed(range(len(streamer.blocks))):
                self._backward_block(index)
            streamer.after_backward(True)
            return total
        finally:
            self._boundaries, self._scopes = [], []
            if self.swapper is not None:
                self.swapper.expect_backward_order(())
            # A failed worker's exception holds its frames (the model, device tensors): drop
            # it, or a caller that catches an OOM and carries on never gets the memory back.
            self._turns = _Turns(0)
            for index in range(len(streamer.blocks)):  # after a failure nothing stays loaded
                streamer.release(index)
            streamer.driven = False
            streamer.optimizer.manual_landing = False

    def _forward(self, micro_batches: Sequence[Batch], loss_of: Callable[[Batch], torch.Tensor]) -> list[torch.Tensor]:
        count = len(micro_batches)
        self._turns = _Turns(count)
        self._boundaries = [[None] * count for _ in self.streamer.blocks]
        self._scopes = [[None] * count for _ in self.streamer.blocks]
        losses: list[torch.Tensor | None] = [None] * count
        device = self.streamer.device
        # The caller's counters (a device_memory_limit's live bytes, the profiler's FLOPs:
        # dispatch modes are per thread) must see the forwards: the workers join them.
        counters = counters_here()

        def work(worker: int) -> None:
            self._local.worker = worker
            error: BaseException | None = None
            try:
                # The current CUDA device is per thread; the micro-batch must run on ours.
                with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(), \
                        counting_with(counters):
                    self._turns.wait(worker)
                    losses[worker] = loss_of(micro_batches[worker])
            except _Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                error = exc
            finally:
                self._turns.finish(worker, error)

        threads = [threading.Thread(target=work, args=(m,), name=f"hybridtrain-micro-{m}", daemon=True)
                   for m in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self._turns.error is not None:
            raise self._turns.error
        return [loss for loss in losses if loss is not None]

    def _backward_block(self, index: int) -> None:
        """Block ``index``'s backward for every micro-batch, then its gradients to the host."""
        self.streamer.enter(index, backward=True)
        boundaries, self._boundaries[index] = self._boundaries[index], []
        params = self.streamer.blocks[index].bucket.params
        half = [j for j, is_half in enumerate(self.streamer.half_width(index)) if is_half]
        # A half weight's gradient is half per micro-batch; the plain loop widens each to
        # fp32 (autocast's cast backward) and sums them in fp32: so here, on the device, in
        # micro-batch order — a half .grad would sum them in half precision.
        sums: list[torch.Tensor | None] | None = [None] * len(params) if half and len(boundaries) > 1 else None
        for boundary in boundaries:
            if boundary is None:
                continue
            outputs, leaves = boundary
            pairs = [(out, leaf.grad) for out, leaf in zip(outputs, leaves, strict=True) if leaf.grad is not None]
            if pairs:
                torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
            if sums is not None:
                for j in half:
                    grad, params[j].grad = params[j].grad, None
                    if grad is not None:
                        total = sums[j]
                        sums[j] = grad.float() if total is None else total.add_(grad)
        del boundaries  # the segment's graph and saved activations go now
        if sums is None:
            self.streamer.offload_grads(index)
        else:
            self.streamer.offload_given_grads(index, [sums[j] if j in half else p.grad for j, p in enumerate(params)])

    # ------------------------------------------------------------------ hooks
    def _worker(self) -> int | None:
        # Only the workers of a running step carry an index; evaluation and the manual
        # forward/backward/step trio run the model on the caller's thread untouched.
        worker: int | None = getattr(self._local, "worker", None)
        return worker if self.streamer.driven else None

    def _before_block(self, index: int) -> None:
        worker = self._worker()
        if worker is None:
            return
        self._turns.give_turn_to_next(worker)
        self._turns.wait(worker)
        self.streamer.enter(index)

    def _after_block(self, index: int, output: Any) -> Any:
        worker = self._worker()
        if worker is None:
            return None
        if self._boundaries[index][worker] is not None:
            # A second boundary would orphan the first one's graph: gradients would be lost.
            raise RuntimeError(f"streamed block {index} ran twice in one forward; layer-major order needs "
                               "each block to run once per micro-batch; set layer_streaming.layer_major: false")
        leaves, spec = tree_flatten(output)
        cut = [j for j, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        replaced = list(leaves)
        for j in cut:
            replaced[j] = leaves[j].detach().requires_grad_()
        self._boundaries[index][worker] = ([leaves[j] for j in cut], [replaced[j] for j in cut])
        if self.swapper is not None:
            self._scopes[index][worker] = self.swapper.last_scope(self.streamer.blocks[index].module)
        # The last micro-batch is through: the device copy can go — except the last block's,
        # which backward needs first, and those kept for backward (not uploaded again).
        if worker == len(self._boundaries[index]) - 1 and not self.streamer.kept_for_backward(index):
            self.streamer.release(index)
        return tree_unflatten(replaced, spec) if cut else None

    def remove(self) -> None:
        """Detach the runner's hooks from the blocks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
