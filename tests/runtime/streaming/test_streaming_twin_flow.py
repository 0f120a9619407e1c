"""Twin-Flow under layer streaming (``offload_optimizer.ratio`` below 1): the blocks holding
the last parameters stay resident with their update and state on the device, the rest stream
and update on the host — equal to the plain loop (which steps the same last parameters on
the device kernel), with the host holding 12 bytes per host-updated parameter only."""

from __future__ import annotations

import pytest
import torch

import hybridtrain as ht
from hybridtrain.runtime.activations.recompute import is_checkpointed
from hybridtrain.runtime.offload.layout import device_kept
from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from hybridtrain.runtime.streaming.streamer import LayerStreamer
from tests.equivalence import (
    SEED,
    STEPS,
    TWIN_FLOW_STREAMING_MODES,
    assert_resume_exact,
    assert_same_training,
    engine_config,
    model_cases,
    plain_run,
    train_recording_norms,
)

CASES = model_cases()


@pytest.mark.parametrize("mode", list(TWIN_FLOW_STREAMING_MODES))
@pytest.mark.parametrize("case", ["gpt_tied", "sequential", "hf_llama"])
def test_twin_flow_under_streaming_trains_as_the_plain_loop(case: str, mode: str) -> None:
    m, c = TWIN_FLOW_STREAMING_MODES[mode], CASES[case]
    torch.manual_seed(SEED)
    model = c.build()
    engine = ht.initialize(model, engine_config(m), loss_fn=c.loss_fn)
    engine.overlap_updates = bool(m.extra.get("overlap_updates"))
    losses, norms = train_recording_norms(engine, c)
    assert_same_training(plain_run(c, m), (losses, engine.model_state_dict()), rtol=m.rtol, atol=m.atol)
    if m.clip and engine.skipped_steps < STEPS:
        assert max(float(n) for n in norms if n is not None) > m.clip
    streamer = engine.options.observers[0]
    optimizer = engine.optimizer
    assert isinstance(streamer, LayerStreamer) and isinstance(optimizer, OffloadOptimizer)
    # Some blocks stream, the last parameters (1 - ratio of the elements; the first with
    # device_share: first) are updated on the device, their blocks resident after (before)
    # every streamed block.
    params = list(model.parameters())
    offload = m.config["zero_optimization"]["offload_optimizer"]
    ratio, first = offload["ratio"], offload.get("device_share") == "first"
    kept = device_kept(params, ratio, set(), first)
    total = sum(p.numel() for p in params)
    assert streamer.blocks and kept
    assert sum(p.numel() for p in params if id(p) in kept) >= (1 - ratio) * total
    assert optimizer.host_numel == total - sum(p.numel() for p in params if id(p) in kept)
    assert not any(id(p) in kept for block in streamer.blocks for p in block.bucket.params)
    position = {id(p): i for i, p in enumerate(params)}
    streamed_at = [position[id(p)] for block in streamer.blocks for p in block.bucket.params]
    if first:
        assert max(position[i] for i in kept) < min(streamed_at)
    else:
        assert min(position[i] for i in kept) > max(streamed_at)
    # activation_checkpointing under streaming wraps the blocks that stay on the device.
    streamed_ids = {id(block.module) for block in streamer.blocks}
    wrapped = [module for module in model.modules() if is_checkpointed(module) and id(module) not in streamed_ids]
    assert bool(wrapped) == ("activation_checkpointing" in m.config)
    counted = streamer.host_bytes()
    tensors = sum(len(b.masters) for b in optimizer.buckets)
    waiting = 4 if optimizer.defer and not optimizer.grads_wait_on_device else 0  # a deferred step's gradients
    assert counted.params == optimizer.host_numel
    assert counted.masters + counted.optimizer_state + counted.waiting_grads == \
        (12 + waiting) * counted.params + 4 * tensors


@pytest.mark.parametrize("name", [
    "stream_twinflow_bf16_accum2_clip_grads_on_device", "stream_twinflow_first_fp16_overflow_clip_held_later",
    "stream_layer_major_twinflow_fp16_overflow_accum2_clip_grads_on_device_resident_checkpointed"])
def test_resume_is_exact_with_twin_flow_under_streaming(tmp_path, name: str) -> None:
    case, mode = CASES["gpt_tied"], TWIN_FLOW_STREAMING_MODES[name]

    def make() -> ht.Engine:
        torch.manual_seed(SEED)
        return ht.initialize(case.build(), engine_config(mode), loss_fn=case.loss_fn)

    assert_resume_exact(make, case.batches(STEPS), tmp_path / "ckpt")
