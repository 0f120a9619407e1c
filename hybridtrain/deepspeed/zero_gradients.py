"""DeepSpeed ZeRO-1/2's gradient averaging and global norm over several data-parallel ranks, and
the engine's own averaging under ZeRO stage 0, for DeepSpeed's bf16/fp16 math
(:mod:`hybridtrain.deepspeed.master_weights`).

DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer`` (``runtime/zero/stage_1_and_2.py``) averages the
half gradients in this order, which decides their bits:

- ZeRO-2 (``partition_grads``) reduces every backward: its hooks copy the micro-batch's half
  gradients into a bucket, ``average_tensor`` divides the bucket by the world size in the half
  dtype, all-reduces it in ``communication_data_type`` (default: the half dtype) and copies it
  back; the averaged micro-batch gradients then add up in the half dtype
  (``independent_gradient_partition_epilogue``: ``accumulated_grad.add_(new_avg_grad)``).
- ZeRO-1 reduces once, at the accumulation boundary (``engine.allreduce_gradients`` →
  ``reduce_gradients``), the gradients autograd summed locally in the half dtype.
- With ``zero_optimization.reduce_scatter: false`` the reduction is
  ``gradient_reduction_w_predivide``: multiplied by ``1/gradient_predivide_factor``, summed,
  multiplied by ``gradient_predivide_factor / world`` (``prescale_gradients: true``: divided
  by the world size, then summed). DeepSpeed refuses a ``gradient_predivide_factor`` other than
  1 with ``reduce_scatter`` on; so does :func:`averaging_from_config`.
- ZeRO-0 (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``; the engine reduces for them):
  ``engine.allreduce_gradients`` at the accumulation boundary only, ``buffered_allreduce_fallback``
  → ``allreduce_bucket`` over the whole gradients autograd summed locally, in the same order as
  ``gradient_reduction_w_predivide`` except that ``prescale_gradients: true`` multiplies by
  ``1 / world`` where ZeRO-1/2 divide; ``reduce_scatter`` is not read and any
  ``gradient_predivide_factor`` is allowed. Every rank then holds the whole averaged gradients
  and whole fp32 masters (:func:`average_in_place`).

Every rank here all-reduces the whole gradient, bucket by bucket (DeepSpeed scatters each
partition's part to its owner; each element is the same sum of the same half values either
way), and keeps of it only what it reads (:class:`ZeroGradients`); each updates its shard of
the fp32 masters (:mod:`hybridtrain.deepspeed.master_shards`) and the half weights are
all-gathered after the step. The global norm is DeepSpeed's: each rank
measures its own partition of the flat gradient (:func:`partition_slices`, each slice's norm in
fp64, squares summed and cast to fp32), the partial sums are all-reduced in fp32 and rooted
(``get_grad_norm_direct``), so it is the same bits as DeepSpeed's on any number of ranks; so is
the overflow check (each rank checks what it keeps, the flags all-reduced by MAX).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridtrain.deepspeed.master_shards import shard_elements

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NCCL_START_ALIGNMENT_FACTOR = 2
"""DeepSpeed pads each flat group to a multiple of this times the world size."""


@dataclass(frozen=True)
class Averaging:
    """How DeepSpeed's ZeRO-1/2 optimizer averages the half gradients over the ranks (see the module)."""

    partition_gradients: bool
    """ZeRO-2: reduce every backward and add the averaged gradients up; ZeRO-1: reduce once."""
    communication_dtype: torch.dtype
    reduce_scatter: bool = True
    predivide_factor: float = 1.0
    postscale: bool = True
    bucket_elements: int = 500_000_000
    """At most this many gradient elements cross in one collective (``reduce_bucket_size``); each
    element's sum is the same however they are bucketed."""
    prescale_multiplies: bool = False
    """``prescale_gradients``: multiply by ``1 / world`` (ZeRO-0's engine) instead of dividing by
    it (ZeRO-1/2); the two round differently when the world size is not a power of two."""


