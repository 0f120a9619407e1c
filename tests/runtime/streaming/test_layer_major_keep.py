"""``layer_streaming.keep_blocks_for_backward``: layer-major streaming keeps its last blocks
on the device from their forward to their backward (micro-batch-major order:
``test_streaming_keep.py``). The same bits as uploading them again,
fewer bytes up (2 per half-width parameter per step with every block kept), a device peak
that grows by the kept blocks' bytes, and one-line refusals. The plain-loop equivalence is
in the shared suite (``stream_layer_major_keep*`` modes)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import hybridtrain as ht
from hybridtrain.config import ConfigError
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from hybridtrain.plan.resolve import resolve
from hybridtrain.runtime.memory_limit import LiveTensorBytes
from tests.runtime.streamed_gpt import gpt_batches, streamer_of

CFG = GPTConfig(n_layer=5, n_head=2, d_model=32, seq_len=16, vocab_size=64)
N = CFG.n_layer


def _engine(keep: int, accumulation: int = 2, cfg: GPTConfig = CFG, **extra: object) -> ht.Engine:
    torch.manual_seed(0)
    config = {"device": "cpu", "gradient_accumulation_steps": accumulation, "bf16": {"enabled": True},
              "layer_streaming": {"enabled": True, "layer_major": True, "keep_blocks_for_backward": keep}, **extra}
    return ht.initialize(GPT(cfg), config, loss_fn=causal_lm_loss)


def _batches(count: int, cfg: GPTConfig = CFG, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return gpt_batches(count, cfg, size)


def _linear_numel(block: nn.Module) -> int:
    """Parameters of the block's Linears: those that cross in bf16 from the second step."""
    return sum(p.numel() for m in block.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False))


def _image_bytes(block: nn.Module) -> int:
    """A block's bytes on the device under bf16: 2 per Linear parameter, 4 per other one."""
    linear = _linear_numel(block)
    return 2 * linear + 4 * (sum(p.numel() for p in block.parameters()) - linear)


@pytest.mark.parametrize("keep", [2, -1])
def test_kept_blocks_train_to_the_same_bits_with_fewer_uploads(keep: int) -> None:
    """Clipping that clips and two micro-batches: losses and weights equal to the bit to
    uploading every block again in backward; backward uploads only the blocks not kept."""
    runs = {}
    for k in (0, keep):
        engine = _engine(k, gradient_clipping=0.05)
        residency = streamer_of(engine).residency
        losses, uploads, peaks = [], [], []
        for batch in _batches(3):
            residency.reset_peak()
            losses.append(engine.train_batch(batch))
            uploads.append(residency.uploads)
            peaks.append(residency.peak)
        assert residency.on_device == set()
        runs[k] = (losses, engine.model_state_dict(), uploads, peaks)
    assert runs[keep][0] == runs[0][0]
    for name, value in runs[0][1].items():
        assert torch.equal(runs[keep][1][name], value), name
    kept = N if keep == -1 else keep
    # Forward uploads every block once; backward the ones not kept (the last one never).
    assert runs[0][2] == [2 * N - 1] * 3
    assert runs[keep][2] == [N + N - kept] * 3
    # On the device at once: the computing block and one prefetched (prefetch_blocks: 1),
    # or the kept ones at the turn from forward to backward.
    assert runs[0][3] == [2] * 3
    assert runs[keep][3] == [max(2, kept)] * 3


def test_keeping_every_block_sends_two_bytes_per_half_width_parameter_up() -> None:
    """From the second step (the first moves fp32 while it watches how weights are read),
    with every block kept each weight crosses once per step: 2 bytes per parameter of the
    blocks' Linears, 4 per other block parameter, and the resident parameters' updated fp32
    weights once. Without keeping, backward sends every block but the last again."""
    model = GPT(CFG)
    blocks = list(model.blocks)
    linear = sum(_linear_numel(b) for b in blocks)
    block_params = sum(p.numel() for b in blocks for p in b.parameters())
    resident = 4 * (sum(p.numel() for p in model.parameters()) - block_params)
    image = _image_bytes(blocks[0])
    per_half_param = {}
    for keep in (0, -1):
        engine = _engine(keep)
        sent = []
        for batch in _batches(3):
            engine.train_batch(batch)
            sent.append(engine.last_timings.transfer_bytes["weights_up"])
        uploads = N if keep == -1 else 2 * N - 1
        assert sent[1:] == [uploads * image + resident] * 2
        other_fp32 = uploads * 4 * (block_params - linear) // N
        per_half_param[keep] = (sent[-1] - resident - other_fp32) / linear
    assert per_half_param[-1] == 2.0
    assert per_half_param[0] == 2.0 * (2 * N - 1) / N  # 3.6 here; ~3.9 at 32 blocks


