"""find_blocks on the model shapes we support."""

from __future__ import annotations

import pytest
from torch import nn

from hybridtrain.models.blocks import BlocksNotFoundError, find_blocks
from hybridtrain.models.gpt import build_gpt
from tests.equivalence import model_cases


def test_found_automatically() -> None:
    assert find_blocks(build_gpt("gpt-tiny"))[0] == "blocks"
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert find_blocks(seq) == ("", seq)


def test_hugging_face_blocks() -> None:
    pytest.importorskip("transformers")
    cases = model_cases()
    assert find_blocks(cases["hf_gpt2"].build())[0] == "transformer.h"
    assert find_blocks(cases["hf_llama"].build())[0] == "model.layers"


def test_named_path_and_errors() -> None:
    model = build_gpt("gpt-tiny")
    assert find_blocks(model, "blocks")[1] is model.blocks
    with pytest.raises(BlocksNotFoundError, match="model.blocks = 'layers' does not exist"):
        find_blocks(model, "layers")
    with pytest.raises(BlocksNotFoundError, match="not a ModuleList"):
        find_blocks(model, "ln_f")
    with pytest.raises(BlocksNotFoundError, match="set model.blocks"):
        find_blocks(nn.Linear(2, 2))


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(4, 12), nn.Linear(4, 4)


class _Hybrid(nn.Module):
    """Jamba's shape: one list of layers of two alternating classes, leaf lists beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Mixer(), _Attention(), _Mixer(), _Attention()])
        self.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)])  # leaves: not layers


def test_a_hybrid_models_alternating_layers_are_its_blocks() -> None:
    model = _Hybrid()
    assert find_blocks(model) == ("layers", model.layers)
    two = nn.Module()
    two.layers = nn.ModuleList([_Mixer(), _Attention()])  # one of each (a two-layer hybrid)
    assert find_blocks(two) == ("layers", two.layers)


def test_towers_and_weight_normed_lists_are_not_blocks() -> None:
    model = _Hybrid()
    # two different towers, each holding its own layers: the layers are the blocks
    towers = nn.Module()
    towers.towers = nn.ModuleList([model, _Attention()])
    assert find_blocks(towers)[0] == "towers.0.layers"
    # weight-normed convolutions: each parametrized module has a class of its own
    convs = nn.ModuleList([nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 9)) for _ in range(3)])
    holder = nn.Module()
    holder.convs, holder.layers = convs, nn.ModuleList([_Attention(), _Attention()])
    assert find_blocks(holder)[0] == "layers"
