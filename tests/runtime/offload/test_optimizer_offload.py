"""Optimizer offload (ZeRO-Offload on one process): eager host steps during backward,
deferral when all gradients are needed, checkpoints, refusals. Equivalence with the plain
loop is in the shared suite (``offload_*`` modes)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hybridtrain as ht
from hybridtrain.config import ConfigError
from hybridtrain.engine import NonFiniteLossError
from hybridtrain.optim import build_optimizer, take_fp16_init_step
from hybridtrain.runtime import transfer
from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from tests.equivalence import (
    MODES,
    SEED,
    assert_resume_exact,
    assert_same_training,
    engine_config,
    engine_run,
    frozen_gpt_case,
    gpt_case,
    plain_run,
)
from tests.runtime.host_reads import HostReads

CASE = gpt_case()
OFFLOAD = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 2000, "offload_optimizer": {"device": "cpu"}}}


def _engine(**extra: object) -> ht.Engine:
    torch.manual_seed(0)
    return ht.initialize(CASE.build(), engine_config(MODES["plain"], **{**OFFLOAD, **extra}), loss_fn=CASE.loss_fn)


def _backward(engine: ht.Engine) -> None:
    batch = CASE.batches(1)[0]
    engine.backward(CASE.loss_fn(engine(batch[0]), batch))


def test_eager_host_step_runs_during_backward_and_frees_device_grads() -> None:
    engine = _engine()
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer) and len(opt.buckets) > 2
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    _backward(engine)
    # Every bucket stepped before step() was called, and the device params already hold
    # the updated weights (copied back by the host worker).
    assert all(b.stepped for b in opt.buckets)
    assert all(p.grad is None for p in engine.module.parameters())
    assert any(not torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    engine.step()
    assert engine.global_step == 1


@pytest.mark.parametrize("extra", [{"gradient_clipping": 1.0}, {"fp16": {"enabled": True}},
                                   {"nonfinite_loss": "skip"}])
def test_step_is_deferred_when_all_gradients_are_needed(extra: dict) -> None:
    engine = _engine(**extra)
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer)
    _backward(engine)
    assert not any(b.stepped for b in opt.buckets)
    # The gradients wait in host memory, where clipping / unscaling read them.
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(m.grad is not None and m.device.type == "cpu" for m in masters)


def test_with_accumulation_the_eager_step_waits_for_the_last_micro_batch() -> None:
    engine = _engine(gradient_accumulation_steps=2)
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer)
    _backward(engine)
    assert not any(b.stepped for b in opt.buckets)
    assert all(p.grad is None for p in engine.module.parameters())  # already summed on the host
    assert not engine.step()
    _backward(engine)
    assert all(b.stepped for b in opt.buckets)
    assert engine.step()


def test_nonfinite_loss_leaves_weights_untouched_on_the_eager_path() -> None:
    engine = _engine()
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    batch = CASE.batches(1)[0]
    engine.backward(CASE.loss_fn(engine(batch[0]), batch) * float("nan"))
    with pytest.raises(NonFiniteLossError):
        engine.step()
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_state_dict_has_the_plain_layout_and_resume_is_exact(tmp_path) -> None:
    first, _ = assert_resume_exact(_engine, CASE.batches(4), tmp_path / "ckpt")
    plain = torch.optim.AdamW(CASE.build().parameters())
    sd = first.optimizer.state_dict()
    assert len(sd["state"]) == len(list(plain.param_groups[0]["params"]))
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_twin_flow_keeps_the_last_parameters_on_the_device() -> None:
    engine = _engine(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.7}})
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer)
    total = sum(p.numel() for p in engine.module.parameters())
    assert 0.6 * total <= opt.host_numel <= 0.8 * total


def test_refuses_when_host_memory_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "available_host_bytes", lambda: 1000)
    model = torch.nn.Linear(512, 512, device="meta").to_empty(device="cpu")
    with pytest.raises(transfer.HostMemoryError, match=r"needs \d+\.\d+ GiB .* 0\.00 GiB is available"):
        OffloadOptimizer(torch.optim.AdamW(model.parameters()), torch.device("cpu"))


@pytest.mark.parametrize(("raw", "needle"), [
    ({"layer_streaming": {"enabled": True}, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
     "already keeps optimizer state"),
])
def test_incompatible_settings_are_rejected_with_the_reason(raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ht.initialize(CASE.build(), {"device": "cpu", **raw}, loss_fn=CASE.loss_fn)


@pytest.mark.cuda
def test_cuda_result_equals_cpu_result() -> None:
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        engine = ht.initialize(CASE.build(), engine_config(MODES["plain"], **OFFLOAD, device=device,
                                                            gradient_accumulation_steps=2), loss_fn=CASE.loss_fn)
        losses = [engine.train_batch(b) for b in CASE.batches(3)]
        results.append((losses, engine.model_state_dict()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-5)
    for k, v in results[0][1].items():
        torch.testing.assert_close(results[1][1][k], v, rtol=1e-4, atol=1e-5)


def test_gradients_stepped_on_landing_only_pass_through_the_pool() -> None:
    # One landing per step and an eager step: no bucket keeps a host gradient buffer
    # (12 instead of 16 host bytes per parameter); the pool holds at most 3 buffers.
    engine = _engine()
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer)
    for batch in CASE.batches(2):
        engine.train_batch(batch)
    assert all(b.flat_grad is None for b in opt.buckets)
    assert 1 <= opt._pool.allocated <= 3 < len(opt.buckets)


@pytest.mark.parametrize("mode", ["offload_opt_accum2_clip", "stream", "stream_host_accum2_clip"])
def test_a_float64_model_keeps_float64_masters_and_the_plain_loops_math(mode: str) -> None:
    # Host masters are fp32 for fp32 and lower-precision parameters (mixed precision's
    # masters), the parameters' own type above: an fp64 model trained fp32 on the host would
    # silently lose precision (and streamed blocks would compute in fp32).
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # in float64 (no fp32 cast)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    case = dataclasses.replace(CASE, build=lambda: gpt_case().build().double(),
                               loss_fn=lambda out, batch: loss(out, batch[1]),
                               plain_loss=lambda model, batch: loss(model(batch[0]), batch[1]))
    torch.manual_seed(SEED)
    engine = ht.initialize(case.build(), engine_config(MODES[mode]), loss_fn=case.loss_fn)
    assert isinstance(engine.optimizer, OffloadOptimizer)
    assert {b.flat_master.dtype for b in engine.optimizer.buckets} == {torch.float64}
    expected, actual = plain_run(case, MODES[mode]), engine_run(case, MODES[mode])
    # Losses (reported in float64, as the plain loop's) and parameters differ only at
    # float64's rounding level, far below the suite's fp32 tolerance.
    assert_same_training(expected, actual, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["offload_opt", "offload_opt_accum2_clip", "stream", "stream_host_accum2_clip",
                                  "stream_layer_major_accum4", "swap", "cpu_checkpointing_accum2_offload",
                                  # DeepSpeed's fp16 init step (bf16 at stage 0) passes frozen ones over
                                  "bf16", "stream_device_bf16"])
def test_frozen_parameters_stay_as_they_are_and_the_rest_train_as_in_the_plain_loop(mode: str) -> None:
    case = frozen_gpt_case()
    expected, actual = plain_run(case, MODES[mode]), engine_run(case, MODES[mode])
    assert_same_training(expected, actual, rtol=MODES[mode].rtol, atol=MODES[mode].atol)
    torch.manual_seed(SEED)
    torch.testing.assert_close(actual[1]["pos_emb.weight"], case.build().pos_emb.weight.detach(), rtol=0, atol=0)


def test_a_frozen_streamed_block_leaves_the_device_once_backward_has_passed_it() -> None:
    from hybridtrain.runtime.streaming.streamer import LayerStreamer

    torch.manual_seed(SEED)
    model = CASE.build()
    model.blocks[1].requires_grad_(False)
    engine = ht.initialize(model, engine_config(MODES["stream"]), loss_fn=CASE.loss_fn)
    [streamer] = [o for o in engine.options.observers if isinstance(o, LayerStreamer)]
    seen: list[list[bool]] = []
    model.blocks[0].mlp.fc.weight.register_post_accumulate_grad_hook(
        lambda _p: seen.append([b.loaded for b in streamer.blocks]))
    engine.train_batch(CASE.batches(1)[0])
    assert seen == [[True, False, False]]  # not kept until backward ends


def test_gradients_summed_over_micro_batches_wait_in_lasting_buffers() -> None:
    engine = _engine(gradient_accumulation_steps=2)
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer)
    engine.train_batch(CASE.batches(1)[0])
    assert all(b.flat_grad is not None for b in opt.buckets)
    assert 1 <= opt._pool.allocated <= 3  # the second micro-batch's gradients pass through it


def test_host_memory_check_counts_gradient_buffers_only_when_they_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    needed: list[int] = []
    monkeypatch.setattr(transfer, "check_host_memory", lambda n, what: needed.append(n))
    for lasting in (False, True):
        OffloadOptimizer(torch.optim.AdamW(model.parameters()), torch.device("cpu"), bucket_numel=256 * 256,
                         grads_wait_on_host=lasting).close()
    numel = sum(p.numel() for p in model.parameters())
    # fp32 master + two Adam moments (+ fp32 gradient) + 3 pooled buffers of the largest
    # bucket (one weight), less the parameters' own host memory, which the masters replace.
    pool = 4 * 3 * 256 * 256
    assert needed == [12 * numel + pool - 4 * numel, 16 * numel + pool - 4 * numel]


class _SharedAcrossBlocks(torch.nn.Module):
    """Two blocks sharing one Linear: with swapped checkpoints each block runs its own
    backward, so the shared weight's gradient arrives twice per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        shared = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(shared, torch.nn.Tanh()) for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_weight_shared_by_swapped_checkpointed_blocks_gets_its_whole_gradient() -> None:
    def loss_fn(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, batch[1])

    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(3)]
    torch.manual_seed(0)
    plain = _SharedAcrossBlocks()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=1e-6)
    expected = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(plain(x), (x, y))
        loss.backward()
        opt.step()
        expected.append(loss.item())
    torch.manual_seed(0)
    engine = ht.initialize(_SharedAcrossBlocks(), {
        # torch's AdamW default weight decay, as the plain loop uses (DeepSpeed's default is 0).
        "device": "cpu", "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}},
        "activation_checkpointing": {"enabled": True, "cpu_checkpointing": True},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 8, "offload_optimizer": {"device": "cpu"}}},
        loss_fn=loss_fn)
    losses = [engine.train_batch(b) for b in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(engine.model_state_dict()[name], value, rtol=1e-5, atol=1e-6)


# DeepSpeed's fp16 wrapper at ZeRO stage 0 steps the optimizer once with zero gradients when
# built (deepspeed/runtime/fp16/fused_optimizer.py and unfused_optimizer.py,
# initialize_optimizer_states): the host optimizer starts from that state.
WRAPPER_STEPPED = {"lr": 0.1, "weight_decay": 0.1}


def _two_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))