def _step_peak(keep: int, cfg: GPTConfig) -> int:
    engine = _engine(keep, accumulation=1, cfg=cfg)
    first, second, third = _batches(3, cfg, size=2)
    engine.train_batch(first)
    engine.train_batch(second)  # the half-width layout and every host buffer exist now
    gc.collect()
    with LiveTensorBytes("cpu") as live:
        start = live.current_bytes
        engine.train_batch(third)
    return live.peak_bytes - start


def test_the_device_peak_grows_by_the_kept_blocks_bytes() -> None:
    """The step's live bytes (CPU as the device, worker threads and in-place buffer resizes
    counted) peak at the start of backward: with prefetch_blocks 1 two blocks are there
    without keeping, all of them when every one is kept."""
    cfg = GPTConfig(n_layer=6, n_head=2, d_model=64, seq_len=8, vocab_size=64)
    image = _image_bytes(GPT(cfg).blocks[0])
    growth = _step_peak(-1, cfg) - _step_peak(0, cfg)
    assert abs(growth - (cfg.n_layer - 2) * image) <= image // 10, (growth, image)


@pytest.mark.parametrize(("keep", "resident", "kept"), [(0, [], 0), (2, [], 2), (-1, [], N), (-1, ["blocks.4"], N - 1)])
def test_the_plan_carries_how_many_blocks_are_kept(keep: int, resident: list[str], kept: int) -> None:
    plan = resolve({"device": "cpu", "layer_streaming": {"enabled": True, "layer_major": True, "resident": resident,
                                                         "keep_blocks_for_backward": keep}}, GPT(CFG), world_size=1)
    assert plan.stream_keep_blocks == kept
    assert plan.summary().get("kept_for_backward", 0) == kept


@pytest.mark.parametrize(("streaming", "needle"), [
    ({"layer_major": True, "keep_blocks_for_backward": 6},
     r"^layer_streaming.keep_blocks_for_backward = 6 but 5 blocks are streamed; use -1 \(all\) or 0..5$"),
    ({"layer_major": True, "keep_blocks_for_backward": 5, "resident": ["blocks.0"]},
     r"= 5 but 4 blocks are streamed; use -1 \(all\) or 0..4$"),
    ({"enabled": False, "keep_blocks_for_backward": -1},
     r"^layer_streaming.keep_blocks_for_backward = -1 needs layer_streaming.enabled: true \(it keeps streamed "
     r"blocks on the device\); set it to 0$"),
    ({"layer_major": True, "keep_blocks_for_backward": -2}, r"keep_blocks_for_backward.*-2.*-1"),
])
def test_bad_values_are_refused_in_one_line_before_any_work(streaming: dict[str, object], needle: str) -> None:
    model = GPT(CFG)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=needle) as caught:
        ht.initialize(model, {"device": "cpu", "layer_streaming": {"enabled": True, **streaming}},
                      loss_fn=causal_lm_loss)
    assert "\n" not in str(caught.value)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def _cuda_peak(keep: int, cfg: GPTConfig, layer_major: bool) -> int:
    gc.collect()  # the previous engine's device memory must not count
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    engine = ht.initialize(GPT(cfg), {"device": "cuda", "bf16": {"enabled": True}, "layer_streaming": {
        "enabled": True, "layer_major": layer_major, "keep_blocks_for_backward": keep}}, loss_fn=causal_lm_loss)
    first, second, third = (tuple(t.cuda() for t in batch) for batch in _batches(3, cfg, size=2))
    engine.train_batch(first)
    engine.train_batch(second)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine.train_batch(third)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del engine
    return peak


@pytest.mark.cuda
@pytest.mark.parametrize("layer_major", [True, False])
def test_cuda_device_peak_grows_by_the_kept_blocks_bytes(layer_major: bool) -> None:
    """On a GPU the allocator's peak: every block's bf16 image at the turn from forward to
    backward with all kept, two blocks (computing + prefetched) without; in either order
    (one micro-batch: micro-batch-major keeps them for its backward)."""
    cfg = GPTConfig(n_layer=8, n_head=8, d_model=512, seq_len=64, vocab_size=512)
    image = _image_bytes(GPT(cfg).blocks[0])
    growth = _cuda_peak(-1, cfg, layer_major) - _cuda_peak(0, cfg, layer_major)
    expected = (cfg.n_layer - 2) * image
    assert 0.9 * expected <= growth <= 1.1 * expected, (growth, expected)
