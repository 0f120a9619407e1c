"""Helpers shared by the kept-blocks tests of both streaming orders."""

from __future__ import annotations

import torch

import hybridtrain as ht
from hybridtrain.models.gpt import GPTConfig
from hybridtrain.runtime.streaming.streamer import LayerStreamer


def gpt_batches(count: int, cfg: GPTConfig, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` next-token batches of random tokens for the reference GPT ``cfg`` (seeded)."""
    torch.manual_seed(1)
    tokens = [torch.randint(0, cfg.vocab_size, (size, cfg.seq_len + 1)) for _ in range(count)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def streamer_of(engine: ht.Engine) -> LayerStreamer:
    """The engine's layer streamer (its first backward observer)."""
    streamer = engine.options.observers[0]
    assert isinstance(streamer, LayerStreamer)
    return streamer