@pytest.mark.parametrize("streamed", [False, True])
def test_takes_over_the_state_of_a_stepped_optimizer_unchanged(streamed: bool) -> None:
    model = _two_layers()
    plain = copy.deepcopy(model)
    reference = build_optimizer(plain.parameters(), "AdamW", WRAPPER_STEPPED)
    # Layer streaming: each block's parameters become their own host masters. Twin flow: the
    # last half stays on the device with its state; the rest moves to the host.
    blocks = [list(layer.parameters()) for layer in model] if streamed else []
    offload = OffloadOptimizer(build_optimizer(model.parameters(), "AdamW", WRAPPER_STEPPED), torch.device("cpu"),
                               host_ratio=1.0 if streamed else 0.5, bucket_numel=20, streamed=blocks)
    try:
        assert (offload.host_numel < sum(p.numel() for p in model.parameters())) is not streamed
        torch.testing.assert_close(offload.state_dict()["state"], reference.state_dict()["state"], rtol=0, atol=0)
        masters = [p for group in offload.param_groups for p in group["params"]]
        for master, p in zip(masters, plain.parameters(), strict=True):
            assert torch.equal(master.detach(), p.detach())
    finally:
        offload.close()


def test_a_zero_gradient_step_reaches_the_host_masters_and_the_device_weights() -> None:
    # The drop-in steps a caller's optimizer after the engine offloaded it: gradients put on
    # the masters directly are stepped like landed ones, and the weights go back to the model.
    model = _two_layers()
    plain = copy.deepcopy(model)
    reference = build_optimizer(plain.parameters(), "AdamW", WRAPPER_STEPPED)
    take_fp16_init_step(reference)
    offload = OffloadOptimizer(build_optimizer(model.parameters(), "AdamW", WRAPPER_STEPPED), torch.device("cpu"),
                               host_ratio=0.5, bucket_numel=20)
    try:
        take_fp16_init_step(offload)
        assert not any(b.stepped for b in offload.buckets)  # the first training step is not taken as done
        # The host steps with torch's fused CPU AdamW, the reference with the unfused one.
        torch.testing.assert_close(offload.state_dict()["state"], reference.state_dict()["state"], rtol=1e-6,
                                   atol=0)
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=0)
    finally:
        offload.close()


