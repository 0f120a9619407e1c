"""Models by config name: reference GPT sizes and random-init Hugging Face models."""

from __future__ import annotations

import pytest

from hybridtrain.models.factory import build_model


def test_gpt_by_name_sized_for_the_data() -> None:
    model = build_model("gpt-tiny", {"n_layer": 3}, vocab_size=300, seq_len=32, seed=0)
    assert model.config.n_layer == 3 and model.config.vocab_size == 300 and model.config.seq_len == 32


def test_hugging_face_by_type_without_download() -> None:
    pytest.importorskip("transformers")
    model = build_model("hf:llama", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                     "num_attention_heads": 4, "num_key_value_heads": 2}, 256, 64, 0)
    assert model.config.vocab_size == 256 and model.config.max_position_embeddings >= 64
    with pytest.raises(ValueError, match="not fields"):
        build_model("hf:gpt2", {"n_layers": 1}, 256, 64, 0)
    with pytest.raises(ValueError, match="not a Hugging Face model type"):
        build_model("hf:nonexistent", {}, 256, 64, 0)
    with pytest.raises(ValueError, match="'hf:t5' has no causal language-model class"):
        build_model("hf:t5", {"num_layers": 1, "d_model": 8, "d_kv": 4, "d_ff": 8, "num_heads": 2}, 256, 64, 0)


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="model.name = 'resnet'"):
        build_model("resnet", {}, 256, 64, 0)
