"""Peak device bytes and host bytes of one training step, from a traced micro-batch and
a :class:`~hybridtrain.plan.types.TrainingPlan`.

The step is replayed phase by phase on a running count of live bytes, each technique
changing what a phase keeps::

    step start: parameters + optimizer state (+ host buffers of offload) + the batch
    for each micro-batch:
        forward   pre ─► block 0 … block n-1 ─► post (head and loss)
                  plain: a block keeps what autograd saved; checkpointed: only its
                  output (its input is kept by the block before); swapped: the saved
                  tensors go to host memory; streamed: its weights visit the device
        backward  post ─► block n-1 … block 0 ─► pre   (checkpointed: recompute first)
                  gradients appear (first micro-batch) or are added to (later ones);
                  offloaded gradients leave the device when their bucket is complete
    optimizer step: its temporaries on top of everything that is left

The peak of that count is the device peak. Sharding (ZeRO), tensor and pipeline
parallel divide the model-state terms per rank as their own documentation says (the
table in :mod:`hybridtrain.parallel.zero`): DeepSpeed's rule, states ÷ N for stage 1,
gradients too for stage 2, parameters too for stage 3.

On a CPU device host and device memory are the same memory: the device peak then
includes the host buffers (that is what a CPU run measures).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from hybridtrain.optim import optimizer_state_bytes
from hybridtrain.plan.types import TrainingPlan
from hybridtrain.planner.trace import ModelTrace, PhaseProfile
from hybridtrain.runtime.offload.layout import DEVICE_SHARE_GROUP_NUMEL, POOLED_BUFFERS

_FP32 = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes by kind (device at its peak, or host)."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    transfer_buffers: int = 0
    workspace: int = 0

    @property
    def total(self) -> int:
        """All kinds together."""
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, int]:
        """Plain values, with the total."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}


@dataclass(frozen=True)
class MemoryEstimate:
    """Where the bytes of a step go.

    Attributes:
        device_peak: highest live bytes on the device during a step (steady state: the
            optimizer state exists).
        device: the device bytes at that moment, by kind.
        host: host bytes the techniques hold (offloaded states, swapped activations,
            streamed weights, their buffers), by kind.
        peak_at: where in the step the peak falls (e.g. ``backward of post``).
    """

    device_peak: int
    device: MemoryBreakdown
    host: MemoryBreakdown
    peak_at: str

    @property
    def host_bytes(self) -> int:
        """Host bytes in all."""
        return self.host.total


