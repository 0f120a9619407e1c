"""fp16 under optimizer offload and layer streaming: the host worker unscales each bucket's
gradients (and checks them for inf/NaN, and takes clipping's norms of the unscaled ones) as
the step's last backward lands it, off the critical path. Here: the same bits as a plain
loop doing DeepSpeed's fp16 rules and as the calling-thread path — with accumulation,
clipping that clips, steps that overflow and are skipped, a NaN loss, twin-flow and a
static scale — and that the calling thread no longer unscales the host gradients."""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hybridtrain as ht
from hybridtrain.runtime.offload.bucket import Bucket
from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from hybridtrain.runtime.precision.scaling import LossScaler
from hybridtrain.runtime.step_parts import PartClock
from tests.equivalence import (
    MODES,
    OPTIMIZER,
    SEED,
    ModelCase,
    assert_resume_exact,
    engine_config,
    model_cases,
    reduced_precision_tolerance,
)

CASE = model_cases()["sequential"]  # the reference GPT gives the same bits, at ten times the time
STEPS = 6
CLIP = 0.05
INITIAL_POWER = 20  # overflows the first steps of this model: a skipped step for real
FP16 = {"fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": INITIAL_POWER},
        "gradient_accumulation_steps": 2, "gradient_clipping": CLIP}
OFFLOAD = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 2000, "offload_optimizer": {"device": "cpu"}}}
PLACEMENTS: dict[str, dict[str, Any]] = {
    "offload": OFFLOAD,
    "stream": {"layer_streaming": {"enabled": True}},
    "stream_layer_major": {"layer_streaming": {"enabled": True, "layer_major": True}},
}

Run = tuple[list[float], dict[str, torch.Tensor], list[float], list[float | None]]
"""Losses, final parameters, the loss scale after each step, the clipped norm of each step."""


@functools.cache
def plain_fp16_loop(steps: int = STEPS, accumulation: int = 2) -> tuple[Run, int]:
    """The specification, written out: DeepSpeed's fp16 rules (loss × scale in fp32,
    gradients summed over micro-batches, ÷ scale, a step with an inf/NaN gradient skipped
    and the scale halved — hysteresis 1 — the rest clipped and stepped) with torch's fused
    CPU AdamW, the kernel the host steps with. Returns the run and the skipped steps."""
    torch.manual_seed(SEED)
    model = CASE.build()
    opt = torch.optim.AdamW(model.parameters(), **OPTIMIZER["params"], fused=True)  # type: ignore[arg-type]
    scale = float(2**INITIAL_POWER)
    losses: list[float] = []
    scales: list[float] = []
    norms: list[float | None] = []
    skipped = 0
    torch.manual_seed(SEED + 1)
    for inputs, targets in CASE.batches(steps):
        opt.zero_grad()
        loss = torch.zeros(())
        for part in zip(inputs.chunk(accumulation), targets.chunk(accumulation), strict=True):
            with torch.autocast("cpu", dtype=torch.float16):
                part_loss = CASE.plain_loss(model, part) / accumulation
            (part_loss.float() * scale).backward()
            loss = loss + part_loss.detach().float()
        losses.append(float(loss))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            skipped += 1
            scale = max(scale / 2, 1.0)
            scales.append(scale)
            norms.append(None)
            continue
        for g in grads:
            g.mul_(1.0 / scale)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        scales.append(scale)  # a window of 1000 good steps doubles it: not in these
    return (losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, scales, norms), skipped


def _engine(config: dict[str, Any], case: ModelCase = CASE) -> ht.Engine:
    torch.manual_seed(SEED)
    return ht.initialize(case.build(), engine_config(MODES["plain"], **config), loss_fn=case.loss_fn)


def _train(engine: ht.Engine, batches: list[Any] | None = None) -> Run:
    torch.manual_seed(SEED + 1)
    losses, scales, norms = [], [], []
    for batch in batches if batches is not None else CASE.batches(STEPS):
        skipped = engine.skipped_steps
        losses.append(engine.train_batch(batch))
        scales.append(engine.loss_scale)
        took = engine.skipped_steps == skipped and engine.last_grad_norm is not None
        norms.append(float(engine.last_grad_norm) if took else None)  # type: ignore[arg-type]
    return losses, engine.model_state_dict(), scales, norms


def assert_same_bits(actual: Run, expected: Run) -> None:
    assert [repr(x) for x in actual[0]] == [repr(x) for x in expected[0]]  # exact, nan included
    assert actual[2] == expected[2]
    assert actual[3] == expected[3]
    assert actual[1].keys() == expected[1].keys()
    for name, value in expected[1].items():
        assert torch.equal(actual[1][name], value), name


