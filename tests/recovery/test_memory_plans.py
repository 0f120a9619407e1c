"""Same-math configs that need less memory: the ladder, dropout, the limit check."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.config import BatchSizes, load_config
from hybridtrain.plan import resolve
from hybridtrain.recovery.memory_plans import (
    check_limit_reachable,
    describe_changes,
    draws_random_numbers,
    less_memory_configs,
)
from tests.equivalence import gpt_case

PLAIN = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "device": "cpu"}


def test_the_ladder_beside_a_gpu_and_on_cpu() -> None:
    config, batch = load_config(PLAIN), BatchSizes(8, 8, 1, 1)
    gpu = [change for change, _ in less_memory_configs(config, batch, torch.device("cuda"), False)]
    assert gpu == ["activation checkpointing of every block", "activation swapping", "optimizer offload",
                   "layer streaming", "micro-batch 8 -> 4 with 1 -> 2 accumulation steps"]
    cpu = dict(less_memory_configs(config, batch, torch.device("cpu"), True))
    assert list(cpu) == ["activation checkpointing of every block"]
    assert cpu["activation checkpointing of every block"].activation_checkpointing.enabled
    offload = dict(less_memory_configs(config, batch, torch.device("cuda"), True))["optimizer offload"]
    assert offload.zero_optimization.offload_optimizer.device == "cpu"
    # Offload is ignored at stage 0, so the rung moves to stage 1: the plan puts the update on the host.
    assert resolve(offload.model_dump(), gpt_case(0.0).build(), world_size=1).optimizer.placement == "host"


def test_random_forwards_are_recognised() -> None:
    assert draws_random_numbers(gpt_case(0.1).build())
    assert not draws_random_numbers(gpt_case(0.0).build())


def test_changes_are_described_by_their_settings() -> None:
    config = load_config(PLAIN)
    smaller = load_config({**PLAIN, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                           "activation_checkpointing": {"enabled": True, "every_n_blocks": 2}})
    assert describe_changes(config, smaller) == (
        "train_micro_batch_size_per_gpu: 4, gradient_accumulation_steps: 2, activation_checkpointing.enabled: True, "
        "activation_checkpointing.every_n_blocks: 2")
    assert describe_changes(config, config) == "the same settings"


def test_a_limit_below_the_least_memory_plans_estimate_is_one_line_before_allocation() -> None:
    raw = {"device": "cpu", "train_batch_size": 4, "model": {"name": "gpt-tiny"}, "data": {"seq_len": 32},
           "device_memory_limit": "100kB", "oom_recovery": {"enabled": True}}
    with pytest.raises(ValueError, match=r"device_memory_limit = 100000 bytes \(97.66 KiB\) is too small: even "
                                         r"with activation checkpointing of every block, micro-batch 4 -> 2 .* a step "
                                         r"needs about \d+ bytes") as caught:
        check_limit_reachable(load_config(raw))
    assert "\n" not in str(caught.value)
    check_limit_reachable(load_config({**raw, "device_memory_limit": "64MiB"}))
