"""Communication on two gloo ranks: measured by the wall-clock breakdown and the profile."""

from __future__ import annotations

from typing import Any

import torch

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from hybridtrain.profiling.profiler import profile_engine
from tests.parallel.spawn import run_ranks


def _rank() -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64))
    engine = ht.initialize(model, {"device": "cpu", "train_micro_batch_size_per_gpu": 2,
                                   "wall_clock_breakdown": True, "gradient_clipping": 1.0,
                                   "tensor_model_parallel_size": 2}, loss_fn=causal_lm_loss)
    ids = torch.randint(0, 64, (2, 17))
    batch = (ids[:, :-1], ids[:, 1:])
    engine.train_batch(batch)
    timings = engine.last_timings
    profile = profile_engine(engine, batch, steps=2)
    return {"communication_s": timings.communication, "parts": profile.parts,
            "collective_s": profile.collective_seconds, "step_s": profile.step_seconds}


def test_collectives_are_measured_on_gloo() -> None:
    for rank in run_ranks(_rank, 2, timeout=180.0):
        # Tensor parallel: the loss mean and the gradient averaging are our own collectives.
        assert rank["communication_s"] > 0
        assert rank["parts"]["communication"] > 0
        assert rank["collective_s"] > 0
        assert sum(rank["parts"].values()) <= rank["step_s"] * (1 + 1e-9)
