"""Predicted seconds of one training step: FLOPs ÷ achievable throughput, bytes ÷ link
bandwidth, overlapped as each technique overlaps them.

::

    compute    = (forward + backward + recomputed forwards) FLOPs ÷ throughput
                 + kernels × launch/dispatch cost          (small micro-batches pay it)
    transfers  = activation swaps, streamed weights, offloaded gradients and weights
                 ÷ host link; hidden behind compute up to the compute time
    host step  = offloaded optimizer elements ÷ host update rate (the host's memory
                 bandwidth ÷ 28 B), plus summing each later micro-batch's landed gradients
                 into the waiting ones (12 B per element, during that micro-batch's
                 backward; not in layer-major order, which sums on the device); the
                 eager step runs during the backward that completes the gradients (the
                 last micro-batch's, or all of layer-major's) and hides up to that time;
                 a deferred one (clipping, fp16 loss scaling, skipping non-finite losses
                 need every gradient first) runs bucket by bucket in the order the next
                 forward uses them, behind that forward (one micro-batch's, all of
                 layer-major's): only the first bucket's update is waited for.
                 Unpipelined (the code before it): the deferred step is all exposed
    optimizer  = device-updated elements × 28 bytes ÷ device memory bandwidth
                 + one kernel per parameter tensor and operation (torch's per-tensor Adam)
                 (on a GPU, an offloading optimizer's Twin-Flow share: one foreach launch per
                 operation and bounded run)
    comm       = all-reduce / reduce-scatter / all-gather bytes ÷ device link;
                 overlapped with backward (DDP buckets, FSDP prefetch)
    pipeline   = (stages - 1) / (micro-batches + stages - 1) of the compute is bubble

Throughput is the device's achievable rate: on a GPU the dense table peak times the share
its step's kernels reach (:mod:`hybridtrain.hardware.efficiency`, one figure per device with
its source: the H100's measured on our H100 machine), on a CPU the measured matmul rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from hybridtrain.hardware.links import Links
from hybridtrain.plan.types import TrainingPlan
from hybridtrain.planner.memory import device_share_run_numel, kept_blocks, lands_later, uploaded_bytes
from hybridtrain.planner.trace import ModelTrace
from hybridtrain.runtime.offload.layout import POOLED_BUFFERS

_ADAM_BYTES_PER_ELEMENT = 28
"""A fused Adam step reads parameter, gradient and two moments and writes three: 7 × 4 bytes."""


@dataclass(frozen=True)
class Hardware:
    """What the time model needs to know about the machine.

    Attributes:
        kind: ``cpu`` or ``cuda``.
        flops: achievable FLOP/s of this device in the compute dtype.
        links: link bandwidths.
        kernel_seconds: fixed cost per kernel (launch on a GPU, dispatch on a CPU).
        host_update_rate: optimizer elements per second a host step reaches.
    """

    kind: str
    flops: float
    links: Links
    kernel_seconds: float
    host_update_rate: float


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step, by part (``total`` is not their sum: parts overlap;
    ``host_step_exposed``, ``transfers_exposed`` and ``communication_exposed`` are the parts
    of ``host_step``, ``transfers`` and ``communication`` no device work hides)."""

    compute: float = 0.0
    recompute: float = 0.0
    optimizer: float = 0.0
    transfers: float = 0.0
    host_step: float = 0.0
    host_step_exposed: float = 0.0
    communication: float = 0.0
    bubble: float = 0.0
    total: float = 0.0
    transfers_exposed: float = 0.0
    communication_exposed: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Plain values."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_HOST_SUM_BYTES_PER_ELEMENT = 12
"""Adding a landed fp32 gradient into the one waiting on the host: two reads and a write of 4 bytes."""

_ADAM_KERNELS_PER_TENSOR = 10
"""Operations of torch's single-tensor Adam(W) per parameter tensor (CPU's default path)."""


