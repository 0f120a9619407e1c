"""The check that a ``device_memory_limit`` can be met at all (the ladder itself:
tests/plan/test_variants.py)."""

from __future__ import annotations

import pytest

from hybridtrain.config import load_config
from hybridtrain.recovery.memory_plans import check_limit_reachable


def test_a_limit_below_the_least_memory_plans_estimate_is_one_line_before_allocation() -> None:
    raw = {"device": "cpu", "train_batch_size": 4, "model": {"name": "gpt-tiny"}, "data": {"seq_len": 32},
           "device_memory_limit": "100kB", "oom_recovery": {"enabled": True}}
    with pytest.raises(ValueError, match=r"device_memory_limit = 100000 bytes \(97.66 KiB\) is too small: even "
                                         r"with activation checkpointing of every block, micro-batch 4 -> 2 .* a step "
                                         r"needs about \d+ bytes") as caught:
        check_limit_reachable(load_config(raw))
    assert "\n" not in str(caught.value)
    check_limit_reachable(load_config({**raw, "device_memory_limit": "64MiB"}))
