"""``layer_streaming.keep_blocks_for_backward`` under micro-batch-major streaming: within each
micro-batch the last K blocks stay on the device from their forward to their backward. The
same bits as uploading them again (bf16 with clipping that clips, fp16 with a step that
overflows, every ``boundary_activations`` mode, Hugging Face families), exactly the bytes up
the formula says, the kept blocks counted by a ``device_memory_limit``, nothing kept by a
forward without gradients. The plain-loop equivalence is in the shared suite
(``stream_keep2_bf16_accum2_clip``)."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import pytest
import torch
from torch import nn

import hybridtrain as ht
from hybridtrain.config import load_config
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from hybridtrain.plan.build import build
from hybridtrain.plan.resolve import resolve
from hybridtrain.recovery.oom import MemoryGuard
from hybridtrain.runtime.memory_limit import DeviceMemoryLimitError, tensors_alive
from tests.runtime.streamed_gpt import gpt_batches, streamer_of

CFG = GPTConfig(n_layer=5, n_head=2, d_model=32, seq_len=16, vocab_size=64)
N = CFG.n_layer
ACCUMULATION = 2
CLIP = 0.05
STEPS = 2
PRECISIONS: dict[str, dict[str, Any]] = {
    "bf16": {"bf16": {"enabled": True}},
    # Scale 2**20 with hysteresis 1: the first step overflows and is skipped.
    "fp16": {"fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 20}},
}


def _config(keep: int, precision: str, accumulation: int = ACCUMULATION, **streaming: object) -> dict[str, Any]:
    return {"device": "cpu", "gradient_accumulation_steps": accumulation, "gradient_clipping": CLIP,
            **PRECISIONS[precision],
            "layer_streaming": {"enabled": True, "keep_blocks_for_backward": keep, **streaming}}


def _batches(count: int, cfg: GPTConfig = CFG, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return gpt_batches(count, cfg, size)


@dataclasses.dataclass
class _Run:
    losses: list[float]
    state: dict[str, torch.Tensor]
    sent: list[int]
    """``weights_up`` bytes of each step."""
    uploads: list[int]
    peaks: list[int]
    norms: list[float]
    skipped: int
    images: list[int]
    """Each block's bytes on the device (its half-width layout after the first step)."""


def _train(model: nn.Module, config: dict[str, Any], batches: list[Any], loss_fn: Any = causal_lm_loss) -> _Run:
    engine = ht.initialize(model, config, loss_fn=loss_fn)
    residency = streamer_of(engine).residency
    run = _Run([], {}, [], [], [], [], 0, [])
    for batch in batches:
        residency.reset_peak()
        run.losses.append(engine.train_batch(batch))
        run.sent.append(engine.last_timings.transfer_bytes["weights_up"])
        run.uploads.append(residency.uploads)
        run.peaks.append(residency.peak)
        if engine.last_grad_norm is not None:
            run.norms.append(float(engine.last_grad_norm))
        assert residency.on_device == set()  # landed blocks freed, kept ones too
    run.state, run.skipped = engine.model_state_dict(), engine.skipped_steps
    run.images = [block.nbytes for block in streamer_of(engine).blocks]
    return run


def _gpt_run(keep: int, precision: str, steps: int = STEPS, **streaming: object) -> _Run:
    torch.manual_seed(0)
    return _train(GPT(CFG), _config(keep, precision, **streaming), _batches(steps))


def _assert_same_bits(run: _Run, reference: _Run) -> None:
    assert run.losses == reference.losses
    assert run.state.keys() == reference.state.keys()
    for name, value in reference.state.items():
        assert torch.equal(run.state[name], value), name


