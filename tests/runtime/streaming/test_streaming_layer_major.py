"""Layer-major streaming: block-major execution order, one upload per block per step
whatever the accumulation, the same result as micro-batch-major streaming, failures that
neither hang nor leave blocks on the device. Equivalence with the plain loop is in the
shared suite (``stream_layer_major*`` modes)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

import hybridtrain as ht
from hybridtrain.config import ConfigError
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from hybridtrain.runtime.streaming.layer_major import LayerMajorRunner
from hybridtrain.runtime.streaming.streamer import LayerStreamer

CFG = GPTConfig(n_layer=5, n_head=2, d_model=32, seq_len=16, vocab_size=64)


def _engine(accumulation: int = 4, **streaming: object) -> ht.Engine:
    torch.manual_seed(0)
    config = {"device": "cpu", "gradient_accumulation_steps": accumulation,
              "layer_streaming": {"enabled": True, "layer_major": True, **streaming}}
    return ht.initialize(GPT(CFG), config, loss_fn=causal_lm_loss)


def _batch(size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CFG.vocab_size, (size, CFG.seq_len + 1))
    return tokens[:, :-1], tokens[:, 1:]


def _streamer(engine: ht.Engine) -> LayerStreamer:
    streamer = engine.options.observers[0]
    assert isinstance(streamer, LayerStreamer)
    return streamer


def test_each_block_runs_every_micro_batch_before_the_next_block() -> None:
    engine = _engine(accumulation=4)
    order: list[tuple[int, int]] = []
    for i, block in enumerate(engine.module.blocks):
        # The micro-batch is told apart by its first input token's identity (its data pointer).
        block.register_forward_hook(lambda _m, args, _o, i=i: order.append((i, args[0].data_ptr())))
    engine.train_batch(_batch(8))
    assert [i for i, _ in order] == [i for i in range(CFG.n_layer) for _ in range(4)]
    micro_batches = [ptr for i, ptr in order if i == 0]
    assert len(set(micro_batches)) == 4


@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_weights_cross_once_per_step_and_residency_stays_bounded(accumulation: int, prefetch: int) -> None:
    engine = _engine(accumulation=accumulation, prefetch_blocks=prefetch)
    residency = _streamer(engine).residency
    for _ in range(2):
        residency.reset_peak()
        engine.train_batch(_batch())
        # Forward uploads each block once, backward again except the last (kept): 2N - 1,
        # independent of the number of micro-batches.
        assert residency.uploads == 2 * CFG.n_layer - 1
        assert residency.peak == prefetch + 1
        assert residency.on_device == set()
    # Gradients also cross once, summed on the device: no host gradient buffer is kept.
    assert all(bucket.flat_grad is None for bucket in _streamer(engine).optimizer.buckets)


@pytest.mark.parametrize("streaming", [{}, {"boundary_activations": "host", "prefetch_blocks": 2}])
def test_same_result_as_micro_batch_major_streaming(streaming: dict[str, object]) -> None:
    results = []
    for layer_major in (True, False):
        torch.manual_seed(0)
        config = {"device": "cpu", "gradient_accumulation_steps": 4, "fp16": {"enabled": True},
                  "layer_streaming": {"enabled": True, "layer_major": layer_major, **streaming}}
        # Untied: a tied embedding sums the same gradients in another order (every
        # micro-batch's head part, then their embedding parts), equal only up to rounding
        # (the shared suite checks that case against the plain loop).
        engine = ht.initialize(GPT(replace(CFG, tie_embeddings=False)), config, loss_fn=causal_lm_loss)
        torch.manual_seed(1)
        losses = [engine.train_batch(_batch()) for _ in range(3)]
        results.append((losses, engine.model_state_dict()))
    assert results[0][0] == results[1][0]
    for name, value in results[1][1].items():
        torch.testing.assert_close(results[0][1][name], value, rtol=0, atol=0, msg=name)


def test_a_failing_micro_batch_raises_and_leaves_nothing_on_the_device() -> None:
    engine = _engine(accumulation=4)
    calls = {"n": 0}

    def fail_in_third_micro_batch(_m: torch.nn.Module, _args: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in block 2")

    handle = engine.module.blocks[2].register_forward_pre_hook(fail_in_third_micro_batch)
    with pytest.raises(RuntimeError, match="boom in block 2"):
        engine.train_batch(_batch())
    handle.remove()
    streamer = _streamer(engine)
    assert streamer.residency.on_device == set() and not streamer.driven
    assert engine.train_batch(_batch()) > 0  # the engine is usable again


def test_eval_and_the_manual_trio_stream_per_micro_batch() -> None:
    engine = _engine(accumulation=2)
    inputs, targets = _batch(4)
    for half in (slice(0, 2), slice(2, 4)):
        loss = causal_lm_loss(engine(inputs[half]), (inputs[half], targets[half]))
        engine.backward(loss)
        engine.step()
    assert engine.global_step == 1
    assert engine.eval_batch(_batch()) > 0
    assert isinstance(engine.runner, LayerMajorRunner)


def test_layer_major_without_streaming_is_refused() -> None:
    with pytest.raises(ConfigError, match="layer_major needs layer_streaming.enabled"):
        ht.initialize(GPT(CFG), {"device": "cpu", "layer_streaming": {"layer_major": True}})


def test_no_worker_thread_outlives_the_step() -> None:
    engine = _engine(accumulation=4)
    engine.train_batch(_batch())
    assert not [t for t in threading.enumerate() if t.name.startswith("hybridtrain-micro")]


@pytest.mark.cuda
@pytest.mark.parametrize("boundary", ["recompute", "host"])
def test_cuda_result_equals_cpu_result(boundary: str) -> None:
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        engine = ht.initialize(GPT(CFG), {"device": device, "gradient_accumulation_steps": 4, "layer_streaming": {
            "enabled": True, "layer_major": True, "boundary_activations": boundary}}, loss_fn=causal_lm_loss)
        torch.manual_seed(1)
        losses = [engine.train_batch(tuple(t.to(device) for t in _batch())) for _ in range(3)]
        results.append((losses, engine.model_state_dict()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-5)
    for name, value in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], value, rtol=1e-4, atol=1e-5, msg=name)


class _Reuses(torch.nn.Module):
    """Runs its first block twice: layer-major order cannot cut such a graph per block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](self.blocks[0](x))).sum()


def test_a_block_run_twice_per_forward_is_refused_not_miscomputed() -> None:
    engine = ht.initialize(_Reuses(), {"device": "cpu", "gradient_accumulation_steps": 2, "model": {"blocks": "blocks"},
                                       "layer_streaming": {"enabled": True, "layer_major": True}})
    with pytest.raises(RuntimeError, match="ran twice"):
        engine.train_batch(torch.randn(4, 4))


def test_swapped_block_inputs_are_prefetched_in_block_major_backward_order() -> None:
    engine = _engine(accumulation=4, boundary_activations="host")
    runner = engine.runner
    assert isinstance(runner, LayerMajorRunner) and runner.swapper is not None
    stats = runner.swapper.stats
    engine.train_batch(_batch())
    # Only the first scope backward meets (last block, first micro-batch) is fetched on
    # demand; each later one was already on its way (activation_offload.prefetch_blocks: 1).
    assert stats.tensors_out == CFG.n_layer * 4
    assert stats.fetched_late == 1
    assert max(stats.prefetch_ahead) == 1
