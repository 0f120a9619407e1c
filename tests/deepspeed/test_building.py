"""The engine behind ``deepspeed.initialize`` (:mod:`hybridtrain.deepspeed.building`): ZeRO-3
parameter offload of a model without repeated blocks trains (transformers' DeepSpeed tests
offload the parameters of their two-scalar ``RegressionPreTrainedModel``), the same math as a
plain loop."""

from __future__ import annotations

import torch
from torch import nn

import hybridtrain.deepspeed as deepspeed
from hybridtrain.config import load_config
from hybridtrain.deepspeed.building import without_unstreamable_param_offload

OFFLOAD = {"train_micro_batch_size_per_gpu": 4, "zero_force_ds_cpu_optimizer": False,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"}}}


class _Regression(nn.Module):
    """``y = a·x + b`` with two scalar parameters and no blocks, as transformers' test model."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.tensor(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + self.b


def test_zero3_parameter_offload_of_a_model_without_blocks_trains_as_a_plain_loop() -> None:
    engine, *_ = deepspeed.initialize(model=_Regression(), config=OFFLOAD)
    reference = _Regression()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(4, generator=generator)
        loss = (engine(x) - 2 * x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        (reference(x) - 2 * x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        optimizer.step()
        optimizer.zero_grad()
    engine.engine.wait_for_updates()
    for mine, theirs in zip(engine.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-5, atol=0)


def test_parameter_offload_stays_where_the_blocks_can_stream() -> None:
    cfg = load_config(dict(OFFLOAD))
    blocks = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert without_unstreamable_param_offload(cfg, blocks) is cfg
    dropped = without_unstreamable_param_offload(cfg, _Regression())
    assert dropped.zero_optimization.offload_param.device == "none"
    assert dropped.zero_optimization.offload_optimizer.device == "cpu"
