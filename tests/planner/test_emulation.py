"""The meta-device trace counts attention with grouped key/value heads (``enable_gqa``, Hugging
Face's Llama family) as the real step does; before torch 2.13 torch's formula refused it and
stopped ``hybridtrain estimate``/``plan`` on such models."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.planner.trace import trace_model
from tests.profiling.test_attention_flops import ATTENTION, LINEAR, B, D, GQANet, T


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_trace_counts_grouped_heads_as_the_real_step(compute_dtype: torch.dtype | None) -> None:
    with torch.device("meta"):
        net = GQANet()
    trace = trace_model(net, list(net.blocks), ["blocks.0", "blocks.1"], torch.empty(B, T, D, device="meta"),
                        None, compute_dtype=compute_dtype)
    assert [(b.name, b.forward_flops) for b in trace.blocks] == [("blocks.0", LINEAR + ATTENTION),
                                                                 ("blocks.1", LINEAR + ATTENTION)]
