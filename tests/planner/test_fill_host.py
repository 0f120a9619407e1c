"""A layer-streaming variant whose host state does not fit host memory gets the largest
Twin-Flow ratio whose host state fits, when the device then holds it
(:func:`hybridtrain.planner.fill.fit_host`); the search then takes it as a plan."""

from __future__ import annotations

from hybridtrain.planner import plan
from hybridtrain.planner.estimate import Target, estimate, meta_model
from hybridtrain.planner.fill import FIT_RATIO_STEP, fit_host, keep_most
from hybridtrain.planner.search import MARGIN

STREAM = {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_batch_size": 8,
          "train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
          "layer_streaming": {"enabled": True, "layer_major": True}}


def _targets() -> tuple[Target, int]:
    roomy = Target("cuda", "H100 SXM", 2**30, 2**40, host_bandwidth=152e9)
    full = estimate(STREAM, roomy)
    # The host holds three quarters of what the whole model's host state needs.
    return Target("cuda", "H100 SXM", 2**30, int(0.75 * full.host_bytes), host_bandwidth=152e9), full.host_bytes


def test_a_streaming_variant_over_host_memory_takes_the_largest_fitting_ratio() -> None:
    target, needed = _targets()
    est = estimate(STREAM, target)
    assert est.host_bytes == needed and est.problems(MARGIN)
    fitted = fit_host(est.config, ("layer streaming layer-major",), est, target, 1, MARGIN, None)
    assert fitted is not None
    config, changes, grown = fitted
    ratio = config.zero_optimization.offload_optimizer.ratio
    assert 0 < ratio < 1 and not grown.problems(MARGIN)
    assert grown.plan.optimizer.host_ratio == ratio
    assert any(not b.stream for b in grown.plan.blocks)  # the device-updated blocks stay resident
    assert changes[-1] == f"optimizer offload ratio {ratio} (Twin-Flow: the rest on the device)"
    # The next larger ratio would not fit the host.
    larger = estimate(config.model_copy(update={"zero_optimization": config.zero_optimization.model_copy(
        update={"offload_optimizer": config.zero_optimization.offload_optimizer.model_copy(
            update={"ratio": round(ratio + FIT_RATIO_STEP, 4)})})}), target)
    assert larger.host_bytes > target.host_memory_bytes


def test_the_search_finds_a_twin_flow_streaming_plan_where_full_offload_does_not_fit_the_host() -> None:
    target, _ = _targets()
    result = plan(STREAM, target)
    twin_flow = [c for c in result.ranked if c.estimate.plan.optimizer.placement == "host_streamed"
                 and c.estimate.plan.optimizer.host_ratio < 1 and any(b.stream for b in c.estimate.plan.blocks)]
    assert twin_flow and all(0 < c.estimate.host_bytes <= target.host_memory_bytes for c in twin_flow)
    assert any("Twin-Flow" in words for words in twin_flow[0].changes)


def test_when_the_device_cannot_hold_the_fitting_ratio_the_attempt_says_by_how_much() -> None:
    target, _ = _targets()
    est = estimate(STREAM, target)
    # A device that holds the whole-host variant with nothing to spare.
    tight = Target("cuda", "H100 SXM", int(est.device_peak_bytes / (1 - MARGIN)) + 1, target.host_memory_bytes,
                   host_bandwidth=152e9)
    est = estimate(STREAM, tight)
    assert [p.split(":")[0] for p in est.problems(MARGIN)] == ["host memory"]
    fitted = fit_host(est.config, (), est, tight, 1, MARGIN, None)
    assert fitted is not None
    _, changes, attempt = fitted
    assert attempt.host_bytes <= tight.host_memory_bytes
    assert [p.split(":")[0] for p in attempt.problems(MARGIN)] == ["device memory"]
    assert "Twin-Flow" in changes[-1]


def test_gpt_13b_fits_one_h100_with_the_host_at_12_bytes_per_parameter() -> None:
    """Issue #39's target: GPT-13B, 16k tokens per step with clipping (bf16, AdamW), on the
    H100 machine's figures. The search (``hybridtrain plan``, docs/planning.md) ranks first this
    variant after its per-variant steps: over host memory as configured, it casts images per
    upload and takes the largest Twin-Flow ratio the host holds (:func:`fit_host`), then keeps
    as many streamed blocks for backward as the device holds (:func:`keep_most`)."""
    h100 = Target("cuda", "H100 SXM", 80 * 2**30, 125 * 2**30, host_bandwidth=152e9)
    config = {"model": {"name": "gpt-13b"}, "data": {"seq_len": 1024}, "bf16": {"enabled": True},
              "train_batch_size": 16, "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "layer_streaming": {"enabled": True, "boundary_activations": "host"},
              "zero_optimization": {"offload_optimizer": {"device": "cpu", "gradients_wait": "device"}}}
    est = estimate(config, h100, all_passes=True)
    assert [p.split(":")[0] for p in est.problems(MARGIN)] == ["host memory"]
    fitted = fit_host(est.config, (), est, h100, 1, MARGIN, None)
    assert fitted is not None and not fitted[2].problems(MARGIN)
    variant, changes, grown = keep_most(*fitted, h100, 1, MARGIN, None)
    assert not grown.problems(MARGIN) and changes[0] == "half-width images cast per upload"
    assert 0 < variant.layer_streaming.keep_blocks_for_backward < sum(b.stream for b in grown.plan.blocks)
    # The host holds 12 bytes per host-updated parameter (fp32 master, two moments), no gradient.
    host, total = grown.memory.host, sum(p.numel() for p in meta_model(grown.config).parameters())
    assert host.gradients == 0
    assert abs((host.parameters + host.optimizer_state) / (grown.plan.optimizer.host_ratio * total) - 12) < 0.05
