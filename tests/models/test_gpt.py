"""Reference GPT: sizes, tied embeddings, meta-device builds, shapes."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.models.gpt import GPT, GPT_SIZES, GPTConfig, build_gpt, gpt_config, gpt_param_count


def test_tiny_forward_shapes_and_tied_head() -> None:
    model = build_gpt("gpt-tiny")
    logits = model(torch.randint(0, 256, (3, 10)))
    assert logits.shape == (3, 10, 256)
    assert model.head.weight is model.tok_emb.weight
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2


@pytest.mark.parametrize("size", list(GPT_SIZES))
def test_every_size_builds_on_meta_with_the_analytic_count(size: str) -> None:
    model = build_gpt(f"gpt-{size}", device="meta")
    counted = sum(p.numel() for p in model.parameters())
    assert counted == gpt_param_count(gpt_config(size))
    assert all(p.is_meta for p in model.parameters())


def test_13b_is_about_13_billion() -> None:
    assert 12e9 < gpt_param_count(gpt_config("gpt-13b", vocab_size=50304)) < 14e9


def test_bad_names_and_overrides() -> None:
    with pytest.raises(ValueError, match="allowed: gpt-tiny"):
        gpt_config("gpt-huge")
    with pytest.raises(ValueError, match="not GPT fields"):
        gpt_config("tiny", n_layers=3)
    with pytest.raises(ValueError, match="not divisible"):
        gpt_config("tiny", d_model=30, n_head=4)
    with pytest.raises(ValueError, match="exceeds"):
        build_gpt("gpt-tiny", seq_len=8)(torch.zeros(1, 9, dtype=torch.long))


def test_materialising_a_meta_build_keeps_the_head_tied() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64))
    model.to_empty(device="cpu")
    assert model.head.weight is model.tok_emb.weight
    untied = GPT(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=16, vocab_size=64, tie_embeddings=False))
    assert untied.to_empty(device="cpu").head.weight is not untied.tok_emb.weight
