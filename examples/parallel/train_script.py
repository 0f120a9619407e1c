"""A user's own training script on many processes:

    hybridtrain launch --nproc-per-node 2 examples/parallel/train_script.py

Every rank runs this file; ``initialize`` joins the process group torchrun describes.
Each rank draws the same global batch and trains its shard (``engine.local_batch``);
``train_batch`` returns the global mean loss, the same on every rank.
"""

from __future__ import annotations

import torch

import hybridtrain as ht
from hybridtrain.models.gpt import build_gpt, causal_lm_loss

torch.manual_seed(0)
model = build_gpt("gpt-tiny")
engine = ht.initialize(model, {"train_batch_size": 8, "zero_optimization": {"stage": 2}},
                       loss_fn=causal_lm_loss)
gen = torch.Generator().manual_seed(1)
for step in range(5):
    tokens = torch.randint(0, 256, (8, 65), generator=gen)
    loss = engine.train_batch(engine.local_batch((tokens[:, :-1], tokens[:, 1:])))
    if engine.topology.rank == 0:
        print(f"step {step} loss {loss:.4f} topology {engine.topology.describe()}")
