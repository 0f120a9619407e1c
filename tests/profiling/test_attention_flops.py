"""Attention with grouped key/value heads (``enable_gqa``, as Hugging Face's Llama family runs
it) is counted as torch 2.13 counts it, on every torch: torch 2.11's own formulas refuse it and
stopped ``hybridtrain profile``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import hybridtrain as ht
from hybridtrain.profiling.attention_flops import ATTENTION_FLOP_FORMULAS, sdpa_flops
from hybridtrain.profiling.counting import count_step

B, T, D, HQ, HKV, HD = 2, 16, 32, 4, 2, 8  # HQ · HD == D: the block adds its output back


class GQAAttention(nn.Module):
    """Causal self-attention with HQ query heads sharing HKV key/value heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, HQ * HD, bias=False)
        self.kv = nn.Linear(D, 2 * HKV * HD, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, D)
        q = self.q(x).view(B, T, HQ, HD).transpose(1, 2)  # (B, HQ, T, HD)
        k, v = self.kv(x).view(B, T, 2, HKV, HD).permute(2, 0, 3, 1, 4)  # each (B, HKV, T, HD)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + y.transpose(1, 2).reshape(B, T, HQ * HD)


class GQANet(nn.Module):
    """Two GQA blocks; the mean of the output is the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([GQAAttention() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.mean()


def _mm(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


LINEAR = _mm(B * T, D, HQ * HD) + _mm(B * T, D, 2 * HKV * HD)
ATTENTION = 2 * _mm(T, T, HD) * B * HQ  # Q·Kᵀ and P·V for every query head


def test_grouped_heads_count_as_their_query_heads() -> None:
    q = torch.randn(B, HQ, T, HD, requires_grad=True)
    k, v = (torch.randn(B, HKV, T, HD, requires_grad=True) for _ in range(2))
    with FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOP_FORMULAS) as counter:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    # Backward recomputes the scores and does four more matmuls: five in all.
    assert counter.get_total_flops() == ATTENTION + 5 * ATTENTION // 2


def test_heads_that_do_not_group_are_one_line() -> None:
    with pytest.raises(ValueError, match="query heads 4 are not a multiple of key/value heads 3"):
        sdpa_flops((B, 4, T, HD), (B, 3, T, HD), (B, 3, T, HD))


def test_profile_counts_a_gqa_model() -> None:
    torch.manual_seed(0)
    engine = ht.initialize(GQANet(), {"device": "cpu", "train_micro_batch_size_per_gpu": B})
    count = count_step(engine, torch.randn(B, T, D))
    blocks = [m for m in count.modules if m.kind == "block"]
    assert [m.name for m in blocks] == ["blocks.0", "blocks.1"]
    for block, input_grads in zip(blocks, (0, 1), strict=True):
        assert block.forward_flops == LINEAR + ATTENTION
        # Weight gradients always; the input's only past the first block (the batch needs none).
        assert block.backward_flops == (1 + input_grads) * LINEAR + 5 * ATTENTION // 2
