"""The step split from profiler events: innermost range wins, parts add up to the step."""

from __future__ import annotations

import pytest

from hybridtrain.profiling.breakdown import (
    PARTS,
    Event,
    busy_fraction,
    category,
    collective_seconds,
    device_split,
    module_times,
    split_step,
)


def test_categories() -> None:
    assert category("hybridtrain::forward") == "forward"
    assert category("hybridtrain::interleaved") == "forward"
    assert category("autograd::engine::evaluate_function: MmBackward0") == "backward"
    assert category("hybridtrain::step") == "device_optimizer"
    assert category("hybridtrain::host_optimizer") == "host_optimizer"
    assert category("c10d::allreduce_") == "communication"
    assert category("gloo:all_reduce") == "communication"
    assert category("FSDP::all_gather") == "communication"
    assert category("aten::mm") is None


def test_innermost_range_wins_and_parts_add_up() -> None:
    main = 7
    events = [
        Event("hybridtrain::forward", 0.0, 4.0, main),
        Event("aten::mm", 0.5, 1.0, main),  # uncategorised: stays forward
        Event("hybridtrain::transfer", 1.0, 2.0, main),  # a swap inside forward
        Event("hybridtrain::backward", 4.0, 8.0, main),
        Event("hybridtrain::communication", 6.0, 7.5, main),
        Event("hybridtrain::host_optimizer", 8.5, 9.0, main),
        Event("hybridtrain::step", 9.0, 9.5, main),
        Event("hybridtrain::backward", 0.0, 9.5, main + 1),  # another thread: not the step's
        Event("hybridtrain::forward", -1.0, 0.5, main),  # clipped to the step
    ]
    parts = split_step(events, 0.0, 10.0, main)
    assert set(parts) == set(PARTS)
    assert parts == pytest.approx({"forward": 3.0, "transfer": 1.0, "backward": 2.5, "communication": 1.5,
                                   "host_optimizer": 0.5, "device_optimizer": 0.5, "idle": 1.0})
    assert sum(parts.values()) == pytest.approx(10.0)


def test_interleaved_splits_at_autograd_functions() -> None:
    events = [Event("hybridtrain::interleaved", 0.0, 10.0),
              Event("autograd::engine::evaluate_function: AddmmBackward0", 6.0, 9.0),
              Event("hybridtrain::transfer", 7.0, 8.0)]
    parts = split_step(events, 0.0, 10.0, 0)
    assert (parts["forward"], parts["backward"], parts["transfer"]) == pytest.approx((7.0, 2.0, 1.0))


def test_module_times_follow_sequence_numbers_into_backward() -> None:
    events = [
        Event("hybridtrain.module::blocks.0", 0.0, 2.0, thread=1),
        Event("aten::addmm", 0.5, 1.0, thread=1, seq=10),
        Event("hybridtrain.module::blocks.1", 2.0, 3.0, thread=1),
        Event("aten::addmm", 2.1, 2.5, thread=1, seq=11),
        Event("hybridtrain::backward", 4.0, 9.0, thread=1),
        Event("autograd::engine::evaluate_function: AddmmBackward0", 5.0, 5.5, thread=2, seq=11, fwd_thread=1),
        Event("autograd::engine::evaluate_function: AddmmBackward0", 6.0, 7.5, thread=2, seq=10, fwd_thread=1),
        Event("hybridtrain.module::blocks.0", 8.0, 8.25, thread=1),  # recomputed inside backward
    ]
    times = module_times(events, ["blocks.0", "blocks.1", "head"])
    assert times == {"blocks.0": pytest.approx((2.0, 1.75)), "blocks.1": pytest.approx((1.0, 0.5)),
                     "head": (0.0, 0.0)}


def test_busy_fraction_and_collectives() -> None:
    events = [Event("aten::mm", 0.0, 2.0, 1), Event("aten::add", 1.0, 3.0, 2), Event("hybridtrain::forward", 0, 10, 1),
              Event("gloo:all_reduce", 5.0, 6.0, 3), Event("gloo:all_reduce", 5.5, 6.5, 4),
              Event("kernel", 4.0, 5.0, on_device=True)]
    assert busy_fraction(events, 0.0, 10.0, on_device=False) == pytest.approx(0.3)
    assert busy_fraction(events, 0.0, 10.0, on_device=True) == pytest.approx(0.1)
    assert collective_seconds(events, 0.0, 10.0) == pytest.approx(1.5)  # two threads' overlap counts once


def test_device_split_unions_each_kind() -> None:
    events = [Event("ampere_sgemm_128x64", 0.0, 2.0, on_device=True), Event("elementwise", 1.0, 3.0, on_device=True),
              Event("Memcpy HtoD (Pinned -> Device)", 2.5, 4.0, on_device=True),
              Event("ncclDevKernel_AllReduce_Sum_f32", 3.0, 5.0, on_device=True), Event("aten::mm", 0.0, 9.0)]
    assert device_split(events, 0.0, 4.5) == pytest.approx({"compute": 3.0, "memcpy": 1.5, "communication": 1.5})
