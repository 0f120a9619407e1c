"""The planner: same-math variants, refused when they do not fit, ranked by predicted
time; the fallback OOM recovery asks for; ``auto: true`` and DeepSpeed's ``autotuning``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hybridtrain as ht
from hybridtrain.config import ConfigError, load_config
from hybridtrain.models.gpt import build_gpt, causal_lm_loss
from hybridtrain.planner import Target, estimate, fallback, plan, planned_config
from hybridtrain.planner.search import EQUAL_TIME, MARGIN, Candidate, no_fit_message, rank

CPU = Target("cpu", "cpu")
TINY = {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 4, "device": "cpu"}


def _limited(limit: int | None, host: int | None = None, kind: str = "cpu") -> Target:
    return Target(kind, "cpu" if kind == "cpu" else "H100 SXM", limit, host)


def test_variants_that_fit_are_ranked_by_predicted_time_and_the_rest_refused() -> None:
    plain = estimate(TINY, CPU).device_peak_bytes
    limit = int(plain * 0.8)  # the config as it is does not fit
    result = plan(TINY, _limited(limit))
    assert result.ranked and result.refused
    times = [c.estimate.step_seconds for c in result.ranked]
    assert all(a <= b * (1 + EQUAL_TIME) for a, b in zip(times, times[1:], strict=False))
    assert all(c.estimate.device_peak_bytes <= limit * (1 - MARGIN) for c in result.ranked)
    assert all(c.estimate.device_peak_bytes > limit * (1 - MARGIN) for c in result.refused)
    assert not any(c.changes == () for c in result.ranked)  # "as configured" is refused
    # Same math: the global batch never changes.
    assert {c.estimate.plan.batch.global_batch for c in result.ranked} == {4}


def test_equal_predicted_times_prefer_the_plan_leaving_more_device_memory() -> None:
    def candidate(seconds: float, peak: int) -> Candidate:
        return Candidate(None, (f"{seconds}s/{peak}B",), SimpleNamespace(step_seconds=seconds, device_peak_bytes=peak),
                         ())  # type: ignore[arg-type]

    ranked = rank([candidate(1.0, 10), candidate(1.005, 5), candidate(1.2, 1), candidate(1.0, 20)])
    assert [c.changes[0] for c in ranked] == ["1.005s/5B", "1.0s/10B", "1.0s/20B", "1.2s/1B"]


def test_a_limit_below_every_plan_is_one_line_with_the_numbers() -> None:
    result = plan(TINY, _limited(10_000))
    assert result.best is None
    message = no_fit_message(result, _limited(10_000))
    assert "needs" in message and "has 9.77 KiB" in message and "\n" not in message


def test_host_memory_too_small_for_offloaded_state_refuses_the_offloading_variants() -> None:
    gpu = _limited(None, host=1024, kind="cuda")
    offloaded = estimate({**TINY, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, gpu)
    (problem,) = offloaded.problems()
    assert problem.startswith("host memory: needs") and problem.endswith("has 1.00 KiB")


def test_fallback_is_the_fastest_variant_fitting_under_the_limit_after_calibration() -> None:
    predicted = estimate(TINY, CPU).device_peak_bytes
    # Measured 20 % above the estimate: every candidate is scaled up the same way.
    chosen = fallback(TINY, int(predicted * 1.2), int(predicted * 0.9))
    assert chosen is not None
    assert estimate(chosen, CPU).device_peak_bytes * 1.2 <= predicted * 0.9
    assert chosen.train_batch_size == 4
    assert fallback(TINY, predicted, 1000) is None


def test_auto_picks_a_plan_that_fits_and_trains() -> None:
    limit = int(estimate(TINY, CPU).device_peak_bytes * 0.8)
    model = build_gpt("gpt-tiny", seq_len=64)
    batch = (torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64)))
    chosen = planned_config({**TINY, "auto": True, "device_memory_limit": limit}, model, causal_lm_loss, batch)
    assert isinstance(chosen, type(load_config(TINY)))
    assert not chosen.auto and estimate(chosen, CPU).device_peak_bytes <= limit
    engine = ht.initialize(model, {**TINY, "auto": True}, loss_fn=causal_lm_loss, example_batch=batch)
    assert engine.train_batch(batch) > 0


def test_auto_without_an_example_batch_trains_as_configured(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="hybridtrain"):
        engine = ht.initialize(build_gpt("gpt-tiny", seq_len=64), {**TINY, "auto": True}, loss_fn=causal_lm_loss)
    assert engine.options.batch.micro_batch == 4
    assert "example_batch" in caplog.text


def test_auto_when_nothing_fits_is_one_line_before_anything_is_built() -> None:
    model = build_gpt("gpt-tiny", seq_len=64)
    batch = (torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64)))
    with pytest.raises(ConfigError, match=r"^auto: no plan fits: .*needs .*, has 1000 B$"):
        planned_config({**TINY, "auto": True, "device_memory_limit": 1000}, model, causal_lm_loss, batch)


def test_deepspeed_autotuning_maps_to_auto() -> None:
    on = load_config({"autotuning": {"enabled": True, "fast": True, "metric": "throughput"}})
    off = load_config({"autotuning": {"enabled": False, "tuner_type": "gridsearch"}})
    assert on.auto and not off.auto

