"""Optimizer offload's gradient path, device to host: a bucket's gradients copied down as
backward completes them (:func:`copy_grads_to_host`), then summed, unscaled, measured and stepped
with by the host worker (:func:`accumulate_on_host`). Part of
:class:`~hybridtrain.runtime.offload.optimizer.OffloadOptimizer`, whose state it reads and
writes; kept apart so each file holds one direction of the traffic."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from hybridtrain.runtime import transfer
from hybridtrain.runtime.offload import held_grads
from hybridtrain.runtime.offload.bucket import Bucket
from hybridtrain.runtime.offload.host_grad_checks import unscale_and_measure
from hybridtrain.runtime.step_parts import step_part

# The optimizer these functions serve is an OffloadOptimizer, typed as OffloadingOptimizer:
# it imports this module, so importing it back (even for typing) would make a cycle.
OffloadingOptimizer = Any


def hook_arrivals(optimizer: OffloadingOptimizer, several_backwards: frozenset[int]) -> list[RemovableHandle]:
    """Gradient hooks that offload each bucket once all its gradients of a backward are
    complete; not on streamed blocks (their streamer offloads them) nor on buckets with a
    parameter used in several backward passes (``several_backwards``: offloaded after the backward).

    The hooks live on the model's parameters, which outlive the optimizer (an OOM recovery
    rebuilds the engine around the same model): they hold it weakly, and
    :meth:`~OffloadOptimizer.close` removes them (a rebuilt engine's backward must not land
    old buckets)."""
    me = weakref.ref(optimizer)
    hooks: list[RemovableHandle] = []
    for bucket in optimizer.buckets:
        if not bucket.streamed and not any(id(p) in several_backwards for p in bucket.params):
            bucket.hooked = len(bucket.trained)
            hooks += [p.register_post_accumulate_grad_hook(functools.partial(_arrived, me, bucket.index))
                      for p in bucket.trained]
    return hooks


def _arrived(optimizer: weakref.ref[OffloadingOptimizer], index: int, _param: torch.Tensor) -> None:
    """A gradient hook: the parameter's gradient is complete; the bucket's last one
    offloads it (unless a whole-step runner offloads buckets itself)."""
    live = optimizer()
    if live is None or live.manual_landing:
        return
    bucket = live.buckets[index]
    bucket.arrived += 1
    if bucket.arrived == bucket.hooked:
        live.offload_grads(index)


def copy_grads_to_host(optimizer: OffloadingOptimizer, index: int, then: Callable[[], None] | None,
                       grads: Sequence[torch.Tensor | None] | None) -> None:
    """:meth:`OffloadOptimizer.offload_grads`: queue the copies of bucket ``index``'s gradients to the
    host and hand them to the host worker (:func:`accumulate_on_host`)."""
    bucket = optimizer.buckets[index]
    if optimizer.grads_wait_on_device:
        held_grads.hold(optimizer, bucket, grads, then)
        if not optimizer._eager:
            return
        grads, then = bucket.take_held(), None  # the step's sums, stepped with at once
    # Gradients stepped with as soon as they land pass through a pooled buffer; any
    # that must wait (summed later, or a deferred step) get the bucket's lasting one.
    lasting = bucket.flat_grad is not None or not optimizer._eager
    if lasting and bucket.flat_grad is None:
        bucket.flat_grad = transfer.host_buffer(bucket.numel, bucket.flat_master.dtype, optimizer.pin_memory,
                                                optimizer.device)
    through: torch.Tensor | None = None
    finite: torch.Tensor | None = None
    landed: list[tuple[int, bool, torch.dtype | None]] = []
    master_dtype = bucket.flat_master.dtype
    try:
        with step_part("transfer"), optimizer._d2h.after_compute():
            if optimizer._eager and optimizer._finite is not None:
                finite = transfer.host_empty(1, torch.bool, optimizer.pin_memory, optimizer.device)
                finite.copy_(optimizer._finite.reshape(1), non_blocking=True)
                optimizer._d2h.keep_alive(optimizer._finite)  # the next micro-batch replaces it
            for j, p in enumerate(bucket.params):
                grad = p.grad if grads is None else grads[j]
                if grad is None:
                    continue
                narrow = held_grads.landing_dtype(optimizer, p, grad, given=grads is not None)
                if narrow is not None:
                    optimizer._d2h.keep_alive(grad)  # read by the cast on this stream
                    grad = grad.to(narrow)  # exact: see ``_narrow``
                first = not bucket.has_grad[j]
                if not first and not lasting:
                    raise RuntimeError(f"gradients of bucket {index} arrived after its host step in this step; "
                                       "call step() (or train_batch) between backward passes, or raise "
                                       "gradient_accumulation_steps")
                # The step's first gradient of the master's type goes straight into the
                # lasting buffer; the rest (summed later, or half) wait in a pooled one.
                direct = first and lasting and grad.dtype == master_dtype
                if direct:
                    assert bucket.flat_grad is not None
                    target = bucket.slot(bucket.flat_grad, j, master_dtype)
                else:
                    if through is None:
                        through = optimizer._pool.acquire(bucket.flat_master.nbytes)
                    target = bucket.slot(through, j, grad.dtype)
                target.copy_(grad, non_blocking=True)
                transfer.count_bytes("gradients_down", grad.numel() * grad.element_size())
                optimizer._d2h.keep_alive(grad)
                p.grad = None
                bucket.has_grad[j] = True
                bucket.record_arrival(j)
                landed.append((j, first, None if direct else grad.dtype))
            copied = optimizer._d2h.record()
        bucket.copied = copied
        if then is not None:
            then()
        if landed:
            # Norms of scaled gradients are not clipping's: the calling thread takes those.
            once = [j for j, *_ in landed if not bucket.relands[j]]  # sums final at this landing
            unscale = None if optimizer._unscale is None else (optimizer._unscale, once)
            norms = optimizer._final and optimizer.grad_norms and (unscale is not None or optimizer._inv_scale is None)
            job = optimizer._worker.submit(accumulate_on_host, optimizer, bucket, landed, copied, through,
                                           optimizer._eager, finite, norms, unscale)
            optimizer._jobs.append(job)
    except BaseException:
        if through is not None:  # a lost pool buffer would block every later landing
            transfer.host_waits(optimizer._d2h.record())  # copies into it may be queued
            optimizer._pool.release(through)
        raise


def accumulate_on_host(optimizer: OffloadingOptimizer, bucket: Bucket,
                       landed: list[tuple[int, bool, torch.dtype | None]], copied: torch.cuda.Event | None,
                       through: torch.Tensor | None, step: bool,
                       finite: torch.Tensor | None = None, norms: bool = False,
                       unscale: tuple[torch.Tensor, list[int]] | None = None) -> None:
    """On the host worker: wait for ``landed``'s copies, sum them into the bucket's lasting
    gradients (or step with them at once from the pooled buffer ``through``), unscale and
    take norms for the step's last landing, and step the bucket where ``step`` says."""
    bucket.norms = None  # any landing changes the sums; the step's last one takes them again
    try:
        transfer.host_waits(copied)
        # A non-finite loss this step: the engine skips or refuses the step, so the
        # masters stay as they are (the flag landed with the gradients).
        step = step and (finite is None or bool(finite))
        if bucket.flat_grad is None:
            # The step's only gradients, in a pooled buffer: step with them at once
            # (a half one becomes the master's type first, exactly).
            assert through is not None
            if step:
                optimizer._step_bucket(bucket, [g.to(bucket.flat_master.dtype) for g in bucket.staged(through, landed)])
            return
        if through is not None:
            bucket.sum_staged(through, landed)
    finally:
        if through is not None:  # even after a failure: a lost buffer would block backward
            optimizer._pool.release(through)
    if unscale is not None or norms:  # behind the rest of backward
        unscale_and_measure(bucket, unscale, norms)
    if step:
        optimizer._step_bucket(bucket)
