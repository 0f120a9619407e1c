"""The planner's model of gradients that wait on the device (``gradients_wait: device``,
:mod:`hybridtrain.runtime.offload.held_grads`): the host loses the 4-byte gradient buffer per
offloaded parameter, the device holds the waiting gradients instead, and the planner's host
bytes are what the runtime counts it allocated."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, causal_lm_loss, gpt_config
from hybridtrain.plan.variants import grid
from hybridtrain.planner import memory
from hybridtrain.planner.estimate import Target, estimate, model_source
from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from hybridtrain.runtime.streaming.streamer import LayerStreamer

BASE = {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
OFFLOAD = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
STREAM = {"layer_streaming": {"enabled": True, "layer_major": True}}
H100 = Target("cuda", "H100 SXM", 80 * 2**30, 128 * 2**30, host_bandwidth=152e9)


def _waiting(config: dict[str, Any], where: str) -> dict[str, Any]:
    zero = config.get("zero_optimization", {})
    offload = {**zero.get("offload_optimizer", {}), "gradients_wait": where}
    return {**BASE, **config, "zero_optimization": {**zero, "offload_optimizer": offload}}


@pytest.mark.parametrize("technique", [OFFLOAD, STREAM], ids=["offload", "stream_layer_major"])
def test_held_gradients_move_from_host_to_device_memory(technique: dict[str, Any]) -> None:
    host = estimate(_waiting(technique, "host"), H100)
    device = estimate(_waiting(technique, "device"), H100)
    assert host.plan.optimizer.grads_wait_on_host and not host.plan.optimizer.grads_wait_on_device
    assert device.plan.optimizer.grads_wait_on_device and not device.plan.optimizer.grads_wait_on_host
    assert device.memory.host.gradients == 0 < host.memory.host.gradients
    assert device.host_bytes < host.host_bytes
    assert device.device_peak_bytes > host.device_peak_bytes  # the waiting gradients
    # Summed on the device, the host step no longer sums micro-batches: never slower on the host.
    assert device.time.host_step <= host.time.host_step


def test_the_planner_offers_held_gradients_when_the_step_is_deferred() -> None:
    deferred = [words for words, _, _ in grid(ht.load_config(BASE), 1, False)]
    assert any("gradients wait on the device" in words for words in deferred)
    eager = {k: v for k, v in BASE.items() if k != "gradient_clipping"}
    assert not any("gradients wait on the device" in words for words, _, _ in grid(ht.load_config(eager), 1, False))


@pytest.mark.parametrize("technique", [OFFLOAD, STREAM], ids=["offload", "stream_layer_major"])
@pytest.mark.parametrize("where", ["host", "device"])
def test_planned_host_bytes_are_what_the_runtime_allocates(technique: dict[str, Any], where: str) -> None:
    config = {**_waiting(technique, where), "device": "cpu", "bf16": {"enabled": False}}
    cfg = ht.load_config(config)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", seq_len=64))
    example = (torch.zeros(4, 64, dtype=torch.long), torch.zeros(4, 64, dtype=torch.long))
    planned = estimate(cfg, Target("cpu", "cpu"), model=model_source(model, example, causal_lm_loss))
    engine = ht.initialize(model, config, loss_fn=causal_lm_loss)
    engine.train_batch((torch.randint(0, 64, (8, 64)), torch.randint(0, 64, (8, 64))))
    engine.wait_for_updates()
    streamer = next((o for o in engine.options.observers if isinstance(o, LayerStreamer)), None)
    assert isinstance(engine.optimizer, OffloadOptimizer)
    counted = streamer.host_bytes() if streamer is not None else engine.optimizer.host_bytes()
    host = planned.memory.host
    # The planner leaves out Adam's step counters (4 bytes per tensor).
    counters = 4 * sum(len(b.masters) for b in engine.optimizer.buckets)
    assert host.parameters == counted.masters + counted.images
    assert host.optimizer_state == counted.optimizer_state - counters
    assert host.gradients == counted.waiting_grads


@pytest.mark.parametrize("layer_major", [False, True], ids=["micro_batch_major", "layer_major"])
def test_half_gradients_held_on_the_device_are_planned_at_half_width(layer_major: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """One micro-batch per step: a streamed block's half weights get half gradients, held at
    that width until the step (the trace widens them to fp32, as autocast does for fp32
    weights). Wide blocks and few tokens, so the held gradients weigh in the peak: counted
    at fp32 the plan was 1.17x the measured peak."""
    import hybridtrain.runtime.streaming.layer_major as runner
    from hybridtrain.runtime.memory_limit import LiveTensorBytes
    from tests.planner.test_layer_major_memory import _counted_threads

    counter: list[LiveTensorBytes] = []
    monkeypatch.setattr(runner, "threading", _counted_threads(counter))
    config = {**_waiting(STREAM, "device"), "device": "cpu", "train_batch_size": 2,
              "train_micro_batch_size_per_gpu": 2, "data": {"seq_len": 32}, "model": {"blocks": "blocks"},
              "layer_streaming": {"enabled": True, "layer_major": layer_major}}
    with LiveTensorBytes("cpu") as before:  # before the model: the step's peak counts every byte of it
        pass
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", seq_len=32, n_layer=6, d_model=512))
    tokens = torch.randint(0, 256, (2, 33))
    batch = (tokens[:, :-1], tokens[:, 1:])
    planned = estimate(config, Target("cpu", "cpu"), model=model_source(model, batch, causal_lm_loss))
    assert planned.memory.peak_at.startswith("backward of blocks")  # where every held gradient is alive
    engine = ht.initialize(model, config, loss_fn=causal_lm_loss)
    engine.train_batch(batch)  # warm-up: the optimizer state exists
    engine.wait_for_updates()
    with LiveTensorBytes("cpu") as live:
        counter.append(live)
        engine.train_batch(batch)
        engine.wait_for_updates()
    counter.clear()
    measured = live.peak_bytes - before.current_bytes  # on a CPU the plan's peak counts the host state too
    assert abs(planned.device_peak_bytes - measured) / measured <= 0.10, (planned.device_peak_bytes, measured)


def test_the_device_share_steps_beside_every_held_gradient_in_runs_of_bounded_size(monkeypatch) -> None:
    """Held gradients land after the step with a Twin-Flow share too (``lands_later``): all of
    them are still on the device when the share steps, beside the foreach temporary of one run
    (runtime/offload/device_share.py). A run as large as the share (the whole-share update)
    makes the step the peak; runs of one parameter move the peak back to the backward."""
    config = _waiting({"data": {"seq_len": 8}, "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
                       "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.1}}},
                      "device")
    monkeypatch.setattr(memory, "DEVICE_SHARE_GROUP_NUMEL", 10**12)
    whole = estimate(config, H100)
    assert memory.lands_later(whole.plan) and whole.plan.optimizer.host_ratio == 0.1
    share_numel = whole.memory.device.optimizer_state // 8  # two fp32 moments per device-updated element
    model_numel = sum(p.numel() for p in GPT(gpt_config("gpt-tiny", seq_len=8)).parameters())
    assert whole.memory.peak_at == "optimizer step"
    assert whole.memory.device.gradients == 4 * model_numel  # every held gradient, none landed yet
    monkeypatch.setattr(memory, "DEVICE_SHARE_GROUP_NUMEL", 1)
    runs = estimate(config, H100)
    assert runs.memory.peak_at != "optimizer step" and runs.memory.device_peak < whole.memory.device_peak
    # The step's workspace: the batch, and at the whole-share step its temporary (4 bytes an element).
    assert whole.memory.device.workspace - runs.memory.device.workspace == 4 * share_numel