def estimate_time(plan: TrainingPlan, trace: ModelTrace, hw: Hardware, kernels_per_micro_batch: int,
                  half_numel: Mapping[str, int] | None = None, pipelined_host_step: bool = True) -> StepTime:
    """Predict one step of ``plan`` (see the module docstring).

    ``half_numel``: elements that cross in half precision, per block and under ``""`` for
    the whole model (2 bytes instead of 4: Linear weights under bf16/fp16 autocast).
    ``pipelined_host_step``: a deferred host step hides behind the next forward (False:
    it runs exposed after the backward, as before the pipelined step).
    """
    half_numel = half_numel or {}
    sizes = plan.sizes
    k = plan.batch.accumulation_steps
    tp, pp, dp = sizes.tp, sizes.pp, sizes.dp
    stage = 1.0 / pp
    fwd = sum(p.forward_flops for p in trace.phases) * stage / tp
    first_update = 0.0  # elements of the first bucket the next forward waits for
    # The next forward's FLOPs that can run while the host still updates: what comes before
    # the last host-updated block (streaming) or bucket (offload), so a Twin-Flow share of
    # the last parameters (device_share: last) hides nothing behind its forward.
    forward_ahead = fwd
    bwd = sum(p.backward_flops for p in trace.phases) * stage / tp
    checkpointed = set(plan.checkpoint_modules)
    recomputed = sum(p.forward_flops for p in trace.blocks if p.name in checkpointed) * stage / tp
    compute = k * (fwd + bwd) / hw.flops + k * kernels_per_micro_batch * stage * hw.kernel_seconds
    recompute = k * recomputed / hw.flops
    backward_time = k * (bwd + recomputed) / hw.flops
    link = hw.links.host_to_device
    param_bytes = 4 * trace.param_numel * stage / tp
    # Transfers between device and host, and the host optimizer step.
    transfers = 0.0
    swapped = set(plan.swap_modules)
    swap_bytes = sum(max(0, p.kept_bytes - p.output_bytes) if p.name not in checkpointed else p.input_bytes
                     for p in trace.blocks if p.name in swapped) * stage / tp
    transfers += 2 * k * swap_bytes / link
    opt = plan.optimizer
    host_elems = 0.0
    # Gradients held on the device go down once per step, after backward, beside the host
    # step that takes them bucket by bucket (fp32 when summed over micro-batches).
    held_down = 0.0
    recast = 0.0  # half-width elements cast again for backward (half_images: per_upload)
    if opt.placement == "host":
        host_elems = trace.param_numel * opt.host_ratio * stage / tp
        # Gradients go down once per micro-batch and updated weights come back once per
        # step, half-width ones at 2 bytes both ways.
        width = 4 * host_elems - 2 * min(half_numel.get("", 0) * opt.host_ratio, host_elems)
        if opt.grads_wait_on_device:
            held_down = (4 * host_elems if k > 1 else width) / link
            transfers += width / link
        else:
            transfers += (width * k + width) / link
        first_update = min(host_elems, plan.optimizer.bucket_size)
        forward_ahead = _forward_before(trace, _last_bucket_start(trace.param_numel, trace.param_numel * opt.host_ratio,
                                                                  plan.optimizer.bucket_size,
                                                                  opt.device_share_first)) * stage / tp
    streamed = [p for p in trace.blocks if any(b.stream and b.name == p.name for b in plan.blocks)]
    if opt.placement == "host_streamed":
        host_elems = trace.param_numel * opt.host_ratio * stage / tp  # Twin-Flow: the rest on the device
        full = 4 * sum(p.param_numel for p in streamed)
        width = sum(uploaded_bytes(p.param_numel, half_numel.get(p.name, 0)) for p in streamed)  # half width: 2 bytes
        layer_major = plan.step_runner == "layer_major"
        uploads = 1 if layer_major else k
        # Each block comes up for forward and again for backward (kept blocks only for
        # forward), per micro-batch or once (layer-major); its gradients go down
        # (layer-major sums micro-batches on the device in fp32: full width unless k is 1).
        kept = set(kept_blocks(plan, [p.name for p in streamed]))
        kept_width = sum(uploaded_bytes(p.param_numel, half_numel.get(p.name, 0)) for p in streamed if p.name in kept)
        grads = full if (layer_major or opt.grads_wait_on_device) and k > 1 else width
        if opt.grads_wait_on_device:
            held_down = grads / link
            transfers += uploads * (2 * width - kept_width) / link
        else:
            transfers += (uploads * (2 * width - kept_width) + uploads * grads) / link
        first_update = float(streamed[0].param_numel) if streamed else host_elems
        if streamed:
            names = {p.name for p in streamed}
            last = max(i for i, p in enumerate(trace.blocks) if p.name in names)
            forward_ahead = sum(p.forward_flops for p in (trace.pre, *trace.blocks[:last])) * stage / tp
        if plan.stream_images_per_upload:
            recast = uploads * sum(min(half_numel.get(p.name, 0), p.param_numel)
                                   for p in streamed if p.name not in kept)
    # Held gradients' copies and the host step run side by side: the slower one sets the pace.
    host_update = max(host_elems / hw.host_update_rate, held_down) if host_elems else 0.0
    # Micro-batches landing one by one are summed on the host by the worker that steps
    # (offload_bucket.sum_staged): each later one during its own backward, the last one's
    # beside the eager step.
    summed_on_host = k > 1 and not opt.grads_wait_on_device and (
        opt.placement == "host" or (opt.placement == "host_streamed" and plan.step_runner != "layer_major"))
    # At the host step's own rate (its bytes ÷ its seconds): the same cores and memory run both.
    host_bytes_rate = hw.host_update_rate * _ADAM_BYTES_PER_ELEMENT
    one_sum = host_elems * _HOST_SUM_BYTES_PER_ELEMENT / host_bytes_rate if summed_on_host else 0.0
    # A cast reads the fp32 master and writes the half image: 6 bytes per element, on the
    # same host cores and memory as the step (counted with it).
    host_step = host_update + (k - 1) * one_sum + recast * 6 / host_bytes_rate
    device_elems = max(0.0, trace.param_numel * stage / tp - host_elems)
    if plan.zero_stage:
        device_elems /= dp
    kernels = _ADAM_KERNELS_PER_TENSOR * trace.param_tensors if hw.kind == "cpu" else 0
    if hw.kind != "cpu" and opt.placement in ("host", "host_streamed") and device_elems:
        # The offloading optimizer steps its Twin-Flow share in bounded runs
        # (runtime/offload/device_share.py): one foreach launch per operation and run.
        kernels = _ADAM_KERNELS_PER_TENSOR * math.ceil(device_elems / device_share_run_numel(trace))
    optimizer = (device_elems * _ADAM_BYTES_PER_ELEMENT / hw.links.device_memory + kernels * hw.kernel_seconds
                 if device_elems else 0.0)
    if hw.kind == "cpu":
        # Host and device are the same cores and memory: copies and the host step run
        # in turn with the compute, nothing hides behind anything.
        hidden_transfers = hidden_host = 0.0
    else:
        hidden_transfers = min(transfers, compute + recompute)
        eager = opt.placement != "device" and not opt.defer_step
        # A block's update needs its whole gradient: in micro-batch order that exists only
        # during the last micro-batch's backward (H100, GPT-1.3B, 2 micro-batches: hiding it
        # behind every backward predicted 0.35 s for optimizer offload, 0.73 s measured).
        whole = plan.step_runner == "layer_major"
        window = backward_time if whole else backward_time / max(k, 1)
        earlier_sums = max(k - 2, 0) * min(one_sum, window) if eager else max(k - 1, 0) * min(one_sum, window)
        hidden_host = earlier_sums + (min(host_update + one_sum, window) if eager else 0.0)
        if not eager and pipelined_host_step and host_update:
            # The next forward (all micro-batches in layer-major) waits only for the
            # first bucket's update; the rest runs behind that forward.
            forward_time = (k if whole else 1) * forward_ahead / hw.flops
            first = min(host_update, first_update / hw.host_update_rate)
            behind = host_update - first
            if opt.grads_wait_on_device and not lands_later(plan):
                # Held gradients go down through the pool before step() returns: only the
                # pool's last buckets are still updating when the next forward starts.
                behind = min(behind, (POOLED_BUFFERS - 1) * first_update / hw.host_update_rate)
            hidden_host += min(behind, forward_time)
    # Data parallel: gradient all-reduce (ring: 2 (n-1)/n of the bytes); ZeRO-3 also
    # gathers parameters for forward and backward.
    comm = 0.0
    if dp > 1:
        ring = 2 * (dp - 1) / dp * param_bytes
        if plan.zero_stage == 3:
            ring += 2 * (dp - 1) / dp * param_bytes * (2 if plan.compute_dtype is None else 1)
        comm += ring / hw.links.device_to_device
    if tp > 1:
        act = sum(p.output_bytes for p in trace.blocks) * stage
        comm += 4 * k * 2 * (tp - 1) / tp * act / hw.links.device_to_device
    if pp > 1:
        comm += 2 * k * (trace.blocks[0].output_bytes if trace.blocks else 0) / hw.links.device_to_device
    hidden_comm = min(comm, backward_time) * (0.8 if hw.kind != "cpu" else 0.0)
    bubble = 0.0
    if pp > 1:
        bubble = (pp - 1) / (k + pp - 1) * (compute + recompute) / (1 - (pp - 1) / (k + pp - 1))
    total = compute + recompute + optimizer + bubble + (transfers - hidden_transfers) + (host_step - hidden_host) + \
        (comm - hidden_comm)
    return StepTime(compute=compute, recompute=recompute, optimizer=optimizer, transfers=transfers, host_step=host_step,
                    host_step_exposed=host_step - hidden_host,
                    communication=comm, bubble=bubble, total=total, transfers_exposed=transfers - hidden_transfers,
                    communication_exposed=comm - hidden_comm)


def _last_bucket_start(total: float, host: float, bucket: int, share_first: bool) -> float:
    """Where, in the model's parameter order, the last host-updated bucket of optimizer offload
    starts: buckets are cut from the last host parameter backwards (backward order), so the
    last one holds ``bucket`` elements (or every host one); the host parameters are the first
    ``host`` elements, or with a device share first the last ones."""
    end = total if share_first else host
    return end - min(float(bucket or host), host)


def _forward_before(trace: ModelTrace, element: float) -> float:
    """Forward FLOPs of the phases whose parameters all come before parameter ``element`` (the
    model's order): the next forward runs them before it reads what an update still holds."""
    flops, seen = 0.0, 0
    for phase in trace.phases:
        seen += phase.param_numel
        if seen > element:
            break
        flops += phase.forward_flops
    return flops
