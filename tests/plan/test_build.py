"""What ``build`` decides from a plan without running it."""

from __future__ import annotations

import pytest

from hybridtrain.plan.build import optimizer_params
from hybridtrain.plan.resolve import resolve
from tests.equivalence import gpt_case

ADAM = {"type": "AdamW", "params": {"lr": 1e-3}}


@pytest.mark.parametrize(("zero", "optimizer", "fused"), [
    ({"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}, ADAM, True),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, ADAM, True),
    ({"stage": 3}, ADAM, None),  # on the device: torch picks its own implementation
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {"type": "SGD", "params": {"lr": 0.1}}, None),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}},
     {"type": "AdamW", "params": {"lr": 1e-3, "fused": False}}, False),  # the user's choice stands
])
def test_zero_offload_steps_with_the_fused_host_adam(zero: dict, optimizer: dict, fused: bool | None) -> None:
    plan = resolve({"device": "cpu", "train_micro_batch_size_per_gpu": 2, "optimizer": optimizer,
                    "zero_optimization": zero}, gpt_case().build(), world_size=2)
    assert optimizer_params(plan).get("fused") == fused
