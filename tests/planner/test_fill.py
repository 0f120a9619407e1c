"""Filling the device (hybridtrain/planner/fill.py): a fitting variant's Twin-Flow ratio and
checkpoint interval grow as far as the device (less the margin) holds them, only where the
step gets faster; the planner's ranking takes the filled variants."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hybridtrain.config import ConfigError, load_config
from hybridtrain.planner import fill, plan
from hybridtrain.planner.estimate import Estimate, Target, estimate
from hybridtrain.planner.fill import RATIO_STEP, fill_device, grow_ratio
from hybridtrain.planner.search import MARGIN

BASE = {"data": {"seq_len": 64}, "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "device": "cpu",
        "bf16": {"enabled": True}}
OFFLOAD = {**BASE, "model": {"name": "gpt-tiny"},
           "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 1.0}}}
CHECKPOINTED = {**BASE, "model": {"name": "gpt-mini"}, "data": {"seq_len": 128},
                "activation_checkpointing": {"enabled": True, "every_n_blocks": 1}}
SLOW_HOST = 1e6
"""Host bytes/s that make the host optimizer step bind, so updating on the device pays."""


def _target(limit: int | None) -> Target:
    return Target("cuda", "H100 SXM", limit, 2**40, host_bandwidth=SLOW_HOST)


def _with(config: dict[str, Any], section: str, **settings: Any) -> dict[str, Any]:
    inner = dict(config[section])
    if section == "zero_optimization":
        inner["offload_optimizer"] = {**inner["offload_optimizer"], **settings}
    else:
        inner.update(settings)
    return {**config, section: inner}


def _between(low: Estimate, high: Estimate) -> int:
    """A device limit (before the margin) half-way between two variants' peaks."""
    return int((low.device_peak_bytes + high.device_peak_bytes) / 2 / (1 - MARGIN))


def test_the_twin_flow_ratio_falls_as_far_as_the_device_holds_it_and_the_step_gets_faster() -> None:
    all_host = estimate(OFFLOAD, _target(None), all_passes=True)
    mostly_device = estimate(_with(OFFLOAD, "zero_optimization", ratio=RATIO_STEP), _target(None), all_passes=True)
    assert mostly_device.device_peak_bytes > all_host.device_peak_bytes
    target = _target(_between(all_host, mostly_device))
    start = estimate(OFFLOAD, target, all_passes=True)
    assert not start.problems(MARGIN)
    config, changes, filled = fill_device(load_config(OFFLOAD), ("optimizer offload",), start, target, 1, MARGIN, None)
    ratio = config.zero_optimization.offload_optimizer.ratio
    assert RATIO_STEP < ratio < 1.0 and filled.plan.optimizer.host_ratio == ratio
    assert not filled.problems(MARGIN)
    assert filled.step_seconds < start.step_seconds and filled.time.host_step < start.time.host_step
    # As far as it goes: one step further does not fit.
    further = estimate(_with(OFFLOAD, "zero_optimization", ratio=round(ratio - RATIO_STEP, 4)), target,
                       all_passes=True)
    assert further.problems(MARGIN)
    assert changes == (f"optimizer offload ratio {ratio} (Twin-Flow: the rest on the device)",)


def test_a_full_device_keeps_the_variant_as_it_is() -> None:
    start = estimate(OFFLOAD, _target(None), all_passes=True)
    target = _target(int(start.device_peak_bytes / (1 - MARGIN)) + 1)
    config, changes, filled = fill_device(load_config(OFFLOAD), (), estimate(OFFLOAD, target, all_passes=True),
                                          target, 1, MARGIN, None)
    assert config.zero_optimization.offload_optimizer.ratio == 1.0 and changes == ()
    assert filled.step_seconds == estimate(OFFLOAD, target, all_passes=True).step_seconds