@contextmanager
def unscaled_by_thread() -> Iterator[Counter[str]]:
    """Count the gradients GradScaler's unscale-and-check kernel multiplies, by thread name."""
    counts: Counter[str] = Counter()
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def counting(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        counts[threading.current_thread().name.rsplit("_", 1)[0]] += len(grads)
        real(grads, found_inf, inv_scale)

    torch._amp_foreach_non_finite_check_and_unscale_ = counting  # type: ignore[assignment]
    try:
        yield counts
    finally:
        torch._amp_foreach_non_finite_check_and_unscale_ = real


@contextmanager
def calling_thread_path() -> Iterator[None]:
    """The engine as before the worker unscaled: the host optimizer is never told the scale,
    so every gradient is unscaled (and clipping's norms taken) on the calling thread."""
    told = OffloadOptimizer.unscale_on_landing
    OffloadOptimizer.unscale_on_landing = lambda self, scaler: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        OffloadOptimizer.unscale_on_landing = told  # type: ignore[method-assign]


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_fp16_steps_are_the_plain_loops_and_the_calling_threads_bit_for_bit(placement: str) -> None:
    """Accumulation over 2 micro-batches, clipping that clips, steps that overflow."""
    expected, skipped = plain_fp16_loop()
    assert 0 < skipped < STEPS  # an overflowing step was skipped, and others stepped
    assert any(n is not None and n > CLIP for n in expected[3])  # the clip clipped
    config: dict[str, Any] = {**FP16, **PLACEMENTS[placement]}
    engine = _engine(config)
    with unscaled_by_thread() as counts:
        actual = _train(engine)
    assert engine.skipped_steps == skipped
    assert counts["hybridtrain-host-step"] > 0 and counts["MainThread"] == 0
    if placement != "stream_layer_major":
        assert_same_bits(actual, expected)
    else:
        # Layer-major order sums some gradients in another order than the plain loop (so
        # did it before this change): the calling thread's bits, the plain loop's within
        # fp16's tolerance, its scale trajectory exactly.
        with calling_thread_path():
            assert_same_bits(actual, _train(_engine(config)))
        assert actual[2] == expected[2]
        rtol, atol = reduced_precision_tolerance(torch.float16, STEPS)
        torch.testing.assert_close(torch.tensor(actual[0]), torch.tensor(expected[0]), rtol=rtol, atol=atol)
        for name, value in expected[1].items():
            torch.testing.assert_close(actual[1][name], value, rtol=rtol, atol=atol)


@pytest.mark.parametrize("config", [
    {**FP16, **OFFLOAD, "gradient_accumulation_steps": 1},
    # twin-flow: the device-kept parameters are still unscaled on the calling thread
    {**FP16, "zero_optimization": {"stage": 1, "reduce_bucket_size": 200,
                                   "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
    # a static scale that is no power of two: the worker multiplies by the scaler's own 1/scale
    {"fp16": {"enabled": True, "loss_scale": 1000.0}, "gradient_clipping": CLIP, **OFFLOAD},
    {**FP16, "layer_streaming": {"enabled": True, "layer_major": True}, "gradient_accumulation_steps": 1},
], ids=["offload_accum1", "twin_flow", "static_scale", "layer_major_accum1"])
def test_the_worker_gives_the_calling_thread_paths_bits(config: dict[str, Any]) -> None:
    # The Sequential regression model, one batch with a NaN input: a non-finite loss is one
    # more skipped step (its gradients dropped, the masters untouched).
    case = CASE
    batches = case.batches(STEPS)
    batches[2][0][0, 0] = float("nan")
    with calling_thread_path():
        reference = _engine(config, case)
        expected = _train(reference, batches)
    engine = _engine(config, case)
    with unscaled_by_thread() as counts:
        actual = _train(engine, batches)
    assert_same_bits(actual, expected)
    assert engine.skipped_steps == reference.skipped_steps >= 1
    assert counts["hybridtrain-host-step"] > 0


def test_the_calling_thread_no_longer_unscales_the_host_gradients() -> None:
    """Fails on the code before: there, every host gradient went through the kernel on the
    calling thread after backward; now the worker unscaled them as they landed."""
    engine = _engine({**FP16, **OFFLOAD})
    trained = [p for p in engine.module.parameters() if p.requires_grad]
    with unscaled_by_thread() as counts:
        _train(engine)
    assert counts["MainThread"] == 0
    assert counts["hybridtrain-host-step"] == STEPS * len(trained)


def test_the_workers_unscale_counts_as_host_optimizer_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hybridtrain profile`` reads host work from the step clock's ``host_step``: the
    unscale the worker does behind backward is there (hidden work), not on the step's parts."""
    engine = _engine({**FP16, **OFFLOAD})
    unscale = Bucket.unscale
    calls: list[float] = []

    def slow(bucket: Bucket, slots: list[int], inv_scale: torch.Tensor) -> None:
        time.sleep(0.02)
        calls.append(0.02)
        unscale(bucket, slots, inv_scale)

    monkeypatch.setattr(Bucket, "unscale", slow)
    torch.manual_seed(SEED + 1)
    with PartClock().running() as clock:
        engine.train_batch(CASE.batches(1)[0])
    assert calls
    assert clock.work["host_step"] >= sum(calls)


def test_the_manual_forward_backward_step_keeps_the_calling_thread_path() -> None:
    """``engine.backward`` cannot know a boundary's backward is its last (a GAN's runs two):
    the calling thread unscales there, and clipping's norms are its own — the same bits."""
    case = CASE
    config = {**FP16, **OFFLOAD}
    expected = _train(_engine(config, case), case.batches(STEPS))
    engine = _engine(config, case)
    torch.manual_seed(SEED + 1)
    scales = []
    for x, y in case.batches(STEPS):
        for part in zip(x.chunk(2), y.chunk(2), strict=True):
            engine.backward(case.loss_fn(engine(part[0]), part))  # type: ignore[misc]
            engine.step()
        scales.append(engine.loss_scale)
    assert scales == expected[2]
    for name, value in engine.model_state_dict().items():
        assert torch.equal(value, expected[1][name]), name


class _SharedLayer(nn.Module):
    """One layer applied three times, twice inside reentrant checkpoints (ALBERT-like
    sharing under Hugging Face's gradient checkpointing): each checkpoint runs a backward of
    its own, so the layer's gradient lands in pieces within one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layer(x))
        for _ in range(2):
            x = checkpoint(lambda h: torch.tanh(self.layer(h)), x, use_reentrant=True)
        return self.head(x)


def test_a_gradient_landing_twice_in_one_backward_is_unscaled_on_the_calling_thread() -> None:
    case = ModelCase("shared", _SharedLayer, CASE.batches, CASE.loss_fn, CASE.plain_loss)
    config = {**FP16, **OFFLOAD, "gradient_accumulation_steps": 1}
    with calling_thread_path():
        expected = _train(_engine(config, case))
    engine = _engine(config, case)
    with unscaled_by_thread() as counts:
        actual = _train(engine)
    assert_same_bits(actual, expected)
    assert any(n is not None for n in actual[3])  # it stepped
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer)
    relanding = {id(p) for b in opt.buckets for p, twice in zip(b.params, b.relands, strict=True) if twice}
    # learned from the first backward
    assert relanding == {id(p) for p in engine.module.get_submodule("layer").parameters()}
    # From the second step: the head's on the worker, the shared layer's on the caller.
    assert counts["hybridtrain-host-step"] == 2 * (STEPS - 1)
    assert counts["MainThread"] == 4 + 2 * (STEPS - 1)


@pytest.mark.parametrize("scale", [2.0**20, 1000.0])
def test_a_buckets_unscale_is_the_scalers_bit_for_bit_and_refuses_a_second(scale: float) -> None:
    """Per bucket and per landing, the kernel and factor of ``LossScaler.unscale_and_check``
    over all gradients: the same bits (subnormal results included), the same verdict."""
    params = [nn.Parameter(torch.zeros(5, 3)), nn.Parameter(torch.zeros(7))]
    bucket = Bucket.create(0, params, False, {id(p): 0 for p in params}, False, torch.device("cpu"))
    gen = torch.Generator().manual_seed(SEED)
    grads = [torch.randn(p.shape, generator=gen) * 1e-38 * scale for p in params]  # some end subnormal
    bucket.flat_grad = torch.cat([g.flatten() for g in grads])
    bucket.has_grad = [True, True]
    scaler = LossScaler(static_scale=scale if scale == 1000.0 else 0.0, initial_scale_power=20)
    references = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for ref, g in zip(references, grads, strict=True):
        ref.grad = g.clone()
    assert scaler.unscale_and_check(references)
    bucket.unscale([1], scaler.inverse_scale(torch.device("cpu")))
    bucket.unscale([0], scaler.inverse_scale(torch.device("cpu")))
    assert bucket.found_inf is not None and not bucket.found_inf.item()
    for view, ref in zip(bucket.views(bucket.flat_grad), references, strict=True):
        assert ref.grad is not None and torch.equal(view, ref.grad)
    assert any(0 < abs(float(x)) < torch.finfo(torch.float32).tiny for x in bucket.flat_grad)
    with pytest.raises(RuntimeError, match="landed again in the step's last backward"):
        bucket.unscale([0], scaler.inverse_scale(torch.device("cpu")))
    bucket.clear()
    bucket.has_grad = [True, True]
    bucket.flat_grad[3] = float("inf")
    bucket.unscale([0, 1], scaler.inverse_scale(torch.device("cpu")))
    assert bucket.found_inf is not None and bucket.found_inf.item() == 1


def test_a_resumed_run_unscales_with_the_restored_scale(tmp_path: Any) -> None:
    """The scale a checkpoint restores (halved by the overflows before it) is the one the
    worker unscales with after the load: the resumed run is the straight one, bit for bit."""
    def make() -> ht.Engine:
        return _engine({**FP16, **OFFLOAD})

    torch.manual_seed(SEED + 1)
    first, resumed = assert_resume_exact(make, CASE.batches(STEPS), tmp_path / "ckpt", stop_at=2)
    assert first.loss_scale < 2.0**INITIAL_POWER  # the overflows before the save moved it
    assert resumed.skipped_steps > 0
