"""The checks a deferred host step makes over every gradient — fp16's unscale and inf/NaN
check, and gradient clipping's global norm — done bucket by bucket on the host optimizer's
worker (:mod:`~hybridtrain.runtime.offload.optimizer`) as the step's last backward lands
each bucket, behind the rest of backward; the calling thread only combines them.

::

    last backward ─► bucket k lands ─► worker: sum into the host gradients, unscale them
          │                                    (× 1/scale, found-inf flag), take their norms
          ▼
    … bucket 0 lands ─► worker: the same ─► calling thread: any flag set?  (skip the step)
                                                             norms ─► total ─► clip factor

The same kernels on the same tensors as :meth:`LossScaler.unscale_and_check
<hybridtrain.runtime.precision.scaling.LossScaler.unscale_and_check>` and
``torch.nn.utils.clip_grad_norm_`` over the host gradients (both elementwise or per
tensor), with the same factor, so the same bits. What the worker did not cover — a
gradient that no landing of the last backward completed, one that lands twice in a
backward, the device-kept (twin-flow) parameters, every gradient of a step driven by the
forward/backward/step trio (``engine.backward`` cannot know that a backward is its step's
last) — is unscaled on the calling thread as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hybridtrain.runtime.offload.bucket import Bucket
from hybridtrain.runtime.precision.scaling import LossScaler
from hybridtrain.runtime.step_parts import step_part, work_part

Slots = Mapping[int, tuple[Bucket, int]]
"""Where each host master lies: its bucket and index there, by ``id``."""


def unscale_and_measure(bucket: Bucket, unscale: tuple[torch.Tensor, list[int]] | None, norms: bool) -> None:
    """On the host worker, once the step's last backward landed gradients of ``bucket`` and
    they are summed: unscale them (``unscale``: the inverse scale and which gradients; the
    others keep their scale and get no norm), then take the norms clipping needs
    (``norms``). Counted as host optimizer work (``host_step``)."""
    with work_part("host_step"):
        if unscale is not None:
            bucket.unscale(unscale[1], unscale[0])
        if norms:
            bucket.take_norms(scaled=unscale is not None)


def unscale_and_check(params: Sequence[torch.nn.Parameter], slots: Slots, buckets: Sequence[Bucket],
                      scaler: LossScaler) -> bool:
    """Unscale what the worker did not and combine every found-inf flag.

    Args:
        params: the optimizer's parameters (host masters and device-kept ones).
        slots: where each host master lies.
        buckets: the host optimizer's buckets (their flags).
        scaler: the loss scaler (its scale is the one the worker used).

    Returns:
        True when every gradient is finite.
    """
    host: list[torch.nn.Parameter] = []
    device: list[torch.nn.Parameter] = []
    for p in params:
        if p.grad is None:
            continue
        slot = slots.get(id(p))
        if slot is None:
            device.append(p)
            continue
        bucket, j = slot
        if bucket.unscaled[j]:
            continue
        if bucket.norms is not None:
            bucket.norms[j] = None  # taken of the scaled gradient: clipping takes it again
        host.append(p)
    finite = scaler.unscale_and_check(device)
    if host:  # on the critical path: host optimizer work the profile shows exposed
        with step_part("host_optimizer"), work_part("host_step"):
            finite = scaler.unscale_and_check(host) and finite
    return finite and not any(bool(b.found_inf.item()) for b in buckets if b.found_inf is not None)


def clip_grad_norm(params: Sequence[torch.nn.Parameter], slots: Slots, max_norm: float,
                   device_kept: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients' global 2-norm and the factor ``torch.nn.utils.clip_grad_norm_``
    multiplies them by, from the norms the worker took (the others taken now, same kernel).

    Args:
        params: the optimizer's parameters with gradients.
        slots: where each host master lies.
        max_norm: the clipping threshold.
        device_kept: some parameters are updated on the device (twin-flow).

    Returns:
        ``(total_norm, factor)``; the factor None where the gradients are already clipped:
        device-kept parameters or mixed types, which torch's own ``clip_grad_norm_`` groups
        by device and type.
    """
    if device_kept or len({p.grad.dtype for p in params if p.grad is not None}) > 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm), None
    if not params:
        return torch.tensor(0.0), None
    norms = [bucket.norm(j) for bucket, j in (slots[id(p)] for p in params)]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)