# Adam as DeepSpeed's FusedAdam computes it (adam_w_mode false: L2 decay in the gradient,
# so the zero-gradient step already moves every weight by about lr) and AdamW.
FP16_OPTIMIZERS = [
    ({"type": "Adam", "params": {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01, "adam_w_mode": False}},
     torch.optim.Adam),
    ({"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01}}, torch.optim.AdamW),
]
# Without ZeRO, DeepSpeed (and so hybridtrain) ignores offload_optimizer: the host optimizer
# meets the fp16 init step under layer streaming, whose blocks are already in host memory when
# the optimizer is built and stepped.
PLACEMENTS = {
    "device": {},
    "stream": {"layer_streaming": {"enabled": True}},
    "stream_layer_major_accum2": {"gradient_accumulation_steps": 2,
                                  "layer_streaming": {"enabled": True, "layer_major": True}},
}


def _init_stepped_reference(cls: type, params: dict[str, Any],
                               fused: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """fp16 at ZeRO stage 0 as DeepSpeed trains it: the optimizer stepped once with zero
    gradients when built (FP16_Optimizer.initialize_optimizer_states), then loss-scaled
    fp16 steps (torch's GradScaler with DeepSpeed's initial scale 2^16, hysteresis 1).
    ``fused``: torch's fused CPU kernel, which the host optimizer steps with."""
    torch.manual_seed(SEED)
    model = CASE.build()
    opt = cls(model.parameters(), fused=fused, **{k: v for k, v in params.items() if k != "adam_w_mode"})
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    losses = []
    torch.manual_seed(SEED + 1)
    for batch in CASE.batches(4):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = CASE.plain_loss(model, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("optimizer", "cls"), FP16_OPTIMIZERS, ids=["Adam-L2", "AdamW"])
@pytest.mark.parametrize("placement", ["device", "stream"])
def test_fp16_at_stage_0_trains_from_deepspeeds_fp16_init_step(optimizer: dict, cls: type, placement: str) -> None:
    mode = MODES["fp16"]
    # Natively a DeepSpeed file trains with plain math; the fp16 init step is asked for.
    asked = {**optimizer, "params": {**optimizer["params"], "fp16_init_step": True}}
    actual = engine_run(CASE, mode, optimizer=asked, **PLACEMENTS[placement])
    # Streamed blocks step on the host with torch's fused CPU Adam, whose updates round
    # differently from the unfused kernel by about an ulp, by CPU; fp16 forwards amplify that
    # past the fp16 tolerance on some machines. The reference takes the same kernel, so what
    # is compared is the engine's math, not two kernels' rounding.
    expected = _init_stepped_reference(cls, optimizer["params"], fused=placement != "device")
    assert_same_training(expected, actual, rtol=mode.rtol, atol=mode.atol)


@pytest.mark.parametrize("placement", ["device", "stream", "stream_layer_major_accum2"])
def test_fp16_at_stage_0_resumes_exactly_without_a_second_fp16_init_step(placement: str, tmp_path) -> None:
    config = engine_config(MODES["fp16"], **PLACEMENTS[placement])
    config["optimizer"]["params"]["fp16_init_step"] = True  # the fp16 init step, asked for

    def make() -> ht.Engine:
        torch.manual_seed(SEED)
        return ht.initialize(CASE.build(), copy.deepcopy(config), loss_fn=CASE.loss_fn)

    first, resumed = assert_resume_exact(make, CASE.batches(4), tmp_path / "ckpt")
    # The checkpoint's counts (fp16 init step + 2 steps) replaced the new engine's own fp16 init step.
    counts = {int(s["step"]) for s in resumed.optimizer.state_dict()["state"].values()}
    assert {int(s["step"]) for s in first.optimizer.state_dict()["state"].values()} == {3} and counts == {5}


def test_a_dropped_engine_is_freed_while_its_model_lives_on() -> None:
    # OOM recovery rebuilds the engine around the same model: the gradient hooks left on
    # its parameters must not keep the old optimizer (its host masters and state) alive.
    engine = _engine()
    _backward(engine)
    engine.step()
    model, gone = engine.module, weakref.ref(engine.optimizer)
    del engine
    gc.collect()
    assert gone() is None
    # the hooks left behind do nothing: training the model on goes on
    batch = CASE.batches(1)[0]
    CASE.loss_fn(model(batch[0]), batch).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_close_removes_the_gradient_hooks() -> None:
    engine = _engine()
    engine.optimizer.close()
    # an open optimizer lands each bucket as its gradients arrive and frees them (first test)
    batch = CASE.batches(1)[0]
    CASE.loss_fn(engine.module(batch[0]), batch).backward()
    assert all(p.grad is not None for p in engine.module.parameters())


def test_before_backward_does_not_read_the_loss_on_the_host() -> None:
    """Reading the loss's finiteness before each micro-batch's backward drains the device;
    the flag goes down with the gradients instead, and a non-finite loss still leaves the
    host masters untouched (``test_nonfinite*`` above)."""
    engine = _engine(gradient_accumulation_steps=2)
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer)
    loss = torch.tensor(1.5)
    with HostReads() as reads:
        opt.before_backward(False, loss)
        opt.before_backward(True, loss)
    assert reads.calls == []


def test_a_model_only_load_reaches_the_host_masters(tmp_path) -> None:
    """The next update starts from the loaded weights, not from the host masters' older ones."""
    engine = _engine(gradient_clipping=0.05)
    batches = CASE.batches(3)
    engine.train_batch(batches[0])
    engine.save_checkpoint(tmp_path / "ckpt")
    loaded = engine.model_state_dict()
    engine.train_batch(batches[1])
    engine.load_checkpoint(tmp_path / "ckpt", model_only=True)
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0  # the next step changes nothing (AdamW's decay is scaled by lr too)
    engine.train_batch(batches[2])
    after = engine.model_state_dict()
    for name, value in loaded.items():
        assert torch.equal(value, after[name]), name
