"""Activation checkpointing: which modules, RNG-identical dropout, eval untouched."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.models.gpt import GPT, GPTConfig
from hybridtrain.profiling import SavedTensorMeter
from hybridtrain.runtime.activations.recompute import (
    apply_activation_checkpointing,
    is_checkpointed,
    remove_activation_checkpointing,
    select_checkpoint_targets,
    without_kv_cache,
)
from tests.equivalence import MODES, assert_same_training, engine_run, gpt_case, plain_run


def test_dropout_with_checkpointing_equals_the_unckeckpointed_plain_loop() -> None:
    case = gpt_case(dropout=0.2)
    assert_same_training(plain_run(case, MODES["plain"]), engine_run(case, MODES["checkpoint"]), rtol=1e-5, atol=1e-6)


def test_dropout_with_checkpointing_and_accumulation_equals_no_checkpointing() -> None:
    case = gpt_case(dropout=0.2)
    with_ckpt = engine_run(case, MODES["checkpoint_every2_accum2"])
    without = engine_run(case, MODES["accum2"])
    assert_same_training(without, with_ckpt, rtol=1e-5, atol=1e-6)


def test_selection_every_n_and_by_class() -> None:
    model = GPT(GPTConfig(n_layer=5))
    blocks = list(model.blocks)
    assert select_checkpoint_targets(model, blocks, 2) == [blocks[0], blocks[2], blocks[4]]
    mlps = select_checkpoint_targets(model, None, module_classes=["MLP"])
    assert len(mlps) == 5 and all(type(m).__name__ == "MLP" for m in mlps)
    with pytest.raises(ValueError, match="matches no module"):
        select_checkpoint_targets(model, None, module_classes=["Nope"])


def test_apply_keeps_names_and_is_reversible() -> None:
    model = GPT(GPTConfig(n_layer=2))
    names = list(model.state_dict())
    apply_activation_checkpointing(list(model.blocks))
    apply_activation_checkpointing(list(model.blocks))  # idempotent
    assert list(model.state_dict()) == names and all(is_checkpointed(b) for b in model.blocks)
    x = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        out = model(x)
    remove_activation_checkpointing(list(model.blocks))
    assert not any(is_checkpointed(b) for b in model.blocks)
    with torch.no_grad():
        assert torch.equal(model(x), out)


def test_checkpointed_block_saves_less_for_backward() -> None:
    def saved_bytes(model: torch.nn.Module) -> int:
        with SavedTensorMeter() as meter:
            model(torch.randint(0, 256, (4, 64))).sum()
        return meter.bytes

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, d_model=64))
    plain = saved_bytes(model)
    apply_activation_checkpointing(list(model.blocks))
    assert saved_bytes(model) < plain / 3


class _KeyCache:
    """A key/value cache as Hugging Face layers use it: ``update`` appends and returns all."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, key: torch.Tensor) -> torch.Tensor:
        self.keys.append(key)
        return torch.cat(self.keys, dim=0)


class _CachingLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: _KeyCache | None = None) -> torch.Tensor:
        keys = self.proj(x)
        if cache is not None:
            keys = cache.update(keys)
        return torch.softmax(x @ keys.T, dim=-1) @ keys  # attends over every key the cache holds


def test_a_layer_handed_a_cache_is_recomputed_without_it() -> None:
    torch.manual_seed(0)
    plain, checkpointed = _CachingLayer(), _CachingLayer()
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing([checkpointed])
    x = torch.randn(3, 4)
    grads = []
    for layer in (plain, checkpointed):
        layer(x, cache=_KeyCache()).pow(2).sum().backward()  # (recomputed with the cache: over 6 keys)
        grads.append(layer.proj.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    kept = _KeyCache()
    assert without_kv_cache(plain, {"cache": kept, "use_cache": True, "past_key_values": kept}) == {
        "cache": None, "use_cache": False, "past_key_values": kept}  # a prefix is kept, as HF keeps it
    plain._can_checkpoint_with_cache = True  # a layer that only reads its cache keeps it
    assert without_kv_cache(plain, {"cache": kept})["cache"] is kept
    assert without_kv_cache(plain, {"cache": {"not": "a cache"}, "x": 1}) == {"cache": {"not": "a cache"}, "x": 1}
