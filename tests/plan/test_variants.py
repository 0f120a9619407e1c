"""The space of same-math variants and its two walks: the ladder out-of-memory recovery
climbs and the planner's grid; one dropout rule, one diff, one reading of parallel sizes."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.config import BatchSizes, ConfigError, load_config
from hybridtrain.plan import resolve
from hybridtrain.plan.checks import check_supported
from hybridtrain.plan.variants import (
    changed_settings,
    describe_changes,
    draws_random_numbers,
    grid,
    ladder,
)
from tests.equivalence import gpt_case

PLAIN = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "device": "cpu"}


def test_the_ladder_beside_a_gpu_and_on_cpu() -> None:
    config, batch = load_config(PLAIN), BatchSizes(8, 8, 1, 1)
    gpu = [change for change, _ in ladder(config, batch, torch.device("cuda"), False)]
    assert gpu == ["activation checkpointing of every block", "activation swapping", "optimizer offload",
                   "layer streaming", "micro-batch 8 -> 4 with 1 -> 2 accumulation steps"]
    cpu = dict(ladder(config, batch, torch.device("cpu"), True))
    assert list(cpu) == ["activation checkpointing of every block"]
    assert cpu["activation checkpointing of every block"].activation_checkpointing.enabled
    offload = dict(ladder(config, batch, torch.device("cuda"), True))["optimizer offload"]
    assert offload.zero_optimization.offload_optimizer.device == "cpu"
    # Offload is ignored at stage 0, so the rung moves to stage 1: the plan puts the update on the host.
    assert resolve(offload.model_dump(), gpt_case(0.0).build(), world_size=1).optimizer.placement == "host"


def test_random_forwards_are_recognised() -> None:
    assert draws_random_numbers(gpt_case(0.1).build())
    assert not draws_random_numbers(gpt_case(0.0).build())


def test_both_walks_keep_the_micro_batch_of_a_random_forward() -> None:
    config, batch = load_config(PLAIN), BatchSizes(8, 8, 1, 1)
    walks = {"grid": {v.train_micro_batch_size_per_gpu for _, v, _ in grid(config, 1, True)},
             "ladder": {v.train_micro_batch_size_per_gpu for _, v in ladder(config, batch, torch.device("cuda"), True)}}
    assert walks == {"grid": {8}, "ladder": {8}}
    assert {v.train_micro_batch_size_per_gpu for _, v, _ in grid(config, 1, False)} == {1, 2, 4, 8}
    # Same math: every variant of either walk keeps the global batch.
    assert {v.train_batch_size or 8 for _, v, _ in grid(config, 1, False)} == {8}


def test_changes_are_described_by_their_settings() -> None:
    config = load_config(PLAIN)
    smaller = load_config({**PLAIN, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                           "activation_checkpointing": {"enabled": True, "every_n_blocks": 2}})
    assert describe_changes(config, smaller) == (
        "train_micro_batch_size_per_gpu: 4, gradient_accumulation_steps: 2, activation_checkpointing.enabled: True, "
        "activation_checkpointing.every_n_blocks: 2")
    assert describe_changes(config, config) == "the same settings"
    assert changed_settings(config, smaller)[0] == ("train_micro_batch_size_per_gpu", 8, 4)


def test_conflicting_parallel_sizes_are_an_error_not_the_larger() -> None:
    config = load_config({**PLAIN, "train_batch_size": 16, "tensor_parallel": {"size": 2},
                          "tensor_model_parallel_size": 4})
    with pytest.raises(ConfigError, match="^tensor_model_parallel_size=4 but tensor_parallel.size=2; "):
        next(grid(config, 8, False))


LAYER_MAJOR = {**PLAIN, "layer_streaming": {"enabled": True, "layer_major": True, "keep_blocks_for_backward": -1}}


def test_kept_blocks_are_given_up_first_and_refused_rungs_are_left_out() -> None:
    """Kept blocks cost only bandwidth: they go first, all at once; under streaming the
    checkpointing and offload rungs (refused there) are not offered."""
    config, batch = load_config(LAYER_MAJOR), BatchSizes(8, 8, 1, 1)
    gpu = dict(ladder(config, batch, torch.device("cuda"), False))
    assert list(gpu) == ["no streamed blocks kept for backward (all -> 0)", "activation swapping",
                         "micro-batch 8 -> 4 with 1 -> 2 accumulation steps"]
    [(words, fewer), *_] = gpu.items()
    assert describe_changes(config, fewer) == "layer_streaming.keep_blocks_for_backward: 0"
    assert resolve(fewer.model_dump(), gpt_case(0.0).build(), world_size=1).stream_keep_blocks == 0
    some = load_config({**PLAIN, "layer_streaming": {**LAYER_MAJOR["layer_streaming"], "keep_blocks_for_backward": 2}})
    assert next(ladder(some, batch, torch.device("cpu"), True))[0] == "no streamed blocks kept for backward (2 -> 0)"
    assert "no streamed blocks" not in dict(ladder(fewer, batch, torch.device("cpu"), True))


def test_the_grid_of_a_layer_major_config_keeps_its_other_variants() -> None:
    """Variants without streaming drop layer_major and the kept blocks (else refused);
    layer-major variants start at none kept (the planner's search raises the count)."""
    variants = [variant for _, variant, _ in grid(load_config(LAYER_MAJOR), 1, False)]
    for variant in variants:
        check_supported(variant, 1)
    assert variants[0].layer_streaming.keep_blocks_for_backward == -1  # the config itself first
    streamed = [v for v in variants if v.layer_streaming.enabled]
    assert len(streamed) < len(variants)
    # the config's own techniques at each micro-batch keep its count; the grid's layer-major variants none
    assert {v.layer_streaming.keep_blocks_for_backward for v in streamed if v.layer_streaming.layer_major} == {-1, 0}
