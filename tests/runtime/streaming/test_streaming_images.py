"""Half-width images cast at every upload into pooled host buffers
(``layer_streaming.half_images: per_upload``, :class:`~hybridtrain.runtime.streaming.streamed_block.ImagePool`):
the plain loop's training and the bits of kept images, with no image held per block —
only the pool, ``prefetch_blocks + 2`` buffers of the largest image."""

from __future__ import annotations

import pytest
import torch

import hybridtrain as ht
from hybridtrain.runtime.streaming.streamer import LayerStreamer
from tests.equivalence import (
    GRADS_ON_DEVICE_MODES,
    HALF_WIDTH_MODES,
    MODES,
    PER_UPLOAD_IMAGE_MODES,
    SEED,
    STEPS,
    assert_same_training,
    engine_config,
    engine_run,
    model_cases,
    plain_run,
)

CASES = model_cases()


@pytest.mark.parametrize("mode", list(PER_UPLOAD_IMAGE_MODES))
@pytest.mark.parametrize("case", ["gpt_tied", "hf_llama"])
def test_images_cast_per_upload_train_as_the_plain_loop_and_hold_no_image(case: str, mode: str) -> None:
    m, c = PER_UPLOAD_IMAGE_MODES[mode], CASES[case]
    torch.manual_seed(SEED)
    engine = ht.initialize(c.build(), engine_config(m), loss_fn=c.loss_fn)
    engine.overlap_updates = bool(m.extra.get("overlap_updates"))
    torch.manual_seed(SEED + 1)
    losses = [engine.train_batch(batch) for batch in c.batches(STEPS)]
    assert_same_training(plain_run(c, m), (losses, engine.model_state_dict()), rtol=m.rtol, atol=m.atol)
    streamer = engine.options.observers[0]
    assert isinstance(streamer, LayerStreamer)
    assert any(block.pool is not None for block in streamer.blocks)  # some weights crossed in half
    counted = streamer.host_bytes()
    assert counted.images == 0
    largest = max(block.image_nbytes for block in streamer.blocks)
    pool = (streamer.prefetch_blocks + 2) * largest
    optimizer = streamer.optimizer
    bucket = max(b.flat_master.nbytes for b in optimizer.buckets)
    assert counted.staging <= pool + 3 * bucket + 3 * bucket // 2  # + gradient pool, half uploads' staging


@pytest.mark.parametrize("mode", ["stream_bf16_accum2_clip_images_per_upload",
                                  "stream_layer_major_fp16_overflow_accum2_clip_images_per_upload"])
def test_images_cast_per_upload_give_the_bits_of_kept_images(mode: str) -> None:
    kept = {**MODES, **HALF_WIDTH_MODES, **GRADS_ON_DEVICE_MODES}[mode.removesuffix("_images_per_upload")]
    case = CASES["gpt_tied"]
    assert_same_training(engine_run(case, kept), engine_run(case, PER_UPLOAD_IMAGE_MODES[mode]), 0, 0)