def averaging_from_config(raw: Mapping[str, Any], stage: int, half: torch.dtype) -> Averaging:
    """The averaging a DeepSpeed config asks for under ZeRO ``stage`` (keys as DeepSpeed 0.19.8
    reads them; stage 0: the engine's ``allreduce_bucket``, see the module).

    Raises:
        ValueError: an unknown ``communication_data_type``, or ``gradient_predivide_factor``
            other than 1 with ``zero_optimization.reduce_scatter`` on (DeepSpeed refuses it too).
    """
    name = raw.get("communication_data_type")
    if name is not None and str(name).lower() not in _DTYPES:
        raise ValueError(f"communication_data_type: {name!r} is not one of {sorted(_DTYPES)}")
    zero = raw.get("zero_optimization")
    zero = zero if isinstance(zero, Mapping) else {}
    reduce_scatter = bool(zero.get("reduce_scatter", True))
    bucket = zero.get("reduce_bucket_size", 500_000_000)
    predivide = float(raw.get("gradient_predivide_factor", 1.0))
    communication = _DTYPES[str(name).lower()] if name is not None else half
    postscale = not bool(raw.get("prescale_gradients", False))
    if stage == 0:  # the engine's buffers (MEMORY_OPT_ALLREDUCE_SIZE), no reduce-scatter
        return Averaging(partition_gradients=False, communication_dtype=communication, reduce_scatter=False,
                         predivide_factor=predivide, postscale=postscale, prescale_multiplies=True)
    if reduce_scatter and predivide != 1.0:
        raise ValueError(f"gradient_predivide_factor: {predivide} needs zero_optimization.reduce_scatter: false "
                         "(DeepSpeed's ZeRO-1/2 allow only 1.0 with reduce_scatter)")
    return Averaging(partition_gradients=stage == 2, communication_dtype=communication,
                     reduce_scatter=reduce_scatter, predivide_factor=predivide, postscale=postscale,
                     bucket_elements=int(bucket) if isinstance(bucket, int | float) else 500_000_000)


def average(flat: torch.Tensor, rule: Averaging, world: int) -> torch.Tensor:
    """``flat`` (this rank's half gradients, flattened) averaged over the ``world`` ranks in
    DeepSpeed's order and dtypes (a collective); returned in ``flat``'s dtype."""
    if rule.reduce_scatter:
        flat = flat.div(world)  # average_tensor: divided in the half dtype before the reduction
        wire = flat.to(rule.communication_dtype)
        dist.all_reduce(wire)
        return wire.to(flat.dtype)
    wire = flat.to(rule.communication_dtype, copy=True)
    if not rule.postscale:
        if rule.prescale_multiplies:
            wire.mul_(1.0 / world)
        else:
            wire.div_(world)
        dist.all_reduce(wire)
        return wire.to(flat.dtype)
    if rule.predivide_factor != 1.0:
        wire.mul_(1.0 / rule.predivide_factor)
    dist.all_reduce(wire)
    if rule.predivide_factor != world:
        wire.mul_(rule.predivide_factor / world)
    return wire.to(flat.dtype)


def averaged_buckets(params: list[torch.nn.Parameter], rule: Averaging, world: int
                     ) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
    """Every parameter's gradient (zeros where it has none, as DeepSpeed's buffers) averaged
    (:func:`average`) bucket by bucket: each bucket's parameter indices and their averaged
    gradients, flat, in the gradients' dtype (collectives, one per bucket)."""
    for bucket in reduction_buckets([p.numel() for p in params], rule.bucket_elements):
        local = [_grad_or_zeros(params[i]) for i in bucket]
        flat = average(torch.cat([g.detach().reshape(-1) for g in local]), rule, world)
        yield bucket, list(flat.split([params[i].numel() for i in bucket]))


@torch.no_grad()
def average_in_place(params: list[torch.nn.Parameter], rule: Averaging, world: int) -> None:
    """ZeRO-0: each parameter's gradient replaced by its whole average over the ``world`` ranks,
    as DeepSpeed's engine copies the reduced buckets back into ``param.grad`` (a collective)."""
    for bucket, parts in averaged_buckets(params, rule, world):
        for i, part in zip(bucket, parts, strict=True):
            params[i].grad = part.reshape(params[i].shape).clone()


def reduction_buckets(numels: list[int], limit: int) -> list[list[int]]:
    """Consecutive tensor indices in buckets of at most ``limit`` elements (a bigger tensor alone)."""
    buckets: list[list[int]] = [[]]
    size = 0
    for index, numel in enumerate(numels):
        if buckets[-1] and size + numel > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += numel
    return [b for b in buckets if b]


