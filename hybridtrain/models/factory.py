"""Build the model a config names: the reference GPT by size, or a randomly initialised
Hugging Face causal LM from its model type (nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridtrain.models.gpt import build_gpt, gpt_config, gpt_param_count


def build_model(name: str, overrides: dict[str, Any], vocab_size: int, seq_len: int, seed: int) -> nn.Module:
    """Build ``gpt-<size>`` or ``hf:<model_type>`` with ``overrides``, sized for the data.

    Raises:
        ValueError: unknown name or override (one line naming it).
        ImportError: an ``hf:`` model without the ``hf`` extra installed.
    """
    check_data_keys(overrides, seq_len)
    torch.manual_seed(seed)
    if name.startswith("gpt-"):
        settings = {"vocab_size": vocab_size, "seq_len": seq_len, **overrides}
        return build_gpt(name, **settings)
    if name.startswith("hf:"):
        return _build_hf(name.removeprefix("hf:"), overrides, vocab_size, seq_len)
    raise ValueError(f"model.name = {name!r} is unknown; allowed: gpt-<size> (e.g. gpt-tiny) or "
                     "hf:<model_type> (e.g. hf:gpt2, hf:llama)")


def parameter_count(name: str, overrides: dict[str, Any], vocab_size: int, seq_len: int) -> int:
    """Parameters :func:`build_model` would create, without allocating them: computed for
    the reference GPT, counted on the meta device for a Hugging Face model.

    Raises:
        ValueError / ImportError: as :func:`build_model`.
    """
    check_data_keys(overrides, seq_len)
    if name.startswith("gpt-"):
        return gpt_param_count(gpt_config(name, **{"vocab_size": vocab_size, "seq_len": seq_len, **overrides}))
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(name, overrides, vocab_size, seq_len, 0).parameters())


def check_data_keys(overrides: dict[str, Any], seq_len: int) -> None:
    """Refuse overrides that contradict what the data fixes: the window (``data.seq_len``)
    must fit the model's positions. ``vocab_size`` comes from the data too (its largest
    token + 1, at least 256); an override may only raise it (checked against the tokens).

    Raises:
        ValueError: one line naming the key, its value and the data's.
    """
    for key in ("seq_len", "n_positions", "max_position_embeddings"):
        value = overrides.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < seq_len:
            raise ValueError(f"model.overrides.{key} = {value} is shorter than data.seq_len = {seq_len}: the data "
                             f"fixes the window; leave {key} out (it follows data.seq_len) or set data.seq_len")


def _build_hf(model_type: str, overrides: dict[str, Any], vocab_size: int, seq_len: int) -> nn.Module:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ImportError("model.name 'hf:…' needs transformers: pip install 'hybridtrain[hf]'") from None
    try:
        config = AutoConfig.for_model(model_type)
    except ValueError:
        raise ValueError(f"model.name = 'hf:{model_type}' is not a Hugging Face model type") from None
    settings: dict[str, Any] = {"vocab_size": vocab_size}
    for key in ("n_positions", "max_position_embeddings"):
        if hasattr(config, key):
            settings[key] = max(seq_len, getattr(config, key))
    settings.update(overrides)
    unknown = [k for k in settings if not hasattr(config, k)]
    if unknown:
        raise ValueError(f"model.overrides {unknown} are not fields of the {model_type} config")
    for key, value in settings.items():
        setattr(config, key, value)
    try:
        model: nn.Module = AutoModelForCausalLM.from_config(config)
    except ValueError:
        raise ValueError(f"model.name = 'hf:{model_type}' has no causal language-model class in transformers; "
                         "the CLI trains causal LMs on token windows, so train encoder–decoder models such as "
                         "T5 through the Python API (hybridtrain.initialize)") from None
    return model