def test_the_checkpoint_interval_grows_as_far_as_the_device_holds_it() -> None:
    every_block = estimate(CHECKPOINTED, _target(None), all_passes=True)
    blocks = len(every_block.plan.blocks)
    assert blocks == 4 and len(every_block.plan.checkpoint_modules) == blocks
    one_checkpoint = estimate(_with(CHECKPOINTED, "activation_checkpointing", every_n_blocks=blocks), _target(None),
                              all_passes=True)
    target = _target(_between(every_block, one_checkpoint))
    start = estimate(CHECKPOINTED, target, all_passes=True)
    config, changes, filled = fill_device(load_config(CHECKPOINTED), ("checkpoint every block",), start, target, 1,
                                          MARGIN, None)
    every = config.activation_checkpointing.every_n_blocks
    assert 1 < every < blocks and not filled.problems(MARGIN)
    assert filled.time.recompute < start.time.recompute and filled.step_seconds < start.step_seconds
    further = estimate(_with(CHECKPOINTED, "activation_checkpointing", every_n_blocks=every + 1), target,
                       all_passes=True)
    assert further.problems(MARGIN)
    assert changes == (f"checkpoint every {every} blocks",)


def test_the_planner_ranks_the_filled_variant_first_when_the_host_step_binds() -> None:
    unlimited = plan(OFFLOAD, _target(None))
    on_device = min(c.estimate.device_peak_bytes for c in unlimited.ranked
                    if c.estimate.plan.optimizer.placement == "device")
    # Room for part of the optimizer on the device, but no variant updating all of it there fits.
    target = _target(int(on_device * 0.98 / (1 - MARGIN)))
    result = plan(OFFLOAD, target)
    best = result.best
    assert best is not None and not best.problems
    assert 0.0 < best.estimate.plan.optimizer.host_ratio < 0.5  # below every ratio the grid offers
    assert any("Twin-Flow" in words for words in best.changes)
    assert all(best.estimate.step_seconds <= c.estimate.step_seconds * 1.01 for c in result.ranked)


def test_filled_variants_join_the_ranking_beside_their_originals_and_nothing_fills_without_a_limit() -> None:
    unlimited = plan(OFFLOAD, _target(None))
    assert not any("Twin-Flow" in words for c in unlimited.ranked for words in c.changes)
    on_device = min(c.estimate.device_peak_bytes for c in unlimited.ranked
                    if c.estimate.plan.optimizer.placement == "device")
    result = plan(OFFLOAD, _target(int(on_device * 0.98 / (1 - MARGIN))))
    filled = [c for c in result.ranked if any("Twin-Flow" in words for words in c.changes)]
    assert filled
    for candidate in filled:
        # Its original (the same config but for what filling grew) is still ranked, leaner and slower.
        originals = [c for c in result.ranked if c not in filled and _unfilled(c) == _unfilled(candidate)]
        assert any(o.estimate.device_peak_bytes < candidate.estimate.device_peak_bytes
                   and o.estimate.step_seconds > candidate.estimate.step_seconds for o in originals)


def _unfilled(candidate: Any) -> str:
    """The candidate's config without the settings filling grows."""
    dump = candidate.config.model_dump(mode="json")
    offload = dump["zero_optimization"]["offload_optimizer"]
    offload.pop("ratio")
    offload.pop("gpu_ratio")
    offload.pop("device_share")
    dump["activation_checkpointing"].pop("every_n_blocks")
    return json.dumps(dump, sort_keys=True)



def test_a_ratio_that_streams_no_block_is_not_taken() -> None:
    # gpt-tiny's two blocks stream, one kept for backward. Low ratios stream neither (both
    # updated on the device), and the engine refuses streaming nothing: those ratios fit
    # nowhere, so the keep-first fill stops at the lowest ratio that still streams a block.
    streamed = {**OFFLOAD, "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.0}},
                "layer_streaming": {"enabled": True, "keep_blocks_for_backward": 1}}
    start = estimate(streamed, _target(2**40), all_passes=True)
    assert [b.stream for b in start.plan.blocks] == [True, True]
    config, changes, filled = grow_ratio((load_config(streamed), (), start), _target(2**40), 1, MARGIN, None)
    ratio = config.zero_optimization.offload_optimizer.ratio
    assert ratio < 1.0 and changes == (f"optimizer offload ratio {ratio} (Twin-Flow: the rest on the device)",)
    assert [b.stream for b in filled.plan.blocks] == [True, False]
    with pytest.raises(ConfigError, match="keeps a parameter of every block"):
        estimate(_with(streamed, "zero_optimization", ratio=round(ratio - RATIO_STEP, 4)), _target(2**40))
    # The whole fill also tries the ratio first from no kept blocks: whatever it takes is a
    # config the engine accepts, and no slower.
    best_config, _, best = fill_device(load_config(streamed), (), start, _target(2**40), 1, MARGIN, None)
    assert best.step_seconds <= filled.step_seconds
    assert estimate(best_config, _target(2**40)).step_seconds == pytest.approx(best.step_seconds)


