"""The check that a ``device_memory_limit`` can be met at all (the ladder itself:
tests/plan/test_variants.py)."""

from __future__ import annotations

import pytest

from hybridtrain.config import load_config
from hybridtrain.planner.estimate import estimate, resolve_target
from hybridtrain.recovery.memory_plans import ESTIMATE_MARGIN, check_limit_reachable


def test_a_limit_below_the_least_memory_plans_estimate_is_one_line_before_allocation() -> None:
    raw = {"device": "cpu", "train_batch_size": 4, "model": {"name": "gpt-tiny"}, "data": {"seq_len": 32},
           "device_memory_limit": "100kB", "oom_recovery": {"enabled": True}}
    with pytest.raises(ValueError, match=r"device_memory_limit = 100000 bytes \(97.66 KiB\) is too small: even "
                                         r"with activation checkpointing of every block, micro-batch 4 -> 2 .* a step "
                                         r"needs about \d+ bytes") as caught:
        check_limit_reachable(load_config(raw))
    assert "\n" not in str(caught.value)
    check_limit_reachable(load_config({**raw, "device_memory_limit": "64MiB"}))


def test_the_end_of_a_layer_major_ladder_gives_up_the_kept_blocks_and_is_checked() -> None:
    """The ladder under streaming (its checkpointing rung refused there, so left out)
    reaches an estimable end: no kept blocks, micro-batch 1."""
    raw = {"device": "cpu", "train_batch_size": 4, "model": {"name": "gpt-tiny"}, "data": {"seq_len": 32},
           "device_memory_limit": "100kB", "oom_recovery": {"enabled": True},
           "layer_streaming": {"enabled": True, "layer_major": True, "keep_blocks_for_backward": -1}}
    with pytest.raises(ValueError, match=r"too small: even with no streamed blocks kept for backward \(all -> 0\), "
                                         r"micro-batch 4 -> 2 .* micro-batch 2 -> 1 .* a step needs about \d+ bytes"):
        check_limit_reachable(load_config(raw))
    check_limit_reachable(load_config({**raw, "device_memory_limit": "64MiB"}))
    # On a CPU the host side (streaming's host masters, optimizer state, buffers) is not the
    # device's: a limit the device side fits is not refused for it.
    least = load_config({**raw, "train_batch_size": 4, "gradient_accumulation_steps": 4,
                         "layer_streaming": {"enabled": True, "layer_major": True}})
    planned = estimate(least, resolve_target("cpu"))
    device_side = planned.device_peak_bytes - planned.host_bytes
    assert planned.host_bytes > 0 and planned.device_peak_bytes * (1 - ESTIMATE_MARGIN) > device_side
    check_limit_reachable(load_config({**raw, "device_memory_limit": device_side}))
