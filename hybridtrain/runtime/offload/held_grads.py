"""Gradients that wait on the device (``gradients_wait: device``): the host holds 12 bytes
per offloaded AdamW parameter (fp32 master, two moments) and no fp32 gradient copy, even
when something defers the host step.

::

    backward ─► bucket k complete ─► held on the device, at the width backward gave it
       │                             (a second landing in the step: widened, summed in fp32)
       ▼
    step: fp16 unscale + check, clipping norms ─ on widened temporaries, one tensor at a time
       ─► bucket by bucket: D2H into a pooled host buffer (3 at most) ─► host worker:
          widen, unscale (fp16), × clip factor, fused CPU step, upload; the buffer returns

The same kernels on the same values as gradients waiting in host memory
(:mod:`~hybridtrain.runtime.offload.grads`): a sum is fp32 ``+`` in landing order, the
unscale multiplies the fp32 gradient by the scaler's inverse scale, the norm is taken of the
fp32 (unscaled) gradient, and the host multiplies by the clip factor before stepping. When
nothing defers the step (accumulation alone), the step's last landing adds to the held sum
and steps at once from the pool, as the eager path does.

With background updates (``engine.overlap_updates``), with or without a device share
(Twin-Flow, stepped in bounded runs), the streamed blocks' buckets land from a landing thread
in the order the next forward reads them (:func:`land_held_later`): the step returns at once,
and each block's next upload waits for its own update only.

The price is device memory: every offloaded gradient of the step waits there until the
step streams it down (the planner's ``gradients_wait: device`` mode counts it), with
background updates into the next forward's first block.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from hybridtrain.compat import unscale_and_check_
from hybridtrain.runtime import transfer
from hybridtrain.runtime.offload.background_updates import running_in_background
from hybridtrain.runtime.offload.bucket import Bucket
from hybridtrain.runtime.precision.scaling import LossScaler, found_inf_flag
from hybridtrain.runtime.step_parts import PartClock, step_part

# An OffloadOptimizer; typed loosely because it imports this module (see grads.py).
OffloadingOptimizer = Any


def landing_dtype(optimizer: OffloadingOptimizer, p: torch.Tensor, grad: torch.Tensor, given: bool
                  ) -> torch.dtype | None:
    """The half dtype ``p``'s landing gradient narrows to exactly (a widened half gradient
    that lands once), or ``None`` to keep it as it is (gradients handed in, manual landing)."""
    if optimizer.manual_landing or given:
        return None
    narrow = optimizer._narrow.get(id(p))
    return narrow if narrow is not None and grad.dtype != narrow and id(p) in optimizer._cast_once else None


def hold(optimizer: OffloadingOptimizer, bucket: Bucket, grads: Sequence[torch.Tensor | None] | None,
         then: Callable[[], None] | None) -> None:
    """Keep a landing of ``bucket``'s gradients on the device (``grads``, else the
    parameters' ``.grad``, which are released): the first as it came (narrowed to half where
    exact, as a transfer would be), a later one added to the fp32 sum."""
    master = bucket.flat_master.dtype
    for j, p in enumerate(bucket.params):
        grad = p.grad if grads is None else grads[j]
        if grad is None:
            continue
        narrow = landing_dtype(optimizer, p, grad, given=grads is not None)
        if narrow is not None:
            grad = grad.to(narrow)  # exact: one widened half gradient (see OffloadOptimizer._narrow)
        held = bucket.held[j]
        if held is None:
            bucket.held[j] = grad
        else:
            # The host's sum: earlier landings + this one, in the master's type.
            bucket.held[j] = (held if held.dtype == master else held.to(master)).add_(grad)
        p.grad = None
        bucket.record_arrival(j)
    if then is not None:
        then()


def unscale_and_check(optimizer: OffloadingOptimizer, scaler: LossScaler) -> bool:
    """Whether every held and device-kept gradient is finite once unscaled: checked on fp32
    temporaries (the held gradients keep their scale until they land on the host), whose
    norms clipping takes as it goes. The inverse scale is kept for the landings."""
    optimizer._held_inv_scale = scaler.inverse_scale(torch.device("cpu"))
    finite = scaler.unscale_and_check(optimizer._device_params)
    for bucket in optimizer.buckets:
        if not any(g is not None for g in bucket.held):
            continue
        flag = found_inf_flag(bucket.held[_first(bucket)].device)
        inverse = scaler.inverse_scale(flag.device)
        bucket.norms = [None] * len(bucket.params)
        for j, held in enumerate(bucket.held):
            if held is not None:
                wide = held.to(bucket.flat_master.dtype, copy=True)
                unscale_and_check_([wide], flag, inverse)
                if optimizer.grad_norms:
                    bucket.norms[j] = torch.linalg.vector_norm(wide, 2.0)
        finite = finite and not bool(flag.item())
    return finite


def clip_grad_norm(optimizer: OffloadingOptimizer, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.utils.clip_grad_norm_``'s total norm and clip factor (in host memory) over
    the held gradients (fp32, unscaled) and the device-kept ones, in the optimizer's parameter
    order; the device-kept gradients are multiplied now, the held ones on the host as they land."""
    norms: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            slot = optimizer._slot_of.get(id(p))
            if slot is None:
                if p.grad is not None:
                    norms.append(torch.linalg.vector_norm(p.grad, 2.0))
                    kept.append(p.grad)
                continue
            bucket, j = slot
            held = bucket.held[j]
            if held is None:
                continue
            taken = bucket.norms[j] if bucket.norms is not None else None
            norms.append(taken if taken is not None else
                         torch.linalg.vector_norm(held.to(bucket.flat_master.dtype), 2.0))
    if not norms:
        return torch.tensor(0.0), torch.tensor(1.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in kept:
        grad.mul_(coef.to(grad.device))
    # The host multiplies its gradients by it (a CUDA scalar cannot multiply host tensors).
    return total, coef.to("cpu")


def land_held(optimizer: OffloadingOptimizer, bucket: Bucket, coef: torch.Tensor | None,
              background: bool = False, clocks: list[PartClock] | None = None,
              later: _Later | None = None) -> Future[None]:
    """Stream ``bucket``'s held gradients to the host through one pooled buffer and queue its
    update on the host worker (unscaled with the step's inverse scale, × ``coef``); returns
    that update. The device gradients are released once copied; the pool bounds what is in
    flight. ``later``: landed after the step returned (:func:`land_held_later`)."""
    through = optimizer._pool.acquire(bucket.flat_master.nbytes)
    try:
        dtypes = [bucket.flat_master.dtype] * len(bucket.params)
        copies = optimizer._d2h.after(later.ready) if later is not None else optimizer._d2h.after_compute()
        with step_part("transfer"), copies:
            for j, held in enumerate(bucket.held):
                if held is None:
                    continue
                dtypes[j] = held.dtype
                bucket.slot(through, j, held.dtype).copy_(held, non_blocking=True)
                if later is None:  # else counted by the step that asked for it
                    transfer.count_bytes("gradients_down", held.numel() * held.element_size())
                optimizer._d2h.keep_alive(held)
                bucket.has_grad[j] = True
                bucket.held[j] = None
            copied = optimizer._d2h.record()
        bucket.copied = copied
    except BaseException:
        transfer.host_waits(optimizer._d2h.record())
        optimizer._pool.release(through)
        raise
    inv_scale = later.inv_scale if later is not None else optimizer._held_inv_scale
    job = optimizer._worker.submit(_step_landed, optimizer, bucket, through, dtypes, copied, coef,
                                   inv_scale, background, clocks)
    optimizer._jobs.append(job)
    if background and later is None:
        bucket.update = job
    return job


@dataclass(frozen=True)
class _Later:
    """What a landing after the step returned takes from the step: the event after which its
    gradients are final on the compute stream, and the step's inverse loss scale (fp16)."""

    ready: torch.cuda.Event | None
    inv_scale: torch.Tensor | None


def land_held_later(optimizer: OffloadingOptimizer, buckets: Sequence[Bucket], coef: torch.Tensor | None,
                    clocks: list[PartClock]) -> None:
    """Background updates of held gradients (``OffloadOptimizer.background``): ``buckets`` go
    down through the pool and update on the host worker in this order (the next forward's),
    :func:`land_held` by :func:`land_held` from a landing thread, so the step returns at once
    instead of after all but the pool's last buckets. Each bucket's ``update`` is set before
    this returns and finishes with its update: the next forward's upload of a block, and every
    reader of its weights, waits for its own. The same copies, kernels and order as landing
    them in the step: only when the calling thread waits changes.

    With a device share (Twin-Flow) too: its update runs in bounded runs
    (:mod:`~hybridtrain.runtime.offload.device_share`), so its temporaries meet the held
    gradients at one run's size, not the share's."""
    if not buckets:
        return
    later = _Later(transfer.compute_event(optimizer.device), optimizer._held_inv_scale)
    for bucket in buckets:
        bucket.update = Future()
        transfer.count_bytes("gradients_down", sum(h.numel() * h.element_size() for h in bucket.held if h is not None))
    landed: Future[None] = Future()
    optimizer._jobs.append(landed)  # waited for (and its error raised) by the optimizer's _wait
    threading.Thread(target=_land_in_order, args=(optimizer, list(buckets), coef, clocks, later, landed),
                     name="hybridtrain-held-landing", daemon=True).start()


def _land_in_order(optimizer: OffloadingOptimizer, buckets: list[Bucket], coef: torch.Tensor | None,
                   clocks: list[PartClock], later: _Later, landed: Future[None]) -> None:
    """On the landing thread: each bucket landed in turn; ``landed`` finishes with the last
    update (with the first error: a bucket after a failed one is not updated)."""
    updates: list[Future[None]] = []
    error: BaseException | None = None
    for bucket in buckets:
        placeholder = bucket.update
        assert placeholder is not None
        try:
            if error is not None:
                raise error
            update = land_held(optimizer, bucket, coef, background=True, clocks=clocks, later=later)
        except BaseException as exc:
            error = error or exc
            placeholder.set_exception(error)
            continue
        update.add_done_callback(functools.partial(_settle, placeholder))
        updates.append(update)
    for update in updates:
        error = error or update.exception()
    if error is not None:
        landed.set_exception(error)
    else:
        landed.set_result(None)


def _settle(placeholder: Future[None], update: Future[None]) -> None:
    error = update.exception()
    if error is not None:
        placeholder.set_exception(error)
    else:
        placeholder.set_result(None)


def _step_landed(optimizer: OffloadingOptimizer, bucket: Bucket, through: torch.Tensor,
                 dtypes: list[torch.dtype], copied: torch.cuda.Event | None, coef: torch.Tensor | None,
                 inv_scale: torch.Tensor | None, background: bool, clocks: list[PartClock] | None) -> None:
    """On the host worker: the landed gradients in the master's type, unscaled, stepped with."""
    try:
        transfer.host_waits(copied)
        master = bucket.flat_master.dtype
        grads = [g.to(master) for g in bucket.slots(through, dtypes)]
        if inv_scale is not None:
            landed = [g for g, has in zip(grads, bucket.has_grad, strict=True) if has]
            unscale_and_check_(landed, found_inf_flag(inv_scale.device), inv_scale)
        with running_in_background() if background else contextlib.nullcontext():
            optimizer._step_bucket(bucket, grads, coef=coef, background=background, clocks=clocks)
    finally:
        optimizer._pool.release(through)
    if background:
        bucket.clear()  # zero_grad left it alone while this ran


def _first(bucket: Bucket) -> int:
    return next(j for j, g in enumerate(bucket.held) if g is not None)
