"""Micro-batches summed on the host (offload_bucket.sum_staged): each later micro-batch's landed
gradients are added into the waiting ones, 12 bytes per element at the host's rate, part of
the host's work in the time model; layer-major order sums on the device and pays none."""

from __future__ import annotations

from typing import Any

import pytest

from hybridtrain.planner.estimate import Estimate, Target, estimate, meta_model

BANDWIDTH = 1e9
TARGET = Target("cuda", "H100 SXM", 2**30, 2**30, host_bandwidth=BANDWIDTH)
BASE = {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_micro_batch_size_per_gpu": 2, "device": "cpu"}
OFFLOAD = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
LAYER_MAJOR = {"layer_streaming": {"enabled": True, "layer_major": True}}


def _at(accumulation: int, mode: dict[str, Any]) -> Estimate:
    return estimate({**BASE, **mode, "gradient_accumulation_steps": accumulation,
                     "train_batch_size": 2 * accumulation}, TARGET)


@pytest.mark.parametrize("accumulation", [2, 4])
def test_optimizer_offload_pays_12_bytes_per_element_for_each_later_micro_batch(accumulation: int) -> None:
    one, several = _at(1, OFFLOAD), _at(accumulation, OFFLOAD)
    params = sum(p.numel() for p in meta_model(one.config).parameters())
    assert several.time.host_step - one.time.host_step == pytest.approx((accumulation - 1) * params * 12 / BANDWIDTH)
    assert one.time.host_step == pytest.approx(params * 28 / BANDWIDTH)


def test_layer_major_sums_on_the_device_so_its_host_work_does_not_grow() -> None:
    assert _at(4, LAYER_MAJOR).time.host_step == pytest.approx(_at(1, LAYER_MAJOR).time.host_step)