def _linear_numel(block: nn.Module) -> int:
    """Parameters of the block's Linears: those that cross in half from the second step."""
    return sum(p.numel() for m in block.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_kept_blocks_train_to_the_same_bits_with_fewer_uploads(precision: str) -> None:
    """K = 0, 2 and all: equal losses and weights to the bit, with clipping that clips
    (bf16) or a step that overflows and is skipped (fp16); per micro-batch forward uploads
    every block, backward the ones not kept (the last one never); on the device at once
    the computing block and one prefetched, or the kept ones at the turn."""
    runs = {keep: _gpt_run(keep, precision) for keep in (0, 2, -1)}
    if precision == "bf16":
        assert runs[0].skipped == 0 and max(runs[0].norms) > CLIP
    else:
        assert runs[0].skipped >= 1
    for keep, run in runs.items():
        _assert_same_bits(run, runs[0])
        kept = N if keep == -1 else max(1, keep)
        assert run.uploads == [ACCUMULATION * (2 * N - kept)] * STEPS, keep
        assert run.peaks == [max(2, kept)] * STEPS, keep
    if precision == "bf16":
        _assert_bytes_up({keep: run.sent for keep, run in runs.items()})


def _assert_bytes_up(sent: dict[int, list[int]]) -> None:
    """``weights_up`` per step: k micro-batches × (2N - kept) block images + the resident
    weights once; an image is 4 bytes per parameter in the first step (moved in fp32 while
    it watches the reads), then 2 per Linear parameter. With every block kept a half-width
    parameter crosses at 2 bytes per micro-batch: 2k per step (4 here), 2k(2N-1)/N without."""
    model = GPT(CFG)
    block_params = sum(p.numel() for p in model.blocks[0].parameters())
    linear = _linear_numel(model.blocks[0])
    fp32_image, image = 4 * block_params, 2 * linear + 4 * (block_params - linear)
    resident = 4 * (sum(p.numel() for p in model.parameters()) - N * block_params)
    per_half_param = {}
    for keep, bytes_up in sent.items():
        uploads = ACCUMULATION * (2 * N - (N if keep == -1 else max(1, keep)))
        assert bytes_up == [uploads * fp32_image + resident] + [uploads * image + resident] * (STEPS - 1), keep
        per_half_param[keep] = uploads * 2 * linear / (N * linear)
    assert per_half_param[-1] == 2.0 * ACCUMULATION
    assert per_half_param[0] == 2.0 * ACCUMULATION * (2 * N - 1) / N


@pytest.mark.parametrize("boundary", ["host", "device"])
def test_every_boundary_activations_mode_finds_the_kept_blocks(boundary: str) -> None:
    """``recompute`` (the default) is above; ``host`` swaps the blocks' inputs and
    recomputes, ``device`` keeps every activation: the same bits, fewer uploads."""
    none, every = (_gpt_run(keep, "bf16", boundary_activations=boundary) for keep in (0, -1))
    _assert_same_bits(every, none)
    assert every.uploads == [ACCUMULATION * N] * STEPS and none.uploads == [ACCUMULATION * (2 * N - 1)] * STEPS


def test_a_forward_without_gradients_keeps_nothing() -> None:
    """Evaluation (and any no-grad forward) frees every block after its forward, the last
    too: each block goes up once per micro-batch, with the next one prefetched."""
    torch.manual_seed(0)
    engine = ht.initialize(GPT(CFG), _config(-1, "bf16"), loss_fn=causal_lm_loss)
    first, second = _batches(2)
    engine.train_batch(first)
    residency = streamer_of(engine).residency
    residency.keep_events = True
    one_forward = [("load", 0)] + [e for i in range(N) for e in ([("load", i + 1)] if i + 1 < N else [])
                                   + [("release", i)]]
    engine.eval_batch(second)
    assert residency.events == one_forward * (len(residency.events) // len(one_forward))
    residency.events.clear()
    with torch.no_grad():
        engine(second[0])
    assert residency.events == one_forward and residency.on_device == set()


LIMITED = GPTConfig(n_layer=16, n_head=2, d_model=32, seq_len=8, vocab_size=64)
"""Deep enough that N-2 kept images (~0.36 MB) dwarf the timing-dependent host buffers a
CPU device counts too (the landings' pooled fp32 gradient buffers, ~50 kB each here)."""


def _guarded_peaks(keep: int, limit: int) -> list[int]:
    """Each step's peak live bytes under a CPU ``device_memory_limit`` of ``limit``."""
    config = load_config({**_config(keep, "bf16", accumulation=1), "train_batch_size": 2,
                          "device_memory_limit": limit})
    batches = _batches(2, LIMITED, size=2)
    gc.collect()
    others = tensors_alive()  # earlier runs' tensors are not this run's device memory
    torch.manual_seed(0)
    model = GPT(LIMITED)
    engine = build(resolve(config, model, world_size=1), model, causal_lm_loss)
    peaks = []
    with MemoryGuard(engine, config, untracked=others) as guard:
        for batch in batches:
            guard.train_batch(batch)
            assert guard.live is not None
            peaks.append(guard.live.peak_bytes)
    return peaks


def test_the_memory_limit_counts_the_kept_blocks() -> None:
    """Every block kept holds N-2 more weight images at the turn from forward to backward: a
    limit between the two peaks lets K=0 train and stops K=-1 with the device OOM (in its
    second step)."""
    unlimited = 10**12
    # The second step's: the optimizer state exists (the peak counts from the start).
    none_kept, all_kept = _guarded_peaks(0, unlimited)[1], _guarded_peaks(-1, unlimited)[1]
    assert none_kept < all_kept
    limit = (none_kept + all_kept) // 2
    assert max(_guarded_peaks(0, limit)) <= limit
    with pytest.raises(DeviceMemoryLimitError, match=f"against the limit of {limit} bytes"):
        _guarded_peaks(-1, limit)


HF_FAMILIES = ["opt", "qwen2", "gpt_neox", "phi"]


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hugging_face_families_keep_blocks_to_the_same_bits(family: str) -> None:
    """Tiny random configs (3 layers, none written by us): K=2 of 3 (the first block is
    prefetched from the second one's backward) equals K=0 to the bit, and sends exactly
    one block image per micro-batch fewer (the middle block's, half-width after step 1)."""
    pytest.importorskip("transformers")
    from tests.models.hf_families import FAMILIES, available, family_case

    found = FAMILIES[family]
    if (why := available(found)) is not None:
        pytest.skip(why)
    case = family_case(dataclasses.replace(found, config={**found.config, "num_hidden_layers": 3}))
    runs = {}
    for keep in (0, 2):
        torch.manual_seed(0)
        runs[keep] = _train(case.build(), _config(keep, "bf16"), case.batches(2), loss_fn=None)
    _assert_same_bits(runs[2], runs[0])
    assert runs[2].uploads == [ACCUMULATION * (2 * 3 - 2)] * 2 and runs[0].uploads == [ACCUMULATION * 5] * 2
    # Step 1 moves fp32 (it watches how the weights are read), step 2 the half-width layout.
    fp32_block, image = (runs[0].sent[s] - runs[2].sent[s] for s in (0, 1))
    assert image == ACCUMULATION * runs[2].images[1] and 0 < image < fp32_block
