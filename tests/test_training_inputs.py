"""What ``hybridtrain train`` builds from a config: data, model, example batch, and the plan, which any
model size gets on a laptop (the model built on the meta device)."""

from __future__ import annotations

import torch

from hybridtrain.config import load_config
from hybridtrain.training_inputs import data_and_model, example_batch, plan_training


def test_the_example_batch_is_one_micro_batch_of_the_data() -> None:
    cfg = load_config({"device": "cpu", "data": {"seq_len": 16}, "train_micro_batch_size_per_gpu": 3})
    data, model = data_and_model(cfg)
    inputs, targets = example_batch(cfg, data)
    assert inputs.shape == targets.shape == (3, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one token
    assert sum(p.numel() for p in model.parameters()) > 0


def test_a_model_of_billions_of_parameters_is_planned_without_memory() -> None:
    cfg = load_config({"device": "cpu", "model": {"name": "gpt-6.7b"}, "data": {"seq_len": 32},
                       "activation_checkpointing": {"enabled": True}})
    plan = plan_training(cfg, world_size=1)
    assert plan.block_lists and len(plan.blocks) == 32  # GPT-6.7B's 32 layers, found on the meta device
    assert all(block.checkpoint for block in plan.blocks)