def test_kept_blocks_give_way_to_a_lower_ratio_when_that_is_faster() -> None:
    """Kept blocks and the Twin-Flow ratio compete for device bytes. With the host step
    binding and the link idle, the ratio-first fill (no kept blocks, the ratio as low as fits,
    then kept blocks) is faster than keeping every block first: the planner takes it."""
    streamed = {**OFFLOAD, "model": {"name": "gpt-tiny", "overrides": {"n_layer": 8}},
                "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.0}},
                "layer_streaming": {"enabled": True, "keep_blocks_for_backward": -1}}
    unlimited = _target(None)
    all_kept = estimate(streamed, unlimited, all_passes=True)
    none_kept_low = estimate(_with({**streamed, "layer_streaming": {"enabled": True}}, "zero_optimization",
                                   ratio=0.5), unlimited, all_passes=True)
    # Room for every block kept at ratio 1, or for half the update on the device without keeping.
    limit = int(max(all_kept.device_peak_bytes, none_kept_low.device_peak_bytes) / (1 - MARGIN)) + 1
    target = _target(limit)
    start = estimate(streamed, target, all_passes=True)
    greedy = grow_ratio((load_config(streamed), (), start), target, 1, MARGIN, None)
    config, changes, filled = fill_device(load_config(streamed), (), start, target, 1, MARGIN, None)
    assert filled.step_seconds < greedy[2].step_seconds and not filled.problems(MARGIN)
    assert config.zero_optimization.offload_optimizer.ratio < greedy[0].zero_optimization.offload_optimizer.ratio


def test_checkpointing_the_resident_blocks_frees_room_for_a_lower_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under streaming the blocks of Twin-Flow's device share keep their activations from
    forward to backward unless checkpointed. With the host step binding, recomputing them
    costs less than the host time a lower ratio saves: the fill checkpoints them (the engine
    then wraps them, tests/runtime/streaming/test_streaming_twin_flow.py) and takes the ratio lower
    than any fill that keeps their activations, within the same device limit."""
    streamed = {**OFFLOAD, "model": {"name": "gpt-tiny", "overrides": {"n_layer": 8}},
                "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.0}},
                "layer_streaming": {"enabled": True}}
    unlimited = _target(None)
    start_free = estimate(streamed, unlimited, all_passes=True)
    half = estimate(_with(streamed, "zero_optimization", ratio=0.5), unlimited, all_passes=True)
    target = _target(_between(start_free, half))
    start = estimate(streamed, target, all_passes=True)
    config, changes, filled = fill_device(load_config(streamed), (), start, target, 1, MARGIN, None)
    monkeypatch.setattr(fill, "RESIDENT_INTERVALS", ())
    kept_activations = fill_device(load_config(streamed), (), start, target, 1, MARGIN, None)
    assert not filled.problems(MARGIN) and filled.step_seconds < kept_activations[2].step_seconds
    assert config.activation_checkpointing.enabled and any(w.endswith("resident block") for w in changes)
    ratio = config.zero_optimization.offload_optimizer.ratio
    assert ratio < kept_activations[0].zero_optimization.offload_optimizer.ratio
    streamed_names = {b.name for b in filled.plan.blocks if b.stream}
    resident_checkpointed = set(filled.plan.checkpoint_modules) - streamed_names
    assert resident_checkpointed and filled.time.recompute > kept_activations[2].time.recompute
