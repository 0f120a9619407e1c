"""Host bytes per parameter, counted from what optimizer offload and layer streaming
allocated (:mod:`hybridtrain.runtime.offload.host_bytes`): 12 per offloaded AdamW parameter
(fp32 master, two fp32 moments) when no gradient waits in host memory, 16 when one does,
plus a bounded staging pool; streamed half-width weights add their 2-byte images."""

from __future__ import annotations

from typing import Any

import pytest

import hybridtrain as ht
from hybridtrain.runtime.offload.host_bytes import HostBytes
from hybridtrain.runtime.offload.layout import POOLED_BUFFERS
from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from hybridtrain.runtime.streaming.streamer import LayerStreamer
from tests.equivalence import MODES, engine_config, gpt_case

CASE = gpt_case()
OFFLOAD = {"stage": 1, "reduce_bucket_size": 2000, "offload_optimizer": {"device": "cpu"}}


def _trained(steps: int = 2, **config: Any) -> ht.Engine:
    engine = ht.initialize(CASE.build(), engine_config(MODES["plain"], **config), loss_fn=CASE.loss_fn)
    for batch in CASE.batches(steps):
        engine.train_batch(batch)
    engine.wait_for_updates()
    return engine


def _offload_bytes(engine: ht.Engine) -> tuple[HostBytes, OffloadOptimizer]:
    optimizer = engine.optimizer
    assert isinstance(optimizer, OffloadOptimizer)
    return optimizer.host_bytes(), optimizer


def _stream_bytes(engine: ht.Engine) -> tuple[HostBytes, OffloadOptimizer]:
    streamer = engine.options.observers[0]
    assert isinstance(streamer, LayerStreamer)
    return streamer.host_bytes(), streamer.optimizer


def _assert_adam_layout(counted: HostBytes, optimizer: OffloadOptimizer, waiting: int) -> None:
    """fp32 masters (4 B), two fp32 moments (8 B) and one fp32 step counter per tensor;
    ``waiting`` bytes per parameter of host gradient buffers; staging within the pool."""
    numel = optimizer.host_numel
    tensors = sum(len(b.masters) for b in optimizer.buckets)
    assert counted.params == numel == sum(p.numel() for p in CASE.build().parameters())
    assert counted.masters == 4 * numel
    assert counted.optimizer_state == 8 * numel + 4 * tensors
    assert counted.waiting_grads == waiting * numel
    largest = max(b.flat_master.nbytes for b in optimizer.buckets)
    assert counted.staging <= POOLED_BUFFERS * largest
    assert counted.staging > 0 or waiting  # gradients that do not wait pass through the pool


@pytest.mark.parametrize("config, waiting", [
    ({"zero_optimization": OFFLOAD}, 0),  # eager: each bucket stepped as it lands
    ({"zero_optimization": OFFLOAD, "gradient_clipping": 0.05}, 4),  # deferred: gradients wait on the host
    ({"zero_optimization": OFFLOAD, "gradient_accumulation_steps": 2}, 4),  # summed on the host
    ({"layer_streaming": {"enabled": True}}, 0),
    ({"layer_streaming": {"enabled": True}, "gradient_clipping": 0.05}, 4),
    ({"layer_streaming": {"enabled": True, "layer_major": True}, "gradient_accumulation_steps": 2}, 0),
], ids=["offload", "offload_clip", "offload_accum2", "stream", "stream_clip", "stream_layer_major_accum2"])
def test_host_bytes_per_parameter_are_counted_from_the_allocations(config: dict[str, Any], waiting: int) -> None:
    engine = _trained(**config)
    counted, optimizer = (_stream_bytes if "layer_streaming" in config else _offload_bytes)(engine)
    _assert_adam_layout(counted, optimizer, waiting)
    assert counted.images == 0
    tensors = sum(len(b.masters) for b in optimizer.buckets)
    assert counted.persistent == (12 + waiting) * counted.params + 4 * tensors


def test_streamed_half_width_weights_add_their_two_byte_images() -> None:
    engine = _trained(steps=2, layer_streaming={"enabled": True}, bf16={"enabled": True})
    counted, optimizer = _stream_bytes(engine)
    _assert_adam_layout(counted, optimizer, 0)
    streamer = engine.options.observers[0]
    assert isinstance(streamer, LayerStreamer)
    half = sum(p.numel() for block in streamer.blocks for p, half in
               zip(block.bucket.params, streamer.half_width(block.index), strict=True) if half)
    full = sum(p.numel() for block in streamer.blocks for p, half in
               zip(block.bucket.params, streamer.half_width(block.index), strict=True) if not half)
    assert half > 0
    # An image holds every parameter of its block: the half ones at 2 bytes, the rest at 4.
    assert counted.images == 2 * half + 4 * full