class _Replay:
    """The running count of live device bytes and its peak (see the module docstring).
    Gradients on the device are counted apart, so the peak splits into kinds: what is
    neither the step-start bytes nor gradients is activations and temporaries."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.current = start
        self.grads = 0
        self.peak = start
        self.peak_at = "step start"
        self.peak_grads = 0

    def touch(self, extra: int, where: str) -> None:
        if self.current + extra > self.peak:
            self.peak, self.peak_at, self.peak_grads = self.current + extra, where, self.grads

    def keep(self, nbytes: int) -> None:
        self.current += nbytes

    @property
    def peak_activations(self) -> int:
        return max(0, self.peak - self.start - self.peak_grads)


def kept_blocks(plan: TrainingPlan, streamed: list[str]) -> list[str]:
    """The streamed blocks (of ``streamed``, in forward order) whose uploaded weights stay
    on the device from forward to backward: the last ``keep_blocks_for_backward`` of them
    (-1: all), in either streaming order (micro-batch-major keeps them for each micro-batch's
    backward, layer-major for the step's)."""
    keep = plan.config.layer_streaming.keep_blocks_for_backward
    if keep == 0:
        return []
    return list(streamed) if keep < 0 else list(streamed[max(0, len(streamed) - keep):])


def uploaded_bytes(numel: int, half_numel: int) -> int:
    """Bytes of one upload of ``numel`` elements of which ``half_numel`` cross at half width."""
    return _FP32 * numel - 2 * min(half_numel, numel)


def estimate_memory(plan: TrainingPlan, trace: ModelTrace, device_kind: str = "cpu",
                    half_numel: Mapping[str, int] | None = None) -> MemoryEstimate:
    """Replay one step of ``plan`` over ``trace`` on a ``cpu`` or ``cuda`` device (see the
    module docstring).

    ``half_numel``: elements crossing at half width, per block and under ``""`` for the
    model (:func:`hybridtrain.planner.estimate.half_width_numel`): the host keeps a half
    image of each streamed one (2 bytes), and kept blocks hold their uploads at that width.
    """
    half_numel = half_numel or {}
    cfg = plan.config
    sizes = plan.sizes
    on_cpu = device_kind == "cpu"
    state_per_elem = optimizer_state_bytes(cfg.optimizer.type, cfg.optimizer.params)
    blocks = trace.blocks
    n = len(blocks)
    flags = {b.name: b for b in plan.blocks}
    streamed = [bool(flags[p.name].stream) if p.name in flags else False for p in blocks]
    stage_blocks = _stage_blocks(plan, n)
    tp = sizes.tp
    dp = sizes.dp

    # ---- model states, per rank ------------------------------------------------------
    block_numel = [blocks[i].param_numel // tp for i in stage_blocks]
    outer_numel = trace.post.param_numel + trace.pre.param_numel
    holds_outer = plan.pipeline is None or 0 in stage_blocks or (n - 1) in stage_blocks
    resident_numel = sum(x for x, i in zip(block_numel, stage_blocks, strict=True) if not streamed[i]) + \
        (outer_numel if holds_outer else 0)
    streamed_numel = sum(x for x, i in zip(block_numel, stage_blocks, strict=True) if streamed[i])
    model_numel = resident_numel + streamed_numel
    zero = plan.zero_stage
    shard = dp if zero else 1
    opt = plan.optimizer
    host_ratio = opt.host_ratio if opt.placement == "host" else 0.0
    offloaded_numel = int(resident_numel * host_ratio) if opt.placement == "host" else 0
    if opt.placement == "host_streamed":
        # Resident parts are offloaded too, but for Twin-Flow's share (in resident blocks).
        offloaded_numel = model_numel - int((1.0 - opt.host_ratio) * model_numel)
    zero_offload = zero and cfg.zero_optimization.offload_optimizer.device == "cpu"

    device_params = _FP32 * (resident_numel // (shard if zero == 3 else 1))
    gathered = 0
    if zero == 3 and block_numel:
        # FSDP2 gathers one block ahead of the one computing, in the compute dtype.
        itemsize = 2 if plan.compute_dtype is not None else _FP32
        gathered = 2 * itemsize * max(block_numel)
    device_state_numel = 0 if (opt.placement != "device" or zero_offload) else model_numel
    if opt.placement in ("host", "host_streamed"):
        device_state_numel = model_numel - offloaded_numel if opt.placement == "host_streamed" else \
            resident_numel - offloaded_numel
    device_state = state_per_elem * device_state_numel // shard
    grads_full = _FP32 * (resident_numel - (offloaded_numel if opt.placement != "device" else 0))
    grads_kept = grads_full // (shard if zero >= 2 else 1)

    # ---- host -------------------------------------------------------------------------
    host_params = host_grads = host_state = host_buffers = host_acts = 0
    if opt.placement != "device":
        lasting = opt.grads_wait_on_host
        streamed_bytes = _FP32 * streamed_numel
        host_params = _FP32 * offloaded_numel  # masters (the streamed blocks' are their weights)
        host_state = state_per_elem * offloaded_numel
        host_grads = _FP32 * offloaded_numel if lasting else 0
        bucketed_numel = offloaded_numel - streamed_numel
        largest_bucket = min(bucketed_numel, opt.bucket_size) if bucketed_numel > 0 else 0
        if streamed_numel:
            largest_bucket = max(largest_bucket, max(b for b, i in zip(block_numel, stage_blocks, strict=True)
                                                     if streamed[i]))
        # Pooled buffers are allocated as landings overlap: one for a single bucket, up to three.
        buckets = (1 if offloaded_numel > streamed_numel else 0) + sum(streamed)
        pooled = 0 if (lasting and trace.micro_batch and plan.batch.accumulation_steps == 1) else min(3, buckets)
        host_buffers = _FP32 * largest_bucket * pooled
        # Streamed half-width weights keep their cast image in host memory (2 bytes each), or
        # pass through prefetch_blocks + 2 pooled images (half_images: per_upload).
        images = [uploaded_bytes(x, min(half_numel.get(blocks[i].name, 0) // tp, x))
                  for x, i in zip(block_numel, stage_blocks, strict=True)
                  if streamed[i] and half_numel.get(blocks[i].name)]
        if plan.stream_images_per_upload:
            host_buffers += (cfg.layer_streaming.prefetch_blocks + 2) * max(images, default=0)
        else:
            host_params += 2 * sum(min(half_numel.get(blocks[i].name, 0) // tp, x)
                                   for x, i in zip(block_numel, stage_blocks, strict=True) if streamed[i])
        del streamed_bytes
    if zero_offload:
        host_params = _FP32 * model_numel // shard
        host_state = state_per_elem * model_numel // shard
        host_grads = _FP32 * model_numel // shard

    # ---- the step, replayed ------------------------------------------------------------
    batch_bytes = trace.batch_bytes * plan.batch.accumulation_steps
    base = device_params + device_state + gathered + batch_bytes
    host_total = host_params + host_grads + host_state + host_buffers
    if on_cpu:
        base += host_total
    replay = _Replay(base)
    accumulation = plan.batch.accumulation_steps
    prefetch = cfg.layer_streaming.prefetch_blocks
    stream_window = _FP32 * (prefetch + 1) * max((b for b, i in zip(block_numel, stage_blocks, strict=True)
                                                  if streamed[i]), default=0)
    # Kept blocks hold their uploads from forward to backward; counted for the whole step
    # (they are all live when a backward starts, where the peak falls).
    stage_streamed = [blocks[i].name for i in stage_blocks if streamed[i]]
    kept = set(kept_blocks(plan, stage_streamed))
    stream_window += sum(uploaded_bytes(x, half_numel.get(blocks[i].name, 0) // tp)
                         for x, i in zip(block_numel, stage_blocks, strict=True) if blocks[i].name in kept)
    replay.current += stream_window  # the streamed blocks in flight (their device copies)
    replay.start = replay.current
    treatments = [treatment(plan, p.name) for p in blocks]
    # Streamed blocks hand their gradients to the host as soon as their backward ends, unless
    # gradients wait on the device for the step (held: at half width where they are half and
    # land once, a streamed block's Linear weights).
    held = opt.grads_wait_on_device
    landing = {i for i in range(n) if streamed[i]} if opt.placement != "device" and not held else set()
    narrower = {i: 2 * min(half_numel.get(blocks[i].name, 0), blocks[i].param_numel) // tp for i in range(n)
                if streamed[i]} if held and accumulation == 1 else {}
    swap_prefetch = cfg.activation_offload.prefetch_blocks if not on_cpu else 0
    host_acts = 0
    # Offloaded gradients are landed (moved to host memory) bucket by bucket after each
    # backward: every micro-batch's in micro-batch order, all of them at once in layer-major.
    landed = _FP32 * (offloaded_numel - streamed_numel) if opt.placement != "device" and not held else 0
    if plan.step_runner == "layer_major":
        host_acts = _layer_major_step(replay, trace, stage_blocks, treatments, accumulation, tp, swap_prefetch, landing,
                                      streamed, narrower)
        replay.current -= landed
        replay.grads -= landed
    rounds, in_flight = (0, 0) if plan.step_runner == "layer_major" else \
        (1, _in_flight(plan)) if plan.pipeline is not None else (accumulation, 1)
    for m in range(rounds):
        for _ in range(in_flight):
            host_acts = max(host_acts, _forward(replay, trace, stage_blocks, treatments, tp))
        for k in range(in_flight):
            # Offloaded gradients leave the device after each micro-batch: every backward finds none.
            fresh = (m == 0 and k == 0) or (opt.placement != "device" and not held)
            _backward(replay, trace, stage_blocks, treatments, fresh, tp, swap_prefetch, landing, narrower)
        replay.current -= landed
        replay.grads -= landed
    if zero >= 2:
        replay.current -= grads_full - grads_kept  # reduce-scattered
        replay.grads = grads_kept
    # Optimizer step: torch's single-tensor Adam (CPU) makes two temporaries the size of a
    # parameter; the foreach path (CUDA) one the size of what one call updates: all device-
    # updated parameters, or one bounded run of an offloading optimizer's Twin-Flow share
    # (runtime/offload/device_share.py).
    later = held and lands_later(plan)
    if later and stage_blocks:
        # The next forward starts with every held gradient still on the device (each block's
        # own lands before it runs again): its first block finds them all.
        first = trace.block(stage_blocks[0], treatments[stage_blocks[0]])
        replay.touch(trace.pre.forward_peak, "next forward of pre")
        replay.touch(trace.pre.kept_bytes + _split(first.forward_peak, first.output_bytes, tp),
                     f"next forward of {first.name}")
    if held and not later:
        # OffloadOptimizer.step sends the held gradients down bucket by bucket before the
        # device share steps; at most the pool's buckets are still in flight then. Landing
        # later, they are all still on the device while its bounded runs step.
        going = replay.grads - _FP32 * device_state_numel // shard
        in_flight = POOLED_BUFFERS * _FP32 * max(block_numel, default=0)
        replay.current -= max(0, going - in_flight)
        replay.grads -= max(0, going - in_flight)
    if device_state_numel:
        one_call = device_state_numel // shard
        if opt.placement in ("host", "host_streamed"):
            one_call = min(one_call, device_share_run_numel(trace))
        work = 2 * _FP32 * trace.largest_param_numel if on_cpu else _FP32 * one_call
        replay.touch(work, "optimizer step")
    host_acts = 0 if on_cpu else host_acts
    optimizer_work = replay.peak_at == "optimizer step"
    device = MemoryBreakdown(
        parameters=device_params + gathered + stream_window,
        gradients=replay.peak_grads,
        optimizer_state=device_state,
        activations=0 if optimizer_work else replay.peak_activations,
        transfer_buffers=host_total if on_cpu else 0,
        workspace=batch_bytes + (replay.peak_activations if optimizer_work else 0),
    )
    host = MemoryBreakdown(parameters=host_params, gradients=host_grads, optimizer_state=host_state,
                           activations=host_acts, transfer_buffers=host_buffers)
    return MemoryEstimate(device_peak=replay.peak, device=device, host=host, peak_at=replay.peak_at)


def device_share_run_numel(trace: ModelTrace) -> int:
    """Elements one bounded run of an offloading optimizer's Twin-Flow share updates at most
    (:func:`hybridtrain.runtime.offload.layout.device_share_groups`: a larger parameter alone)."""
    return max(DEVICE_SHARE_GROUP_NUMEL, trace.largest_param_numel)


def lands_later(plan: TrainingPlan) -> bool:
    """Whether held gradients land after ``step()`` returned, behind the next forward
    (:func:`hybridtrain.runtime.offload.held_grads.land_held_later`, as ``hybridtrain train``
    runs the step): held on the device, with or without a Twin-Flow device share (its update
    runs in bounded runs beside the held gradients)."""
    opt = plan.optimizer
    return opt.grads_wait_on_device and opt.placement in ("host", "host_streamed")


def treatment(plan: TrainingPlan, name: str) -> str:
    """How ``plan`` treats block ``name``: one of the trace's passes."""
    checkpointed = name in plan.checkpoint_modules
    swapped = name in plan.swap_modules
    if checkpointed and swapped:
        return "swap_checkpoint"
    return "checkpoint" if checkpointed else "swap" if swapped else "plain"


def passes_for(plan: TrainingPlan) -> tuple[str, ...]:
    """The trace passes ``plan`` needs besides the plain one."""
    return tuple(sorted({treatment(plan, b.name) for b in plan.blocks} - {"plain"}))


def _forward(replay: _Replay, trace: ModelTrace, stage_blocks: list[int], treatments: list[str], tp: int) -> int:
    """One micro-batch's forward; returns the activation bytes it sent to host memory."""
    to_host = 0
    if not stage_blocks or stage_blocks[0] == 0:
        replay.touch(trace.pre.forward_peak, "forward of pre")
        replay.keep(trace.pre.kept_bytes)
    for i in stage_blocks:
        p = trace.block(i, treatments[i])
        kept = _split(p.kept_bytes, p.output_bytes, tp)
        replay.touch(_split(p.forward_peak, p.output_bytes, tp), f"forward of {p.name}")
        replay.keep(kept)
        to_host += p.host_bytes // tp
    if not stage_blocks or stage_blocks[-1] == len(trace.blocks) - 1:
        replay.touch(trace.post.forward_peak, "forward of post")
        replay.keep(trace.post.kept_bytes)
    return to_host


def _split(nbytes: int, output_bytes: int, tp: int) -> int:
    """A block's bytes under tensor parallel: the insides of attention and MLP are split
    over the ranks, its input and output (the residual stream) are not."""
    return output_bytes + (nbytes - output_bytes) // tp if tp > 1 else nbytes


def _backward_phase(replay: _Replay, p: PhaseProfile, where: str, first: bool, tp: int, ahead: int = 0,
                    lands: bool = False, narrower: int = 0) -> None:
    """One micro-batch's backward through phase ``p`` (``first``: it creates the gradients
    of ``p``'s parameters; ``lands``: they leave for the host at its end; ``narrower``:
    bytes fewer than fp32 they take, held at half width)."""
    peak, end = (p.backward_peak, p.backward_end) if first else (p.accumulate_peak, p.accumulate_end)
    replay.touch(_split(peak, p.output_bytes, tp) + ahead, f"backward of {where}")
    change = _split(end, p.output_bytes, tp) if end > 0 else -_split(-end, p.output_bytes, tp)
    replay.current += change
    grads = _FP32 * p.param_numel // tp - narrower
    if first:  # this phase's parameters now have gradients
        replay.grads += grads
        # The trace widens them to fp32 (autocast's cast backward); held at half width, they take
        # ``narrower`` bytes fewer once the phase ends (a streamed block's half weights get half gradients).
        replay.current -= narrower
    if lands:
        replay.current -= grads
        replay.grads -= grads


def _backward(replay: _Replay, trace: ModelTrace, stage_blocks: list[int], treatments: list[str], first: bool,
              tp: int, swap_prefetch: int, landing: set[int], narrower: Mapping[int, int]) -> None:
    if not stage_blocks or stage_blocks[-1] == len(trace.blocks) - 1:
        _backward_phase(replay, trace.post, "post", first, tp)
    for k, i in enumerate(reversed(stage_blocks)):
        p = trace.block(i, treatments[i])
        # Swapped blocks further back are copied to the device ahead of their backward.
        later = list(reversed(stage_blocks))[k + 1:k + 1 + swap_prefetch]
        ahead = sum(trace.block(j, treatments[j]).host_bytes // tp for j in later)
        _backward_phase(replay, p, p.name, first, tp, ahead, i in landing, narrower.get(i, 0))
    if not stage_blocks or stage_blocks[0] == 0:
        _backward_phase(replay, trace.pre, "pre", first, tp)


def _layer_major_step(replay: _Replay, trace: ModelTrace, stage_blocks: list[int], treatments: list[str], count: int,
                      tp: int, swap_prefetch: int, landing: set[int], streamed: list[bool],
                      narrower: Mapping[int, int]) -> int:
    """Forward and backward of ``count`` micro-batches in layer-major order
    (:mod:`hybridtrain.runtime.streaming.layer_major`); returns the activation bytes sent to host memory.

    Each phase runs for every micro-batch before the next phase starts, so what each
    micro-batch keeps piles up ``count`` times (the head's saved logits too). The runner
    cuts the graph at every streamed block's output and holds that output (the root of
    the block's backward segment) until the block's backward: where the next block swaps
    its input to the host, the micro-batch-major trace freed that tensor on the device and
    layer-major does not — ``count`` residual-stream tensors per block (3 GiB of GPT-1.3B's
    5 GiB measured on an H100 at 2 × 8 × 1024 tokens). In backward, a block's output
    gradients (the cut leaves' ``.grad``) stay until all its micro-batches are through.
    """
    n = len(trace.blocks)
    to_host = 0
    held = [0] * n  # per micro-batch: block j's output kept by the cut (freed at j's backward)
    if not stage_blocks or stage_blocks[0] == 0:
        for _ in range(count):
            replay.touch(trace.pre.forward_peak, "forward of pre")
            replay.keep(trace.pre.kept_bytes)
    for i in stage_blocks:
        p = trace.block(i, treatments[i])
        if i > 0 and streamed[i - 1] and treatments[i].startswith("swap"):
            held[i - 1] = trace.blocks[i - 1].output_bytes
        for _ in range(count):
            replay.touch(_split(p.forward_peak, p.output_bytes, tp), f"forward of {p.name}")
            replay.keep(_split(p.kept_bytes, p.output_bytes, tp) + (held[i - 1] if i > 0 else 0))
            to_host += p.host_bytes // tp
    if not stage_blocks or stage_blocks[-1] == n - 1:
        for _ in range(count):
            replay.touch(trace.post.forward_peak, "forward of post")
            replay.keep(trace.post.kept_bytes)
        for m in range(count):
            _backward_phase(replay, trace.post, "post", m == 0, tp)
    # Backward visits (block, micro-batch) in this order; the swapper prefetches along it.
    order = [i for i in reversed(stage_blocks) for _ in range(count)]
    for k, i in enumerate(order):
        p = trace.block(i, treatments[i])
        m = k % count
        ahead = sum(trace.block(j, treatments[j]).host_bytes // tp for j in order[k + 1:k + 1 + swap_prefetch])
        done_grads = m * p.output_bytes  # earlier micro-batches' output gradients, still on the cut leaves
        _backward_phase(replay, p, p.name, m == 0, tp, ahead + done_grads, i in landing and m == count - 1,
                        narrower.get(i, 0))
        if m == count - 1:
            replay.current -= count * held[i]
    if not stage_blocks or stage_blocks[0] == 0:
        for m in range(count):
            _backward_phase(replay, trace.pre, "pre", m == 0, tp)
    return to_host


def _stage_blocks(plan: TrainingPlan, n: int) -> list[int]:
    """The blocks of the busiest pipeline stage (the first, which keeps the most
    micro-batches in flight), or every block without a pipeline."""
    if plan.pipeline is None or plan.sizes.pp == 1:
        return list(range(n))
    counts = plan.pipeline.counts or tuple(_uniform(n, plan.sizes.pp))
    return list(range(counts[0]))


def _uniform(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if k < n % parts else 0) for k in range(parts)]


def _in_flight(plan: TrainingPlan) -> int:
    """Micro-batches whose activations the first pipeline stage holds at once: all of them
    under GPipe, at most the number of stages under 1F1B schedules."""
    if plan.pipeline is None:
        return 1
    micro = plan.batch.accumulation_steps
    return micro if plan.pipeline.schedule == "gpipe" else min(micro, plan.sizes.pp)
