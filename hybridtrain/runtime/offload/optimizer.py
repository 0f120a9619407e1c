"""Optimizer offload (ZeRO-Offload) on one process: fp32 master weights, gradients and
optimizer state in host memory; the update runs on the host while backward continues.

::

    backward ──► grads of bucket k complete ──► D2H (side stream) ──► worker thread:
       │            (post-accumulate hooks)       device grads freed     wait copy, accumulate
       │                                                                 into host grads,
       ▼                                                                 [eager] fused CPU step,
    grads of bucket k-1 …                                                H2D of updated weights

Parameters are grouped in *buckets* (backward order, ``reduce_bucket_size`` elements). When
the last gradient of a bucket has accumulated, its gradients are copied to the host and the
device ones released. One stepped with as it lands (one landing per step, eager step) passes
through one of a few pooled host buffers; those that must wait — summed over micro-batches,
or for a *deferred* step (clipping's global norm, fp16's global overflow check,
``nonfinite_loss: skip``) — get a lasting host buffer per bucket: 12 bytes per offloaded Adam
parameter, or 16, plus the pool (or, ``grads_wait_on_device``, wait on the device:
:mod:`~hybridtrain.runtime.offload.held_grads`, 12). A deferred step's checks run off the
critical path: as the last backward lands each bucket, the host worker unscales its gradients
(fp16) and takes their norms (clipping); the engine's :meth:`~OffloadOptimizer.unscale_and_check`
and :meth:`~OffloadOptimizer.clip_grad_norm` only combine them
(:mod:`~hybridtrain.runtime.offload.host_grad_checks`), and each bucket's update multiplies its
own gradients by the clip factor — torch's kernels, bit for bit. With
:attr:`~OffloadOptimizer.background` (``engine.overlap_updates``) the streamed blocks are then
updated on the worker after :meth:`~OffloadOptimizer.step` returns, in block order, while the
next forward starts: each block's upload waits for its own update only.

:class:`OffloadOptimizer` is the optimizer the engine and the LR scheduler see. Its
parameters are the host masters (and, with a ``ratio`` below 1, the device parameters
updated on the device — DeepSpeed's "twin-flow"), in the model's parameter order, so its
``state_dict`` has the plain optimizer's layout and checkpoints move between offloaded and
plain runs. One per-bucket inner optimizer (torch's fused CPU implementation where the
class has one) shares its ``state``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hybridtrain.runtime import transfer
from hybridtrain.runtime.device import normalize_device
from hybridtrain.runtime.offload import held_grads
from hybridtrain.runtime.offload.background_updates import PendingWeights, running_in_background
from hybridtrain.runtime.offload.bucket import Bucket
from hybridtrain.runtime.offload.device_share import DeviceShareUpdate
from hybridtrain.runtime.offload.grads import copy_grads_to_host, hook_arrivals
from hybridtrain.runtime.offload.half_uploads import STAGING_BUFFERS, HalfUploads
from hybridtrain.runtime.offload.host_bytes import HostBytes, offload_host_bytes
from hybridtrain.runtime.offload.host_grad_checks import clip_grad_norm, unscale_and_check
from hybridtrain.runtime.offload.inner_optimizer import (
    groups_over,
    inner_optimizer,
    state_over,
    sync_hyperparams,
)
from hybridtrain.runtime.offload.layout import (
    POOLED_BUFFERS,
    check_host_memory,
    chunks,
    device_kept,
    master_dtype,
)
from hybridtrain.runtime.precision.half_width import graph_uses
from hybridtrain.runtime.precision.scaling import LossScaler
from hybridtrain.runtime.step_parts import PartClock, running_clocks, step_part, work_part


class OffloadOptimizer(torch.optim.Optimizer):
    """The engine's optimizer when updates run in host memory (see the module docstring).

    Args:
        optimizer: an optimizer over the device parameters; its class, groups,
            hyperparameters and state are taken over (the state of one that has stepped —
            DeepSpeed's fp16 wrapper takes its fp16 init step when built — moves unchanged to the host
            masters, so the run continues exactly as the plain optimizer would).
        device: the compute device.
        pin_memory: page-locked host buffers (asynchronous copies on CUDA).
        host_ratio: share of the elements updated on the host; the rest (the last, or first) on the device.
        bucket_numel: elements per automatically formed bucket.
        defer: always defer the host step to :meth:`step` (clipping, fp16, skip-on-inf).
        streamed: parameter lists (blocks) that become their own host masters and whose
            gradients the caller offloads with :meth:`offload_grads`.
        grads_wait_on_host: whether gradients will wait in host memory (accumulation over
            micro-batches landing one by one, or a deferred step); only sizes the host
            memory check — buffers follow what actually happens.
        several_backwards: ids of parameters whose gradient may arrive in several backward passes of
            one micro-batch (shared by blocks that recompute in a backward of their own):
            their buckets land after the whole backward instead of on arrival.
        half_dtypes: ids of parameters autocast reads only in half
            (:func:`~hybridtrain.runtime.precision.half_width.half_width_params`): host-updated ones
            that land once per backward send their gradients down in half (exactly) when
            the backward's graph shows one cast as their only use.
        grad_norms: take each gradient's norm on the host worker as the step's last
            backward completes its bucket, for :meth:`clip_grad_norm` (gradient clipping;
            under fp16 loss scaling, once unscaled there: :meth:`unscale_on_landing`).
        grads_wait_on_device: gradients that must wait (a deferred step, a sum over
            landings) wait on the device, not in host buffers (:mod:`~.held_grads`).
        device_share_first: Twin-Flow's share is the first parameters (:func:`~.layout.device_kept`).

    Attributes:
        background: a deferred :meth:`step` updates the streamed blocks on the host worker
            after it returns, in block order; each block's next upload waits for its own
            update (``Bucket.unfinished_update``), so the next forward starts while later blocks still
            update. Until :meth:`wait_for_updates`, the blocks' parameters (their host masters) and
            this optimizer's state may still be changing: read them only after it (
            ``state_dict`` and ``load_state_dict`` wait for them first).

    Raises:
        HostMemoryError: the host state does not fit in available host memory.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, pin_memory: bool = True,
                 host_ratio: float = 1.0, bucket_numel: int = 500_000_000, defer: bool = False,
                 streamed: Sequence[Sequence[nn.Parameter]] = (), grads_wait_on_host: bool = True,
                 several_backwards: frozenset[int] = frozenset(), half_dtypes: Mapping[int, torch.dtype] | None = None,
                 grad_norms: bool = False, grads_wait_on_device: bool = False,
                 device_share_first: bool = False) -> None:
        self.device = device = normalize_device(device)
        self.pin_memory = pin_memory
        self.defer = defer
        self.grad_norms = grad_norms
        self.grads_wait_on_device = grads_wait_on_device
        self._held_inv_scale: torch.Tensor | None = None  # fp16: the step's, for held gradients' landings
        self.background = False
        self.background_resident = False
        """With :attr:`background`: the other buckets too, their device weights written
        while the next forward runs — only for a caller that runs that forward under
        :meth:`reads_wait`."""
        self._pending = PendingWeights(device)
        """Resident weights updating in the background, and a background update's failure:
        every later wait raises it (continuing would train on partly updated weights)."""
        self._clip_coef: torch.Tensor | None = None
        """The clipping factor :meth:`clip_grad_norm` found, applied by each bucket's update."""
        self._d2h = transfer.SideStream(device, "downloads")
        self._h2d = transfer.SideStream(device, "uploads")
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridtrain-host-step")
        self._jobs: list[Future[None]] = []
        # Typed as a factory: the user's class takes (params, **hyperparameters), not the
        # base class's (params, defaults).
        self._cls: Callable[..., torch.optim.Optimizer] = type(optimizer)
        self.manual_landing = False
        """Set by a whole-step runner that lands buckets itself (layer-major streaming runs
        several backward passes per micro-batch, so hook arrival counts mean nothing)."""
        streamed_ids = {id(p) for block in streamed for p in block}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        on_device = device_kept(params, host_ratio, streamed_ids, first=device_share_first)
        # A host-updated weight that autocast reads only in half has, after one backward,
        # the fp32 gradient autocast widened from a half one: narrowing it back on the
        # device is exact, and it crosses in 2 bytes. Not when it may hold a sum: several
        # backward passes of one micro-batch (several_backwards), landed for a whole step (manual), or
        # a graph that shows other uses of the weight (checked before each backward).
        self._narrow = {i: dtype for i, dtype in (half_dtypes or {}).items()
                        if i not in streamed_ids and i not in on_device and i not in several_backwards}
        self._cast_once: set[int] = set()  # those whose gradient this backward is one widened half one
        self.half_uploads = HalfUploads(self._narrow, pin_memory, device)
        """Which of them go up in half after an update, once attached to the model."""
        group_index = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
        auto = [p for p in params if id(p) not in streamed_ids and id(p) not in on_device]
        plan = [(list(block), True) for block in streamed] + \
            [(chunk, False) for chunk in chunks(list(reversed(auto)), bucket_numel)]
        largest = max((sum(p.numel() * master_dtype(p).itemsize for p in ps) for ps, _ in plan), default=0)
        staging = STAGING_BUFFERS * largest // 2 if self._narrow else 0  # half uploads' (half of fp32 bytes)
        check_host_memory(params, on_device, optimizer, grads_wait_on_host or defer, POOLED_BUFFERS * largest + staging)

        self.buckets: list[Bucket] = []
        for bucket_params, is_streamed in plan:
            self.buckets.append(Bucket.create(len(self.buckets), bucket_params, is_streamed, group_index,
                                              self.pin_memory, self.device))
        master_of = {id(p): m for b in self.buckets for p, m in zip(b.params, b.masters, strict=True)}
        self._slot_of = {id(m): (b, j) for b in self.buckets for j, m in enumerate(b.masters)}
        position = {id(p): i for i, p in enumerate(params)}
        self._first_use = {b.index: min((position[id(p)] for p in b.params), default=len(params))
                           for b in self.buckets}
        """Where each bucket's first parameter stands in the model's order: the order the
        next forward likely reads them, which background updates follow."""
        # Pooled buffers are bytes viewed as each bucket's master type (fp64 models keep fp64).
        self._pool = transfer.HostBufferPool(largest, torch.uint8, pin_memory, device, POOLED_BUFFERS)

        super().__init__(groups_over(optimizer, master_of), optimizer.defaults)
        self.state.update(state_over(optimizer, master_of))  # a stepped optimizer's, unchanged
        for bucket in self.buckets:
            if bucket.params:  # a streamed block may have none (an activation function)
                bucket.optimizer = inner_optimizer(self._cls, self, [bucket.masters], [bucket.group_of], fused=True)
        self._device_params = device_params = [p for p in params if id(p) in on_device]
        # Stepped in bounded runs: a whole-share foreach temporary would meet the held gradients.
        self._device_optimizer = DeviceShareUpdate(self._cls, self, device_params, group_index) \
            if device_params else None
        self._hooks: list[RemovableHandle] = hook_arrivals(self, several_backwards)
        self._final = False
        self._eager = False
        self._finite: torch.Tensor | None = None
        """Whether every loss of this step so far was finite, on the device: reading it in
        ``before_backward`` would drain the device before every micro-batch."""
        self.register_load_state_dict_post_hook(lambda opt: opt._after_load())  # type: ignore[attr-defined]
        transfer.note_cpu_offload(device, "optimizer offload")

    # ------------------------------------------------------------------ backward protocol
    # fp16: the step's inverse loss scale; the same during its last backward; whether one ran.
    _inv_scale: torch.Tensor | None = None
    _unscale: torch.Tensor | None = None
    _seen_backward = False

    def unscale_on_landing(self, scaler: LossScaler) -> None:
        """Before a step whose last backward lands every gradient's final sum (``train_batch``):
        the host worker unscales them with ``scaler``'s scale as they land (module docstring)."""
        self._inv_scale = scaler.inverse_scale(torch.device("cpu"))

    def unscale_and_check(self, scaler: LossScaler) -> bool:
        """Whether every gradient is finite, after ``scaler.unscale_and_check`` over the
        parameters (the same bits): the calling thread unscales what the worker did not."""
        self.wait_for_updates()
        self._inv_scale = None
        if self.grads_wait_on_device:
            return held_grads.unscale_and_check(self, scaler)
        params = [p for group in self.param_groups for p in group["params"]]
        return unscale_and_check(params, self._slot_of, self.buckets, scaler)

    def before_backward(self, final: bool, loss: torch.Tensor) -> None:
        """Called before each micro-batch's backward (``final``: last of the step).

        The eager step needs every micro-batch's loss to be finite: a step the engine
        will skip or refuse must not have touched the host masters. That is decided on the
        host worker, from a flag copied down with the gradients, never here (no sync).
        """
        with step_part("host_optimizer"):
            self._wait()
        # Read from the graph before backward frees it (the landing hooks run during it).
        once, other, read = graph_uses(loss, self._narrow) if self._narrow and not self.manual_landing else (set(),) * 3
        self.half_uploads.observe(read, other, final)
        self._cast_once = once
        for bucket in self.buckets:
            bucket.begin_backward()
        # The last backward lands final sums: the worker unscales those that land once in one.
        self._unscale = self._inv_scale if final and (self._seen_backward or self.manual_landing) else None
        self._seen_backward = True
        if not self.defer:
            finite = torch.isfinite(loss.detach()).all()
            self._finite = finite if self._finite is None else self._finite & finite
        self._final = final
        self._eager = final and not self.defer

    def after_backward(self, final: bool) -> None:
        """Called after each micro-batch's backward: land what no hook landed (unused
        parameters, streamed blocks left over); at the end of the step wait for the host."""
        for bucket in self.buckets:
            # Streamed buckets are landed by their streamer (their parameters may already
            # hold the exposed host gradients).
            if not bucket.streamed and any(p.grad is not None for p in bucket.params):
                self.offload_grads(bucket.index)
        self._cast_once = set()
        if final:
            with step_part("host_optimizer"):
                self._wait()
            for bucket in self.buckets:
                bucket.expose_grads()

    def offload_grads(self, index: int, then: Callable[[], None] | None = None,
             grads: Sequence[torch.Tensor | None] | None = None) -> None:
        """Land bucket ``index``'s gradients (``grads``, one per parameter, else the released
        ``.grad``; half ones cross as they are and are widened exactly): copied to the host for
        the worker to sum or step with, or held on the device (``grads_wait_on_device``).
        ``then`` runs once they are taken, before the worker may touch the bucket (layer
        streaming points the parameters back at the masters)."""
        copy_grads_to_host(self, index, then, grads)

    # ------------------------------------------------------------------ host side (worker)
    def _step_bucket(self, bucket: Bucket, grads: list[torch.Tensor] | None = None,
                     coef: torch.Tensor | None = None, background: bool = False,
                     clocks: Sequence[PartClock] | None = None) -> None:
        """Update ``bucket`` (once per step): its gradients × ``coef`` (clipping) first.
        ``background``: queued by :meth:`step`, which copied its hyperparameters (it runs
        after the LR scheduler has moved on) and counted its bytes (it may run after the
        step returned, as may ``clocks``: the step's part clocks it counts on)."""
        # Gradients put on the masters directly count too, as for any torch optimizer
        # (DeepSpeed's fp16 init step gives every parameter a zero one).
        given = grads is None and any(m.grad is not None for m in bucket.masters)
        if bucket.stepped or not (any(bucket.has_grad) or given):
            return
        assert bucket.optimizer is not None
        bucket.expose_grads(grads)
        if not background:
            sync_hyperparams(bucket.optimizer, self)
        with work_part("host_step", clocks):
            if coef is not None:  # as torch.nn.utils.clip_grads_with_norm_ multiplies host gradients
                for master in bucket.masters:
                    if master.grad is not None:
                        master.grad.mul_(coef)
            bucket.optimizer.step()
        bucket.stepped = True
        if grads is not None:  # borrowed from the pool: nothing may keep reading them
            for master in bucket.masters:
                master.grad = None
        if not bucket.streamed:
            # Overwrite the device weights only after the kernels that read them: those ran
            # before the gradient copy (the host also waited for it; this says so to CUDA).
            with step_part("transfer"), self._h2d.after(bucket.copied):
                self.half_uploads.send(bucket)
                if not background:
                    transfer.count_bytes("weights_up", self.half_uploads.bytes_up(bucket))
                bucket.uploaded = self._h2d.record()
                self.half_uploads.sent(bucket.uploaded)

    def _wait(self) -> None:
        # Every job finishes before the first error is raised: none may still run unseen
        # while the caller resets the buckets.
        jobs, self._jobs = self._jobs, []
        errors = [job.exception() for job in jobs]
        for bucket in self.buckets:
            bucket.update = None
        self._pending.settled(self.buckets)
        first = next((e for e in errors if e is not None), None)
        if first is not None and self._pending.failed is None and self.background:
            self._pending.failed = first
        if self._pending.failed is not None:
            raise self._pending.failed
        if first is not None:
            raise first

    def wait_for_updates(self) -> None:
        """Wait for every update still running in the background (:attr:`background`):
        afterwards the parameters and the state are the step's result.

        Raises:
            Exception: the first error of a background update.
        """
        with step_part("host_optimizer"):
            self._wait()

    # ------------------------------------------------------------------ optimizer API
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Finish the step: update every bucket the eager path did not, the device-kept
        parameters, and make the compute stream wait for the updated weights.

        Raises:
            ValueError: a closure was given (offloaded steps cannot re-evaluate the loss).
        """
        if closure is not None:
            raise ValueError("OffloadOptimizer.step does not take a closure")
        coef, self._clip_coef = self._clip_coef, None
        later = [b for b in self.buckets if self.background and (b.streamed or self.background_resident)
                 and not b.stepped and b.optimizer is not None and b.has_work]
        with step_part("host_optimizer"):
            self._wait()
            # What does not update in the background updates here; the rest on the worker,
            # in the order the next forward reads it (uploads and reads wait for their own).
            for bucket in self.buckets:
                if not any(bucket is b for b in later):
                    if bucket.has_held:  # streamed down and stepped on the worker
                        held_grads.land_held(self, bucket, coef)
                    else:
                        self._step_bucket(bucket, coef=coef)
            if self.grads_wait_on_device:
                self._wait()
            clocks = running_clocks()
            ordered = sorted(later, key=lambda b: self._first_use[b.index])
            for bucket in ordered:
                assert bucket.optimizer is not None
                sync_hyperparams(bucket.optimizer, self)  # the scheduler moves on before it runs
                if not bucket.has_held:
                    bucket.update = self._worker.submit(self._update_in_background, bucket, coef, clocks)
                    self._jobs.append(bucket.update)
                if not bucket.streamed:
                    transfer.count_bytes("weights_up", self.half_uploads.bytes_up(bucket))
                    self._pending.watch(bucket)
            held_grads.land_held_later(self, [b for b in ordered if b.has_held], coef, clocks)
        if self._device_optimizer is not None:
            self._device_optimizer.step()
        for bucket in self.buckets:
            if bucket.update is None:
                transfer.compute_waits(bucket.uploaded, self.device)
                bucket.uploaded = None

    def reads_wait(self) -> AbstractContextManager[Any]:
        """On this thread, the first op that reads a device weight still updating in the
        background (:attr:`background_resident`) waits for its update first."""
        return self._pending.reads_wait()

    @property
    def resident_pending(self) -> bool:
        """Whether device weights are still updating in the background."""
        return bool(self._pending)

    def _update_in_background(self, bucket: Bucket, coef: torch.Tensor | None, clocks: list[PartClock]) -> None:
        with running_in_background():
            self._step_bucket(bucket, coef=coef, background=True, clocks=clocks)
        bucket.clear()  # zero_grad left it alone while this ran

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new step: clear host and device gradients (always released). Buckets
        still updating in the background (:attr:`background`) clear themselves."""
        busy = [b for b in self.buckets if b.update is not None and not b.update.done()]
        if not busy:
            self._wait()
        busy_masters = {id(m) for b in busy for m in b.masters}
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in busy_masters:
                    p.grad = None
        for bucket in self.buckets:
            if not any(bucket is b for b in busy):
                bucket.clear()
        self._finite = None
        self._clip_coef = None
        self._held_inv_scale = None

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients' global 2-norm to ``max_norm`` exactly as
        ``torch.nn.utils.clip_grad_norm_`` over the host gradients would (same norm, same
        factor, same bits), with the work off the critical path: the per-gradient norms
        were taken as the buckets landed (``grad_norms``), and each bucket's update
        multiplies its own gradients first.

        Returns:
            The total norm before clipping.
        """
        self.wait_for_updates()
        if self.grads_wait_on_device:
            total, self._clip_coef = held_grads.clip_grad_norm(self, max_norm)
            return total
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        total, self._clip_coef = clip_grad_norm(params, self._slot_of, max_norm, self._device_optimizer is not None)
        return total

    def state_dict(self) -> dict[str, Any]:
        """The plain optimizer's ``state_dict`` (after any background update)."""
        self.wait_for_updates()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain optimizer's ``state_dict`` (after any background update)."""
        self.wait_for_updates()
        super().load_state_dict(state_dict)

    def _after_load(self) -> None:
        """After ``load_state_dict``: re-share the state and refresh masters from the
        (already loaded) model parameters."""
        for bucket in self.buckets:
            if bucket.optimizer is not None:
                bucket.optimizer.state = self.state
        self.refresh_masters()
        if self._device_optimizer is not None:
            self._device_optimizer.state = self.state

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the model's device weights into the host masters: after something wrote the
        weights directly (a model-only checkpoint load), the next update starts from them.
        Streamed blocks' parameters *are* their masters; a weight that went up in half
        and was not loaded since keeps its master."""
        self.wait_for_updates()
        for bucket in self.buckets:
            if not bucket.streamed:
                for p, m in zip(bucket.params, bucket.masters, strict=True):
                    if id(p) not in self.half_uploads.rounded:
                        m.data.copy_(p.detach())

    def close(self) -> None:
        """Stop the host worker, remove the gradient hooks and drop the host state: a closed
        optimizer cannot step, and whoever still holds it (an engine replaced after an OOM)
        no longer holds its pinned host memory. Background updates finish first (an error
        of theirs is raised once all is released); weights that went up in half get their
        exact masters (a rebuilt engine takes its masters from them)."""
        try:
            self._wait()
            self.half_uploads.exact()
        finally:
            self._release()

    def _release(self) -> None:
        self._worker.shutdown(wait=True)
        self.half_uploads.detach()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.state.clear()
        for group in self.param_groups:
            group["params"] = []
        for bucket in self.buckets:
            bucket.release()
        self._pool = transfer.HostBufferPool(0, torch.uint8, False, torch.device("cpu"), 0)

    @property
    def host_numel(self) -> int:
        """Elements whose master weights and state live in host memory."""
        return sum(b.flat_master.numel() for b in self.buckets)

    def host_bytes(self) -> HostBytes:
        """The host memory this optimizer allocated, persistent and staging (:mod:`~.host_bytes`)."""
        return offload_host_bytes(self.buckets, self.state, self._pool, self.half_uploads.staging_bytes)

