"""The Python API on your own model: python examples/python_api.py"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hybridtrain as ht


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8))
        self.out = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


engine = ht.initialize(
    Net(),
    {"train_batch_size": 64, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
     "activation_checkpointing": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
    loss_fn=lambda out, batch: F.mse_loss(out.float(), batch[1]),
)
x = torch.randn(64, 64)
y = x.sum(dim=1, keepdim=True).sin()
for step in range(1, 101):
    loss = engine.train_batch((x, y))
    if step % 20 == 0:
        print(f"step={step} loss={loss:.4f}")