def partition_slices(numels: list[int], world: int, rank: int) -> list[tuple[int, int, int]]:
    """The slices of a flat group of tensors with ``numels`` elements that DeepSpeed's ZeRO-1/2
    gives partition ``rank`` of ``world``: ``(tensor index, first element, length)`` in order.

    The flat group is padded to a multiple of ``2 * world`` and cut into ``world`` equal
    partitions (``get_data_parallel_partitions``, ``get_partition_info``; parameters are not
    padded apart without ``zero_optimization.parameter_alignment``)."""
    total = sum(numels)
    alignment = NCCL_START_ALIGNMENT_FACTOR * world
    size = -(-total // alignment) * alignment // world
    start, end = rank * size, (rank + 1) * size
    slices, offset = [], 0
    for index, numel in enumerate(numels):
        first, last = max(start, offset), min(end, offset + numel)
        if first < last:
            slices.append((index, first - offset, last - first))
        offset += numel
    return slices


def zero_global_norm(groups: list[list[torch.Tensor]], world: int = 1, rank: int = 0, offload: bool = False) -> float:
    """The global norm DeepSpeed's ZeRO-1/2 measures over the averaged gradients ``groups`` (the
    whole of every trained parameter's, in each group's order): this rank's partition slices
    (:func:`partition_slices`) measured by :func:`partition_norm`. A collective on several ranks."""
    parts = []
    for grads in groups:
        slices = partition_slices([g.numel() for g in grads], world, rank)
        parts.append([grads[i].detach().reshape(-1).narrow(0, first, length) for i, first, length in slices])
    device = next((g.device for grads in groups for g in grads), torch.device("cpu"))
    return partition_norm(parts, world, offload, device)


def partition_norm(parts: list[list[torch.Tensor]], world: int, offload: bool, device: torch.device) -> float:
    """The global norm from this rank's slices ``parts`` of each group's flat partition: each
    slice's fp64 norm, squared and summed (``offload``: in a Python float, as
    ``complete_grad_norm_calculation_for_cpu_offload``; else in fp64, ``get_grad_norm_direct``),
    cast to fp32, all-reduced over the ``world`` ranks on ``device`` and rooted per group, the
    groups combined by an fp32 vector norm (``combine_grad_norm_groups``); inf when not finite."""
    partials = []
    for group in parts:
        each = [torch.linalg.vector_norm(t.detach().double(), ord=2) for t in group]
        if offload:
            total = 0.0
            for norm in each:
                total += norm.item() ** 2
            partials.append(torch.tensor(total, dtype=torch.float32, device=device))
        else:
            partials.append(torch.stack(each).pow(2).sum().float() if each else
                            torch.zeros((), dtype=torch.float32, device=device))
    summed = torch.stack(partials)
    if world > 1:
        dist.all_reduce(summed)  # on the gradients' device, as DeepSpeed's: the same fp32 sums
    summed = summed.cpu()
    if offload:  # rooted in a Python float (correctly rounded), where torch's fp32 pow(0.5) may be an ulp off
        norms = torch.tensor([float(total) ** 0.5 for total in summed.tolist()], dtype=torch.float32)
    else:
        norms = summed.pow(0.5)
    if not bool(torch.isfinite(norms).all()):
        return float("inf")
    return float(torch.linalg.vector_norm(norms, ord=2))


class ZeroGradients:
    """The averaged half gradients of DeepSpeed's ZeRO-1/2 over the data-parallel ranks (see
    the module): :meth:`after_backward` after every backward; at the step :meth:`nonfinite`,
    :meth:`norm` and each master's :meth:`shard_grad`; :meth:`clear` after it.

    A rank keeps, of each parameter's averaged gradient, only the elements it reads: its slice
    of DeepSpeed's flat partition (the norm, the overflow check) and its master's shard
    (:func:`~hybridtrain.deepspeed.master_shards.shard_elements`), one contiguous range covering
    both; the whole gradient crosses the wire bucket by bucket.

    Args:
        half_groups: the trained half parameters, per optimizer group.
        rule: how they are averaged (:func:`averaging_from_config`).
        world: the data-parallel world size (the default process group's).
    """

    def __init__(self, half_groups: list[list[torch.nn.Parameter]], rule: Averaging, world: int) -> None:
        self.half_groups = half_groups
        self.rule = rule
        self.world = world
        self.rank = dist.get_rank()
        self._partition: dict[int, tuple[int, int]] = {}
        """Parameter index → (first element, length) of its slice of this rank's DeepSpeed partition."""
        first = 0
        for halves in half_groups:
            for index, start, length in partition_slices([p.numel() for p in halves], world, self.rank):
                self._partition[first + index] = (start, length)
            first += len(halves)
        self._kept = [kept_range(p.shape, self._partition.get(i), world, self.rank)
                      for i, p in enumerate(self._params())]
        self._sums: list[torch.Tensor] | None = None

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for halves in self.half_groups for p in halves]

    def _reduce_grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient (zeros where it has none, as DeepSpeed's buffers) averaged,
        each kept range copied out of its bucket; the parameters' own gradients are dropped."""
        params = self._params()
        kept: list[torch.Tensor] = []
        for bucket, parts in averaged_buckets(params, self.rule, self.world):
            for part, i in zip(parts, bucket, strict=True):
                start, stop = self._kept[i]
                kept.append(part[start:stop].clone())
        for p in params:
            p.grad = None
        return kept

    @torch.no_grad()
    def after_backward(self, boundary: bool) -> None:
        """ZeRO-2: average this backward's gradients and add them to the window's; ZeRO-1: at
        the ``boundary``, average the gradients autograd summed over the window."""
        if not self.rule.partition_gradients and not boundary:
            return
        reduced = self._reduce_grads()
        if self._sums is None:
            self._sums = reduced
            return
        for total, new in zip(self._sums, reduced, strict=True):
            total.add_(new)  # in the half dtype, as DeepSpeed's accumulated partition

    def _window(self) -> list[torch.Tensor]:
        """The kept ranges of the window's averaged gradients (zeros before any backward)."""
        if self._sums is not None:
            return self._sums
        return [torch.zeros(stop - start, dtype=p.dtype, device=p.device)
                for p, (start, stop) in zip(self._params(), self._kept, strict=True)]

    def _device(self) -> torch.device:
        params = self._params()
        return params[0].device if params else torch.device("cpu")

    def nonfinite(self) -> bool:
        """Whether any rank's averaged gradients hold inf/NaN (DeepSpeed's ``has_overflow``: each
        rank checks its part, the flags are all-reduced by MAX; a collective)."""
        local = any(not bool(torch.isfinite(t).all()) for t in self._window())
        flag = torch.tensor([1.0 if local else 0.0], device=self._device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def norm(self, offload: bool) -> float:
        """The global norm over DeepSpeed's partitions (:func:`partition_norm`; a collective)."""
        sums, parts, first = self._window(), [], 0
        for halves in self.half_groups:
            group = []
            for i in range(first, first + len(halves)):
                if i in self._partition:
                    start, length = self._partition[i]
                    offset = start - self._kept[i][0]
                    group.append(sums[i][offset:offset + length])
            parts.append(group)
            first += len(halves)
        return partition_norm(parts, self.world, offload, self._device())

    def shard_grad(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s averaged gradient on this rank's shard of its master, flat."""
        start, stop = shard_elements(self._params()[index].shape, self.world, self.rank)
        offset = start - self._kept[index][0]
        return self._window()[index][offset:offset + stop - start]

    def clear(self) -> None:
        """Drop the window's gradients (after a step or a skip)."""
        self._sums = None
        for p in self._params():
            p.grad = None


def _grad_or_zeros(param: torch.nn.Parameter) -> torch.Tensor:
    grad = param.grad
    return grad if grad is not None else torch.zeros_like(param)


def kept_range(shape: torch.Size, partition: tuple[int, int] | None, world: int, rank: int) -> tuple[int, int]:
    """The elements ``[start, stop)`` of a parameter of ``shape`` whose averaged gradient a rank
    keeps: one range covering its slice of DeepSpeed's partition (``(first, length)`` or None) and
    its master's shard."""
    ranges = [(partition[0], partition[0] + partition[1])] if partition else []
    shard = shard_elements(shape, world, rank)
    if shard[1] > shard[0]:
        ranges.append(shard)
    if not ranges:
        return 0, 0
    return min(r[0] for r in ranges), max(r[1] for r in ranges)
