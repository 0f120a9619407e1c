"""Layer streaming: residency bound, masters between steps, resident blocks, refusals,
resume; on CUDA depth-independent device memory. Equivalence is in the shared suite
(``stream*`` modes)."""

from __future__ import annotations

import gc

import pytest
import torch

import hybridtrain as ht
from hybridtrain.config import ConfigError
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from hybridtrain.runtime.streaming.streamer import LayerStreamer
from tests.equivalence import assert_resume_exact

CFG = GPTConfig(n_layer=6, n_head=2, d_model=32, seq_len=16, vocab_size=64)


def _engine(cfg: GPTConfig = CFG, **streaming: object) -> ht.Engine:
    torch.manual_seed(0)
    config = {"device": "cpu", "layer_streaming": {"enabled": True, **streaming}}
    return ht.initialize(GPT(cfg), config, loss_fn=causal_lm_loss)


def _batch(cfg: GPTConfig = CFG, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    # Drawn on the CPU whatever the device: CUDA's generator draws other numbers from one seed.
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1)).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _streamer(engine: ht.Engine) -> LayerStreamer:
    streamer = engine.options.observers[0]
    assert isinstance(streamer, LayerStreamer)
    return streamer


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("boundary", ["recompute", "device"])
def test_at_most_prefetch_plus_one_blocks_on_the_device(prefetch: int, boundary: str) -> None:
    engine = _engine(prefetch_blocks=prefetch, boundary_activations=boundary)
    streamer = _streamer(engine)
    streamer.residency.keep_events = True
    for _ in range(2):
        engine.train_batch(_batch())
    assert streamer.residency.peak == prefetch + 1
    # Each block is uploaded once for forward and once for backward (the last block stays).
    assert streamer.residency.uploads == 2 * (2 * CFG.n_layer - 1)
    assert streamer.residency.on_device == set()


def test_between_steps_parameters_are_the_host_masters() -> None:
    engine = _engine()
    engine.train_batch(_batch())
    streamer = _streamer(engine)
    for block in streamer.blocks:
        for p, view in zip(block.bucket.params, block.host_views, strict=True):
            assert p.data_ptr() == view.data_ptr()
    # The state dict reads the masters: it is what was trained and it loads back in place.
    state = engine.model_state_dict()
    engine.module.load_state_dict(state)
    assert engine.eval_batch(_batch()) > 0


def test_resident_blocks_stay_and_are_not_streamed() -> None:
    engine = _engine(resident=["blocks.0", "blocks.5"])
    assert len(_streamer(engine).blocks) == CFG.n_layer - 2
    engine.train_batch(_batch())


def test_resume_is_exact(tmp_path) -> None:
    assert_resume_exact(_engine, [_batch() for _ in range(4)], tmp_path / "ckpt")


class _Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.head = torch.nn.Linear(4, 4)
        self.head.weight = self.blocks[1].weight


@pytest.mark.parametrize(("model", "streaming", "needle"), [
    (_Shared(), {}, r"parameter head\.weight is shared with blocks\.1\.weight"),
    (GPT(CFG), {"resident": ["blocks.9"]}, "not blocks"),
    (torch.nn.Module(), {}, "model.blocks"),
])
def test_bad_settings_are_refused(model: torch.nn.Module, streaming: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ht.initialize(model, {"device": "cpu", "layer_streaming": {"enabled": True, **streaming}})


def _peak_bytes(n_layer: int, precision: str) -> int:
    gc.collect()  # the previous engine's device memory must not count
    torch.cuda.empty_cache()
    cfg = GPTConfig(n_layer=n_layer, n_head=8, d_model=1024, seq_len=256, vocab_size=512)
    torch.manual_seed(0)
    config = {"device": "cuda", "layer_streaming": {"enabled": True, "boundary_activations": "host",
                                                    "pin_memory": True}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine = ht.initialize(GPT(cfg), config, loss_fn=causal_lm_loss)
    engine.train_batch(_batch(cfg))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine.train_batch(_batch(cfg))
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_device_memory_is_independent_of_depth(precision: str) -> None:
    # bf16 also checks that no half-precision weight copy outlives its block (autocast's
    # weight cache would keep one per block for the whole forward).
    shallow, deep = _peak_bytes(12, precision), _peak_bytes(48, precision)
    assert deep <= 1.10 * shallow, (shallow, deep)


@pytest.mark.cuda
def test_cuda_result_equals_cpu_result() -> None:
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        engine = ht.initialize(GPT(CFG), {"device": device, "gradient_accumulation_steps": 2,
                                          "layer_streaming": {"enabled": True, "boundary_activations": "host"}},
                               loss_fn=causal_lm_loss)
        torch.manual_seed(1)
        losses = [engine.train_batch(_batch(CFG, device)) for _ in range(3)]
        results.append((losses, engine.model_state_dict()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-5)
    for k, v in results[0][1].items():
        torch.testing.assert_close(results[1][1][k], v, rtol=1e-4, atol=1e-5)
