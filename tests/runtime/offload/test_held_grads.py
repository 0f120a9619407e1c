"""Gradients that wait on the device (``gradients_wait: device``,
:mod:`hybridtrain.runtime.offload.held_grads`): every offload and streaming mode whose
gradients would wait in host memory equals the plain loop with them waiting on the device,
and the host then holds 12 bytes per AdamW parameter (no gradient buffer) plus the pool."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from hybridtrain.runtime.offload.layout import POOLED_BUFFERS
from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from hybridtrain.runtime.streaming.streamer import LayerStreamer
from tests.equivalence import (
    GRADS_ON_DEVICE_MODES,
    HALF_WIDTH_MODES,
    MODES,
    PER_UPLOAD_IMAGE_MODES,
    SEED,
    STEPS,
    TWIN_FLOW_STREAMING_MODES,
    assert_resume_exact,
    assert_same_training,
    engine_config,
    engine_run,
    gpt_case,
    model_cases,
    plain_run,
)

CASES = model_cases()


def _run(case_name: str, mode_name: str) -> tuple[tuple[list[float], dict[str, torch.Tensor]], ht.Engine, list[float],
                                                   int]:
    case, mode = CASES[case_name], GRADS_ON_DEVICE_MODES[mode_name]
    torch.manual_seed(SEED)
    engine = ht.initialize(case.build(), engine_config(mode), loss_fn=case.loss_fn)
    engine.overlap_updates = bool(mode.extra.get("overlap_updates"))
    torch.manual_seed(SEED + 1)
    losses, norms = [], []
    for batch in case.batches(STEPS):
        losses.append(engine.train_batch(batch))
        if engine.last_grad_norm is not None:
            norms.append(float(engine.last_grad_norm))
    return (losses, engine.model_state_dict()), engine, norms, engine.skipped_steps


@pytest.mark.parametrize("mode", list(GRADS_ON_DEVICE_MODES))
@pytest.mark.parametrize("case", ["gpt_tied", "sequential", "hf_llama"])
def test_gradients_waiting_on_the_device_train_as_the_plain_loop(case: str, mode: str) -> None:
    m = GRADS_ON_DEVICE_MODES[mode]
    actual, engine, norms, skipped = _run(case, mode)
    assert_same_training(plain_run(CASES[case], m), actual, rtol=m.rtol, atol=m.atol)
    if m.clip and skipped < STEPS:
        assert max(norms) > m.clip  # clipping clipped
    streamer = next((o for o in engine.options.observers if isinstance(o, LayerStreamer)), None)
    optimizer = engine.optimizer
    assert isinstance(optimizer, OffloadOptimizer) and optimizer.grads_wait_on_device
    counted = streamer.host_bytes() if streamer is not None else optimizer.host_bytes()
    tensors = sum(len(b.masters) for b in optimizer.buckets)
    assert counted.waiting_grads == 0
    assert counted.masters + counted.optimizer_state == 12 * counted.params + 4 * tensors
    assert counted.staging <= POOLED_BUFFERS * max(b.flat_master.nbytes for b in optimizer.buckets) \
        + 3 * max(b.flat_master.nbytes for b in optimizer.buckets) // 2  # half uploads' staging


@pytest.mark.parametrize("mode", ["offload_opt_fp16_overflow_grads_on_device",
                                  "stream_layer_major_fp16_overflow_accum2_clip_grads_on_device"])
def test_an_overflowing_fp16_step_is_skipped(mode: str) -> None:
    *_, skipped = _run("gpt_tied", mode)
    assert skipped > 0


def test_deferred_gradients_wait_on_the_device_until_the_step() -> None:
    case = gpt_case()
    offload = {"stage": 1, "reduce_bucket_size": 2000,
               "offload_optimizer": {"device": "cpu", "gradients_wait": "device"}}
    config = engine_config(MODES["plain"], zero_optimization=offload, gradient_clipping=0.05)
    engine = ht.initialize(case.build(), config, loss_fn=case.loss_fn)
    optimizer = engine.optimizer
    assert isinstance(optimizer, OffloadOptimizer)
    batch = case.batches(1)[0]
    engine.backward(case.loss_fn(engine(batch[0]), batch))
    # Nothing crossed: every gradient is held on the device, no host buffer was made.
    assert all(b.has_held and b.flat_grad is None and not b.stepped for b in optimizer.buckets)
    assert all(p.grad is None for p in engine.module.parameters())
    engine.step()
    assert not any(b.has_held for b in optimizer.buckets)
    assert optimizer.host_bytes().waiting_grads == 0


@pytest.mark.parametrize("mode", ["offload_opt_bf16_accum2_clip_grads_on_device",
                                  "offload_opt_twinflow_fp16_grads_on_device",
                                  "stream_layer_major_fp16_overflow_accum2_clip_grads_on_device",
                                  "stream_bf16_accum2_clip_grads_on_device"])
def test_waiting_on_the_device_gives_the_bits_of_waiting_in_host_memory(mode: str) -> None:
    on_device = GRADS_ON_DEVICE_MODES[mode]
    in_host = {**MODES, **HALF_WIDTH_MODES}[mode.removesuffix("_grads_on_device")]
    assert_same_training(engine_run(CASES["gpt_tied"], in_host), engine_run(CASES["gpt_tied"], on_device), 0, 0)



@pytest.mark.parametrize("ratio", [1.0, 0.85])
def test_the_step_returns_before_the_first_block_updates_and_its_next_forward_waits_for_it(ratio: float) -> None:
    """``overlap_updates`` with held gradients: the step lands them from a landing thread and
    returns at once (it used to return only once all but the pool's last buckets had updated:
    here, after the first block's update); block 0's next forward waits for its own update, and
    the result is the same bits as waiting for every update in the step. With a Twin-Flow
    device share (ratio 0.85) too: its update runs in bounded runs beside the held gradients."""
    config = {"device": "cpu", "model": {"blocks": "blocks"}, "bf16": {"enabled": True}, "gradient_clipping": 0.05,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "layer_streaming": {"enabled": True},
              "zero_optimization": {"offload_optimizer": {"gradients_wait": "device", "ratio": ratio}}}
    tokens = torch.randint(0, 256, (2, 3, 17), generator=torch.Generator().manual_seed(SEED))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]

    def train(overlap: bool) -> tuple[list[float], dict[str, torch.Tensor], list[float], list[float], list[float]]:
        torch.manual_seed(SEED)
        engine = ht.initialize(GPT(GPTConfig(n_layer=2 * POOLED_BUFFERS, d_model=32, seq_len=16)), config,
                               loss_fn=causal_lm_loss)
        engine.overlap_updates = overlap
        optimizer = engine.optimizer
        assert isinstance(optimizer, OffloadOptimizer) and sum(b.streamed for b in optimizer.buckets) > POOLED_BUFFERS
        assert (optimizer._device_optimizer is not None) == (ratio < 1.0)
        first = optimizer.buckets[0]  # blocks.0's: the first the next forward reads, the first updated
        assert first.streamed and first.optimizer is not None
        inner, ends, starts, returns = first.optimizer.step, [], [], []

        def slow_step(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.2)
            out = inner(*args, **kwargs)
            ends.append(time.perf_counter())
            return out

        first.optimizer.step = slow_step  # type: ignore[method-assign]
        engine.module.get_submodule("blocks.0").register_forward_pre_hook(
            lambda *_: starts.append(time.perf_counter()))
        losses = []
        for batch in batches:
            losses.append(engine.train_batch(batch))
            returns.append(time.perf_counter())
        engine.wait_for_updates()
        return losses, engine.model_state_dict(), ends, starts, returns

    losses, state, ends, starts, returns = train(overlap=True)
    assert returns[0] < ends[0]  # step 1 returned before blocks.0 had updated
    assert min(t for t in starts if t > returns[0]) > ends[0]  # step 2's forward entered it after
    waited_losses, waited_state, *_ = train(overlap=False)
    assert losses == waited_losses
    assert all(torch.equal(value, state[name]) for name, value in waited_state.items())


@pytest.mark.parametrize("mode", ["stream_layer_major_fp16_overflow_accum2_clip_grads_on_device",
                                  "stream_host_accum2_clip_grads_on_device",
                                  "stream_twinflow_fp16_overflow_accum2_clip_held_later"])
def test_resume_is_exact_with_gradients_waiting_on_the_device(mode: str, tmp_path) -> None:
    """The last two modes land their held gradients after each step returned
    (``overlap_updates``; the last beside a Twin-Flow device share): the checkpoint waits for them."""
    case, m = CASES["gpt_tied"], {**GRADS_ON_DEVICE_MODES, **TWIN_FLOW_STREAMING_MODES}[mode]

    def make() -> ht.Engine:
        torch.manual_seed(SEED)
        engine = ht.initialize(case.build(), engine_config(m), loss_fn=case.loss_fn)
        engine.overlap_updates = bool(m.extra.get("overlap_updates"))
        return engine

    assert_resume_exact(make, case.batches(STEPS), tmp_path / "ckpt")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["offload_opt_bf16_accum2_clip_grads_on_device",
                                  "offload_opt_twinflow_fp16_grads_on_device",
                                  "stream_layer_major_fp16_overflow_accum2_clip_grads_on_device",
                                  "stream_host_accum2_clip_grads_on_device",
                                  "stream_twinflow_bf16_accum2_clip_grads_on_device",
                                  "stream_twinflow_fp16_overflow_accum2_clip_held_later",
                                  "stream_twinflow_first_fp16_overflow_clip_held_later",
                                  "stream_twinflow_first_bf16_accum2_clip",
                                  "stream_twinflow_first_bf16_accum2_clip_resident_checkpointed",
                                  "stream_twinflow_first_fp16_overflow_clip_held_later_resident_checkpointed",
                                  "stream_host_twinflow_keep1_bf16_clip_held_per_upload",
                                  "stream_bf16_accum2_clip_images_per_upload"])
def test_the_new_modes_train_on_cuda_as_the_plain_loop_there(mode: str) -> None:
    """Gradients held on a CUDA device (copied down on the side stream, the clip factor
    brought to the host), Twin-Flow under streaming (its share last or first: the next
    forward's reads racing the host's updates) and pooled images, against the plain
    loop on the same device."""
    m = {**GRADS_ON_DEVICE_MODES, **TWIN_FLOW_STREAMING_MODES, **PER_UPLOAD_IMAGE_MODES}[mode]
    case = CASES["gpt_tied"]
    expected = plain_run(case, m, device="cuda")
    torch.manual_seed(SEED)
    engine = ht.initialize(case.build(), engine_config(m, device="cuda"), loss_fn=case.loss_fn)
    engine.overlap_updates = bool(m.extra.get("overlap_updates"))
    torch.manual_seed(SEED + 1)
    losses = [engine.train_batch(batch) for batch in case.batches(STEPS)]
    state = {k: v.cpu() for k, v in engine.model_state_dict().items()}
    assert_same_training(expected, (losses, state), m.rtol, m.atol)
