"""The estimator against real steps: the peak of live tensor bytes of a steady-state CPU
step (measured with LiveTensorBytes) within the benchmark's bar of ±10 %."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.commands.measure import measure_step
from hybridtrain.config import load_config
from hybridtrain.models.gpt import gpt_config, gpt_param_count
from hybridtrain.plan.resolve import resolve
from hybridtrain.planner.estimate import (
    PASSES,
    Target,
    _config_source,
    _trace,
    estimate,
    half_width_numel,
    hardware,
    model_source,
    resolve_target,
)
from hybridtrain.planner.timing import estimate_time
from hybridtrain.profiling.host_bandwidth import ADAM_BYTES_PER_PARAM

TINY = {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_micro_batch_size_per_gpu": 8,
        "device": "cpu"}


@pytest.mark.parametrize("techniques", [
    {},
    {"activation_checkpointing": {"enabled": True}, "gradient_accumulation_steps": 2},
    {"bf16": {"enabled": True}},
    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
], ids=["plain", "checkpoint+accumulation", "bf16", "optimizer-offload"])
def test_estimate_within_ten_percent_of_measured_peak(techniques: dict) -> None:
    config = {**TINY, **techniques}
    predicted = estimate(config, resolve_target("cpu")).device_peak_bytes
    measured = measure_step(config, timed_steps=0).peak_bytes
    assert abs(predicted - measured) / measured <= 0.10, (predicted, measured)


def test_estimate_allocates_nothing_and_splits_the_bytes() -> None:
    # A 6.7B model (27 GB of fp32 weights alone) is estimated on the meta device in seconds.
    config = {"model": {"name": "gpt-6.7b", "overrides": {"n_layer": 2}}, "train_micro_batch_size_per_gpu": 1,
              "data": {"seq_len": 1024}, "bf16": {"enabled": True}}
    result = estimate(config, resolve_target("H100"))
    d = result.memory.device
    params = gpt_param_count(gpt_config("gpt-6.7b", n_layer=2, vocab_size=256, seq_len=1024))
    assert d.parameters == 4 * params
    assert d.optimizer_state == 2 * d.parameters  # Adam: two fp32 moments per fp32 weight
    assert result.device_peak_bytes >= d.parameters + d.optimizer_state + d.activations
    assert result.as_dict()["step_seconds"] > 0
    assert result.target.memory_bytes == 80 * 2**30


def test_gpu_target_moves_offloaded_state_to_the_host() -> None:
    config = {**TINY, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    on_gpu = estimate(config, Target("cuda", "H100 SXM"))
    plain = estimate(TINY, Target("cuda", "H100 SXM"))
    assert on_gpu.memory.device.optimizer_state == 0 < on_gpu.memory.host.optimizer_state
    assert on_gpu.device_peak_bytes < plain.device_peak_bytes


def test_the_host_step_streams_28_bytes_per_parameter_at_the_host_bandwidth() -> None:
    config = {**TINY, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    params = gpt_param_count(gpt_config("tiny", seq_len=64))
    for rate in (25e9, 152e9):
        result = estimate(config, resolve_target("H100", host_bandwidth=rate))
        assert result.target.host_bandwidth == rate
        assert result.time.host_step == pytest.approx(params * ADAM_BYTES_PER_PARAM / rate)


def test_a_callers_model_is_estimated_without_touching_it() -> None:
    from hybridtrain.models.gpt import build_gpt, causal_lm_loss

    model = build_gpt("gpt-tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.zeros(8, 64, dtype=torch.long), torch.zeros(8, 64, dtype=torch.long))
    source = model_source(model, batch, causal_lm_loss)
    from_model = estimate(TINY, resolve_target("cpu"), model=source).device_peak_bytes
    from_config = estimate(TINY, resolve_target("cpu")).device_peak_bytes
    assert from_model == from_config
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("layer_major", [False, True])
def test_half_width_weights_cross_at_two_bytes_in_the_time_model(layer_major: bool) -> None:
    """Under bf16, streamed Linear weights go up and their gradients come down as half
    (runtime/precision/half_width.py); layer-major's gradients summed over micro-batches stay fp32."""
    config = load_config({**TINY, "bf16": {"enabled": True}, "gradient_accumulation_steps": 2,
                          "train_batch_size": 16, "layer_streaming": {"enabled": True, "layer_major": layer_major,
                                                                      "boundary_activations": "host"}})
    source = _config_source(config)
    plan = resolve(config, source.model, 1, example_batch=source.example(8))
    trace = _trace(config, source, plan, "cuda", PASSES[1:])
    blocks = [p.name for p in trace.blocks]
    half = half_width_numel(source.model, plan, blocks)
    linear = {name: sum(p.numel() for m in source.model.get_submodule(name).modules()
                        if isinstance(m, torch.nn.Linear) for p in m.parameters()) for name in blocks}
    assert {name: half[name] for name in blocks} == linear and all(linear.values())
    hw = hardware(Target("cuda", "H100 SXM", host_bandwidth=152e9), plan.compute_dtype)
    full = estimate_time(plan, trace, hw, trace.kernels).transfers
    narrow = estimate_time(plan, trace, hw, trace.kernels, half).transfers
    saved = 2 * sum(linear.values())  # bytes per crossing
    uploads, down = (1, 0) if layer_major else (2, 2)
    assert full - narrow == pytest.approx((2 * uploads * saved + down * saved) / hw.links.host_to_device)


STREAMED_SHARE_FIRST = {"model": {"name": "gpt-tiny", "overrides": {"n_layer": 6}}, "data": {"seq_len": 256},
                        "train_micro_batch_size_per_gpu": 16, "device": "cpu", "layer_streaming": {"enabled": True},
                        "zero_optimization": {"offload_optimizer": {"ratio": 0.4, "device_share": "first"}}}


def test_checkpointing_the_resident_blocks_is_planned_as_measured() -> None:
    """Under streaming, activation_checkpointing wraps the blocks staying on the device
    (Twin-Flow's share, the first four of six here): the measured CPU peak falls with every
    resident block checkpointed, and the estimate follows it within 10 % each time."""
    peaks = []
    for every in (None, 2, 1):
        config = STREAMED_SHARE_FIRST if every is None else \
            {**STREAMED_SHARE_FIRST, "activation_checkpointing": {"enabled": True, "every_n_blocks": every}}
        est = estimate(config, resolve_target("cpu"))
        resident_checkpointed = set(est.plan.checkpoint_modules) - set(est.plan.blocks_where("stream"))
        assert len(resident_checkpointed) == {None: 0, 2: 2, 1: 4}[every]
        measured = measure_step(config, timed_steps=0).peak_bytes
        assert abs(est.device_peak_bytes - measured) / measured <= 0.10, (every, est.device_peak_bytes, measured)
        peaks.append(measured)
    assert peaks[0] > peaks[1] > peaks[2]
