"""The time and memory model of the pipelined host step and of kept streamed blocks,
derived by hand from the model's parts: a deferred host step (clipping) hides behind the
next forward except the first block's update; kept blocks cross once instead of twice and
hold their half-width uploads on the device; the host keeps a half image of each streamed
half-width weight."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from hybridtrain.config import load_config
from hybridtrain.plan.resolve import resolve
from hybridtrain.planner.estimate import (
    PASSES,
    Target,
    _config_source,
    _trace,
    estimate,
    half_width_numel,
    hardware,
)
from hybridtrain.planner.fill import keep_most
from hybridtrain.planner.search import MARGIN
from hybridtrain.planner.timing import Hardware, StepTime, estimate_time
from hybridtrain.runtime.offload.layout import POOLED_BUFFERS

H100 = Target("cuda", "H100 SXM", 80 * 2**30, 128 * 2**30, host_bandwidth=152e9)
LAYER_MAJOR = {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_micro_batch_size_per_gpu": 4,
               "gradient_accumulation_steps": 2, "device": "cpu", "bf16": {"enabled": True},
               "layer_streaming": {"enabled": True, "layer_major": True, "boundary_activations": "host"}}


def _setup(clip: float, keep: int = 0, **extra: Any) -> tuple[Any, Any, Any, dict[str, int]]:
    streaming = {**LAYER_MAJOR["layer_streaming"], **extra.pop("layer_streaming", {}), "keep_blocks_for_backward": keep}
    config = load_config({**LAYER_MAJOR, "gradient_clipping": clip, **extra, "layer_streaming": streaming})
    source = _config_source(config)
    plan = resolve(config, source.model, 1, example_batch=source.example(4))
    trace = _trace(config, source, plan, "cuda", PASSES[1:])
    return plan, trace, source, half_width_numel(source.model, plan, [p.name for p in trace.blocks])


def _forward_seconds(trace: Any, hw: Hardware, k: int) -> float:
    return k * sum(p.forward_flops for p in trace.phases) / hw.flops


def _forward_ahead_seconds(plan: Any, trace: Any, hw: Hardware, k: int) -> float:
    """The next forward up to the last streamed (host-updated) block: what runs while the
    host still updates (the rest needs that block's update)."""
    streamed = {b.name for b in plan.blocks if b.stream}
    last = max(i for i, p in enumerate(trace.blocks) if p.name in streamed)
    return k * sum(p.forward_flops for p in (trace.pre, *trace.blocks[:last])) / hw.flops


def _time(plan: Any, trace: Any, hw: Hardware, half: dict[str, int], pipelined: bool = True) -> StepTime:
    return estimate_time(plan, trace, hw, trace.kernels, half, pipelined_host_step=pipelined)


@pytest.mark.parametrize("host_over_forward", [0.5, 3.0])
def test_a_deferred_host_step_hides_behind_the_next_forward_but_the_first_blocks_update(
        host_over_forward: float) -> None:
    plan, trace, _, half = _setup(clip=1.0)
    assert plan.optimizer.defer_step and plan.step_runner == "layer_major"
    hw = hardware(H100, plan.compute_dtype)
    forward = _forward_seconds(trace, hw, k=2)  # layer-major: the forward of both micro-batches
    # A host update rate that makes the host step the wanted multiple of that forward.
    hw = replace(hw, host_update_rate=trace.param_numel / (host_over_forward * forward))
    first = trace.blocks[0].param_numel / hw.host_update_rate
    pipelined, serial = _time(plan, trace, hw, half), _time(plan, trace, hw, half, pipelined=False)
    assert pipelined.host_step == pytest.approx(host_over_forward * forward)
    # Shorter than the forward: only the first block's update is waited for; longer: what
    # the forward up to the last block cannot cover.
    expected = first if host_over_forward < 1 else pipelined.host_step - _forward_ahead_seconds(plan, trace, hw, 2)
    assert pipelined.host_step_exposed == pytest.approx(expected)
    assert serial.host_step_exposed == pytest.approx(serial.host_step)  # the code before: all exposed
    assert serial.total - pipelined.total == pytest.approx(serial.host_step - expected)


def test_without_clipping_the_step_is_eager_and_the_switch_changes_nothing() -> None:
    plan, trace, _, half = _setup(clip=0.0)
    assert not plan.optimizer.defer_step
    hw = hardware(H100, plan.compute_dtype)
    backward = 2 * sum(p.backward_flops for p in trace.phases) / hw.flops
    hw = replace(hw, host_update_rate=trace.param_numel / (3 * backward))
    pipelined, serial = _time(plan, trace, hw, half), _time(plan, trace, hw, half, pipelined=False)
    assert pipelined == serial
    # Hidden behind the backward that completes the gradients (recomputed forwards included).
    assert pipelined.host_step_exposed == pytest.approx(pipelined.host_step - backward - pipelined.recompute)


def test_keeping_all_blocks_halves_the_weight_bytes_up_and_holds_them_on_the_device() -> None:
    plan0, trace, source, half = _setup(clip=1.0)
    plan_all = _setup(clip=1.0, keep=-1)[0]
    plan_last = _setup(clip=1.0, keep=1)[0]
    hw = hardware(H100, plan0.compute_dtype)
    blocks = trace.blocks
    # One upload of a block: 2 bytes per half-width (Linear) weight, 4 per other parameter.
    upload = {p.name: 4 * p.param_numel - 2 * half[p.name] for p in blocks}
    assert all(half[p.name] for p in blocks)
    t0, t_all, t_last = (_time(p, trace, hw, half).transfers for p in (plan0, plan_all, plan_last))
    # Weights up: 2 crossings per block (forward, backward); kept blocks cross once.
    assert t0 - t_all == pytest.approx(sum(upload.values()) / hw.links.host_to_device)
    assert t0 - t_last == pytest.approx(upload[blocks[-1].name] / hw.links.host_to_device)
    cfg = load_config({**LAYER_MAJOR, "gradient_clipping": 1.0})
    peaks = {}
    for keep in (0, -1, 1):
        streaming = cfg.layer_streaming.model_copy(update={"keep_blocks_for_backward": keep})
        est = estimate(cfg.model_copy(update={"layer_streaming": streaming}), H100)
        peaks[keep] = est.device_peak_bytes
    assert peaks[-1] - peaks[0] == sum(upload.values())
    assert peaks[1] - peaks[0] == upload[blocks[-1].name]


def test_the_host_keeps_a_half_image_of_each_streamed_half_width_weight() -> None:
    _, trace, _, half = _setup(clip=1.0)
    cfg = {**LAYER_MAJOR, "gradient_clipping": 1.0}
    narrow, full = estimate(cfg, H100, half_width=True), estimate(cfg, H100, half_width=False)
    assert narrow.host_bytes - full.host_bytes == 2 * sum(half[p.name] for p in trace.blocks)


def test_the_search_keeps_the_most_blocks_that_fit() -> None:
    cfg = load_config({**LAYER_MAJOR, "gradient_clipping": 1.0})
    est = estimate(cfg, H100, all_passes=True)
    _, changes, kept = keep_most(cfg, (), est, H100, 1, MARGIN, None)
    assert kept.config.layer_streaming.keep_blocks_for_backward == -1
    assert changes == ("keep all streamed blocks for backward",)
    # Room for the kept last block but not for two: the search keeps one.
    _, trace, _, half = _setup(clip=1.0)
    last = 4 * trace.blocks[-1].param_numel - 2 * half[trace.blocks[-1].name]
    room = int((est.device_peak_bytes + 1.5 * last) / (1 - MARGIN))
    small = replace(H100, memory_bytes=room)
    variant, _, kept = keep_most(cfg, (), est, small, 1, MARGIN, None)
    assert variant.layer_streaming.keep_blocks_for_backward == 1
    assert not kept.problems(MARGIN)


def test_micro_batch_major_keeps_blocks_per_micro_batch_and_the_search_keeps_them() -> None:
    """Micro-batch-major order: each micro-batch uploads every block for its forward and the
    ones not kept again for its backward, so keeping all saves one upload per block and
    micro-batch; the kept images are on the device at each turn; the search picks -1."""
    mb_major = {"layer_streaming": {**LAYER_MAJOR["layer_streaming"], "layer_major": False}}
    plan0, trace, _, half = _setup(clip=1.0, **mb_major)
    plan_all = _setup(clip=1.0, keep=-1, **mb_major)[0]
    assert plan0.step_runner != "layer_major" and plan_all.stream_keep_blocks == len(trace.blocks)
    hw = hardware(H100, plan0.compute_dtype)
    upload = sum(4 * p.param_numel - 2 * half[p.name] for p in trace.blocks)
    k = plan0.batch.accumulation_steps
    t0, t_all = (_time(p, trace, hw, half).transfers for p in (plan0, plan_all))
    assert k == 2 and t0 - t_all == pytest.approx(k * upload / hw.links.host_to_device)
    cfg = load_config({**LAYER_MAJOR, **mb_major, "gradient_clipping": 1.0})
    est = estimate(cfg, H100, all_passes=True)
    _, changes, kept = keep_most(cfg, (), est, H100, 1, MARGIN, None)
    assert kept.config.layer_streaming.keep_blocks_for_backward == -1
    assert kept.device_peak_bytes - est.device_peak_bytes == upload


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_held_gradients_land_behind_the_next_forward_with_or_without_a_device_share(ratio: float) -> None:
    """Gradients held on the device (``gradients_wait: device``) land from a landing thread
    after the step returned: like gradients waiting in host memory, only the first block's
    update is waited for. With a Twin-Flow share too: it steps in bounded runs beside them
    (runtime/offload/device_share.py); before, they landed in the step ahead of its update and
    only the pool's last buckets updated behind the next forward (the bound asserted below)."""
    plan, trace, _, half = _setup(clip=1.0, model={"name": "gpt-tiny", "overrides": {"n_layer": 6}},
                                  zero_optimization={"offload_optimizer": {"gradients_wait": "device", "ratio": ratio,
                                                                           "device_share": "first"}})
    assert plan.optimizer.grads_wait_on_device and plan.optimizer.host_ratio == ratio
    hw = hardware(H100, plan.compute_dtype)
    forward = _forward_ahead_seconds(plan, trace, hw, k=2)
    host_numel = trace.param_numel * ratio
    # The host step fits behind the forward; a link fast enough that the copies never set its pace.
    hw = replace(hw, host_update_rate=host_numel / (0.9 * forward), links=replace(hw.links, host_to_device=1e18))
    held = _time(plan, trace, hw, half)
    first = trace.blocks[0].param_numel / hw.host_update_rate
    pool = (POOLED_BUFFERS - 1) * first
    assert held.host_step - first > pool  # the pool's bound would bind
    assert held.host_step_exposed == pytest.approx(first, rel=1e-6)


def test_a_device_share_of_the_last_blocks_hides_nothing_of_the_host_step_behind_their_forward() -> None:
    """The next forward reaches a Twin-Flow share of the last blocks only after every
    host-updated block's update (device_share: last); a share of the first blocks runs
    while the host updates the rest (device_share: first). The same share, the same host
    step: only what hides differs, by about the share's forward."""
    model = {"name": "gpt-tiny", "overrides": {"n_layer": 6}}
    times = {}
    for share in ("last", "first"):
        plan, trace, _, half = _setup(clip=1.0, model=model, zero_optimization={
            "offload_optimizer": {"ratio": 0.5, "device_share": share}})
        streamed = [b.stream for b in plan.blocks]
        assert streamed == (sorted(streamed) if share == "first" else sorted(streamed, reverse=True))
        hw = hardware(H100, plan.compute_dtype)
        # A host step three times the whole forward: the hidden part is what runs ahead.
        hw = replace(hw, host_update_rate=trace.param_numel * 0.5 / (3 * _forward_seconds(trace, hw, k=2)))
        times[share] = (_time(plan, trace, hw, half), _forward_ahead_seconds(plan, trace, hw, 2))
    (last, last_ahead), (first, first_ahead) = times["last"], times["first"]
    assert last.host_step == pytest.approx(first.host_step)
    for step, ahead in times.values():
        assert step.host_step_exposed == pytest.approx(step.host_step - ahead)
    assert first_ahead > 1.5 * last_ahead and last.total > first.total


def _offload_setup(share: str) -> tuple[Any, Any, dict[str, int]]:
    """gpt-tiny (6 blocks) under optimizer offload with clipping, half its update on the
    device (its share ``share``), in buckets of about one block."""
    config = load_config({"model": {"name": "gpt-tiny", "overrides": {"n_layer": 6}}, "data": {"seq_len": 64},
                          "train_micro_batch_size_per_gpu": 4, "device": "cpu", "bf16": {"enabled": True},
                          "gradient_clipping": 1.0, "zero_optimization": {
                              "stage": 1, "reduce_bucket_size": 3000,
                              "offload_optimizer": {"device": "cpu", "ratio": 0.5, "device_share": share}}})
    source = _config_source(config)
    plan = resolve(config, source.model, 1, example_batch=source.example(4))
    trace = _trace(config, source, plan, "cuda", PASSES[1:])
    return plan, trace, half_width_numel(source.model, plan, [p.name for p in trace.blocks])


def test_under_optimizer_offload_the_host_step_hides_behind_the_forward_ahead_of_its_last_bucket() -> None:
    """Optimizer offload's host buckets are cut from the last host parameter backwards and the
    next forward's first read of a bucket waits for its whole update: what hides a deferred host
    step is the forward of the phases wholly before the last bucket. With the Twin-Flow share
    last that is the first half of the model less a bucket; with it first, all but the last bucket."""
    exposed = {}
    for share in ("last", "first"):
        plan, trace, half = _offload_setup(share)
        assert plan.optimizer.placement == "host" and plan.optimizer.defer_step
        assert plan.optimizer.device_share_first == (share == "first")
        hw = hardware(H100, plan.compute_dtype)
        hw = replace(hw, host_update_rate=trace.param_numel * 0.5 / (3 * _forward_seconds(trace, hw, k=1)),
                     links=replace(hw.links, host_to_device=1e18))
        host = trace.param_numel * 0.5
        end = trace.param_numel if share == "first" else host
        start = end - min(plan.optimizer.bucket_size, host)
        ahead, seen = 0.0, 0
        for phase in trace.phases:  # the phases whose parameters all come before the last bucket
            seen += phase.param_numel
            if seen > start:
                break
            ahead += phase.forward_flops
        step = _time(plan, trace, hw, half)
        first = min(step.host_step, min(host, plan.optimizer.bucket_size) / hw.host_update_rate)
        assert step.host_step_exposed == pytest.approx(step.host_step - min(step.host_step - first, ahead / hw.flops))
        exposed[share] = step.host_step_exposed
    assert exposed["first"] < exposed["last"]
