"""Live tensor bytes beyond the entering thread's ops: worker threads that join its counters
(layer-major's micro-batch forwards) and storages resized in place (layer streaming's device
buffers), each counted and limited like any op's output."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable

import pytest
import torch

import hybridtrain as ht
import hybridtrain.runtime.streaming.layer_major as layer_major
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from hybridtrain.runtime.memory_limit import (
    DeviceMemoryLimitError,
    LiveTensorBytes,
    storage_resized,
    tensors_alive,
)
from hybridtrain.runtime.streaming.streamer import LayerStreamer
from hybridtrain.runtime.thread_counters import counters_here, counting_with


def _others() -> list[torch.Tensor]:
    gc.collect()
    return tensors_alive()


def _in_thread(work: Callable[[], None]) -> BaseException | None:
    """Run ``work`` in a new thread; its exception, if any."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return raised[0] if raised else None


def test_a_worker_that_joins_is_counted_and_limited_one_that_does_not_is_not() -> None:
    kept: list[torch.Tensor] = []
    with LiveTensorBytes(limit_bytes=1000, ignore=_others()) as live:
        counters = counters_here()
        assert counters == (live,)
        assert _in_thread(lambda: kept.append(torch.ones(100))) is None  # alone: not seen
        assert live.current_bytes == 0

        def joined(numel: int) -> Callable[[], None]:
            def work() -> None:
                with counting_with(counters):
                    kept.append(torch.ones(numel))
            return work

        assert _in_thread(joined(200)) is None
        assert live.current_bytes == 800
        error = _in_thread(joined(100))  # 400 more bytes would make 1200
        assert isinstance(error, DeviceMemoryLimitError) and error.needed_bytes == 1200
        assert live.current_bytes == 800 and counters_here() == (live,)
        kept.clear()
        assert live.current_bytes == 0  # freed where the worker made it, counted here
    assert counters_here() == ()


def test_an_in_place_resize_told_to_the_counters_counts_and_is_limited() -> None:
    with LiveTensorBytes(limit_bytes=600, ignore=_others()) as live:
        buffer = torch.empty(100)
        assert live.current_bytes == 400
        storage = buffer.untyped_storage()
        storage.resize_(0)
        storage_resized(buffer, "a test buffer")
        assert live.current_bytes == 0
        storage.resize_(400)
        storage_resized(buffer, "a test buffer")
        assert live.current_bytes == 400
        storage.resize_(800)
        with pytest.raises(DeviceMemoryLimitError, match="^a test buffer on cpu needs 400 B more"):
            storage_resized(buffer, "a test buffer")
        assert live.current_bytes == 400  # as before the refused growth
        storage.resize_(0)
        storage_resized(buffer, "a test buffer")
        assert live.current_bytes == 0


CFG = GPTConfig(n_layer=3, n_head=2, d_model=32, seq_len=32, vocab_size=64)


def _layer_major_peak(engine: ht.Engine, batch: tuple[torch.Tensor, torch.Tensor], limit: int | None) -> int:
    gc.collect()
    with LiveTensorBytes("cpu", limit) as live:
        engine.train_batch(batch)
    return live.peak_bytes


def test_a_layer_major_step_past_the_limit_only_in_its_worker_threads_is_refused() -> None:
    """Layer-major's forwards run on worker threads: a limit met by what the calling thread
    alone allocates (backward, the loss, the host step) used to pass; the workers' forward
    activations now count, and the step is refused with the numbers, nothing left on the
    device, the engine usable again."""
    torch.manual_seed(0)
    engine = ht.initialize(GPT(CFG), {"device": "cpu", "gradient_accumulation_steps": 4, "layer_streaming": {
        "enabled": True, "layer_major": True, "boundary_activations": "device"}}, loss_fn=causal_lm_loss)
    tokens = torch.randint(0, CFG.vocab_size, (16, CFG.seq_len + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    engine.train_batch(batch)
    # boundary_activations "device": each block keeps what its forward saved for 4
    # micro-batches of (4, 32, 32) fp32 until its backward, at least its output.
    kept_by_workers = CFG.n_layer * 4 * 4 * CFG.seq_len * CFG.d_model * 4
    without_workers = pytest.MonkeyPatch.context
    with without_workers() as patch:  # the workers as before: counted by nobody
        patch.setattr(layer_major, "counting_with", lambda _counters: contextlib.nullcontext())
        calling_thread_only = _layer_major_peak(engine, batch, None)
    everything = _layer_major_peak(engine, batch, None)
    assert everything - calling_thread_only >= kept_by_workers
    # Half the workers' bytes above the calling thread's peak: the host optimizer's thread
    # drops a block's gradients at moments that move a peak by up to one block's bytes
    # (50 KiB here) from run to run.
    limit = calling_thread_only + kept_by_workers // 2
    with without_workers() as patch:
        patch.setattr(layer_major, "counting_with", lambda _counters: contextlib.nullcontext())
        _layer_major_peak(engine, batch, limit)
    with pytest.raises(DeviceMemoryLimitError) as caught:
        _layer_major_peak(engine, batch, limit)
    assert caught.value.needed_bytes > limit == caught.value.limit_bytes
    assert "\n" not in str(caught.value)
    del caught
    streamer = engine.options.observers[0]
    assert isinstance(streamer, LayerStreamer) and streamer.residency.on_device == set()
    assert engine.train_batch(batch) > 0



def _streamed_engine() -> ht.Engine:
    torch.manual_seed(0)
    return ht.initialize(GPT(CFG), {"device": "cpu", "gradient_accumulation_steps": 2, "layer_streaming": {
        "enabled": True, "layer_major": True}}, loss_fn=causal_lm_loss)


def test_a_streamed_blocks_upload_past_the_limit_is_refused_and_leaves_it_off_the_device() -> None:
    """The streamer resizes a block's device buffer in place (no op sees that) and reports
    it: an upload one byte past the limit is refused, naming the block, before anything is
    copied, and the block is not left marked as loaded (the next step would compute with an
    empty buffer): the next step trains as if the refused one had never been tried."""
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    reference = _streamed_engine()
    expected = [reference.train_batch(batch) for _ in range(3)]
    engine = _streamed_engine()
    streamer = engine.options.observers[0]
    assert isinstance(streamer, LayerStreamer)
    residency = streamer.residency
    losses = [engine.train_batch(batch)]
    live_at_upload: list[int] = []
    load = residency.load
    gc.collect()
    with LiveTensorBytes("cpu") as live, pytest.MonkeyPatch.context() as patch:
        start = live.current_bytes
        patch.setattr(residency, "load", lambda i: (live_at_upload.append(live.current_bytes - start), load(i))[1])
        losses.append(engine.train_batch(batch))  # a rehearsal: the bytes live as block 0 goes up
    block = streamer.blocks[0].nbytes
    gc.collect()
    with LiveTensorBytes("cpu") as live:
        live.limit_bytes = live.current_bytes + live_at_upload[0] + block - 1
        with pytest.raises(DeviceMemoryLimitError, match="^the upload of streamed block 0 on cpu needs") as caught:
            engine.train_batch(batch)
    assert caught.value.needed_bytes == caught.value.limit_bytes + 1
    del caught
    assert residency.on_device == set() and not any(b.loaded for b in streamer.blocks)
    assert all(b.device_flat.untyped_storage().nbytes() == 0 for b in streamer.blocks)
    losses.append(engine.train_batch(batch))
    assert losses == expected
