"""Engine API beyond the equivalence suite: the trio, eval, non-finite losses, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybridtrain as ht
from tests.equivalence import (
    MODES,
    MLPStack,
    _regression_batches,
    assert_same_training,
    engine_config,
    model_cases,
    plain_run,
)

mse = lambda out, batch: F.mse_loss(out, batch[1])  # noqa: E731


def test_forward_backward_step_trio_equals_train_batch() -> None:
    case = model_cases()["sequential"]
    expected = plain_run(case, MODES["accum4"])
    torch.manual_seed(1234)
    engine = ht.initialize(case.build(), engine_config(MODES["accum4"]))
    torch.manual_seed(1235)
    losses = []
    for x, y in case.batches(4):
        total = 0.0
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            loss = F.mse_loss(engine(xs), ys)
            engine.backward(loss)
            total += loss.item() / 4
            boundary = engine.is_gradient_accumulation_boundary()
            assert engine.step() == boundary
        losses.append(total)
    assert engine.global_step == 4
    assert_same_training(expected, (losses, engine.model_state_dict()), rtol=1e-5, atol=1e-6)


def test_eval_batch_has_no_side_effects() -> None:
    torch.manual_seed(0)
    model = MLPStack(dropout=0.5)
    engine = ht.initialize(model, {"device": "cpu", "train_micro_batch_size_per_gpu": 3}, loss_fn=mse)
    x, y = _regression_batches(1)[0]
    before = engine.model_state_dict()
    value = engine.eval_batch((x, y))
    with torch.no_grad():
        model.eval()
        assert value == pytest.approx(F.mse_loss(model(x), y).item(), rel=1e-6)
    assert model.training is False  # restored to the caller's mode
    assert all(torch.equal(before[k], v) for k, v in engine.model_state_dict().items())


def test_nan_loss_in_fp32_stops_with_the_step_number() -> None:
    batches = _regression_batches(3)

    def bad(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(out, batch[1]) * (float("nan") if batch[1][0, 0] == batches[1][1][0, 0] else 1.0)

    engine = ht.initialize(MLPStack(), {"device": "cpu"}, loss_fn=bad)
    engine.train_batch(batches[0])
    with pytest.raises(ht.NonFiniteLossError, match="at step 2"):
        engine.train_batch(batches[1])
    skipper = ht.initialize(MLPStack(), {"device": "cpu", "nonfinite_loss": "skip"}, loss_fn=bad)
    skipper.train_batch(batches[0])
    before = skipper.model_state_dict()
    skipper.train_batch(batches[1])
    assert skipper.skipped_steps == 1
    assert all(torch.equal(before[k], v) for k, v in skipper.model_state_dict().items())


def test_bad_input_before_work() -> None:
    model = MLPStack()
    with pytest.raises(ht.ConfigError, match="set model.blocks"):
        ht.initialize(torch.nn.Linear(2, 2), {"activation_checkpointing": {"enabled": True}})
    with pytest.raises(ht.ConfigError, match="optimizer.type = 'Sgdd'"):
        ht.initialize(model, {"optimizer": {"type": "Sgdd"}})
    with pytest.raises(ht.ConfigError, match="total_num_steps"):
        ht.initialize(model, {"scheduler": {"type": "cosine"}})
    engine = ht.initialize(model, {"device": "cpu", "gradient_accumulation_steps": 3}, loss_fn=mse)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3"):
        engine.train_batch(_regression_batches(1)[0])
    no_loss = ht.initialize(MLPStack(), {"device": "cpu"})
    with pytest.raises(TypeError, match="loss_fn"):
        no_loss.train_batch(_regression_batches(1)[0])


def test_user_optimizer_and_readings() -> None:
    model = MLPStack()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = ht.initialize(model, {"device": "cpu", "wall_clock_breakdown": True}, loss_fn=mse, optimizer=opt)
    engine.train_batch(_regression_batches(1)[0])
    assert engine.optimizer is opt and engine.get_lr() == [0.05] and engine.loss_scale == 1.0
    t = engine.last_timings
    assert t.forward > 0 and t.backward > 0 and t.step > 0 and t.total >= t.forward + t.backward


@pytest.mark.cuda
def test_cuda_matches_plain_loop() -> None:
    case = model_cases()["gpt_tied"]
    cfg = engine_config(MODES["accum2"], device="cuda")
    torch.manual_seed(1234)
    engine = ht.initialize(case.build(), cfg, loss_fn=case.loss_fn)
    losses = [engine.train_batch(b) for b in case.batches(4)]
    expected = plain_run(case, MODES["accum2"])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[0]), rtol=1e-4, atol=1e-5)


def test_forward_keeps_the_callers_mode() -> None:
    torch.manual_seed(0)
    model = MLPStack(dropout=0.5)
    engine = ht.initialize(model, {"device": "cpu"}, loss_fn=mse)
    x = _regression_batches(1)[0][0]
    model.eval()
    with torch.no_grad():
        assert torch.equal(engine(x), engine(x)), "eval mode: dropout off, deterministic"
    assert model.training is False


def test_profile_writes_no_kineto_markers_but_passes_other_stderr_on(capfd: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # libkineto prints "USDT:… profiler_start" and "… profiler_stop" to file descriptor 2 on
    # every trace (two lines per timed step); a real error written meanwhile must still show.
    import os

    start = torch.profiler.profile.start

    def start_and_complain(self: torch.profiler.profile) -> None:
        start(self)
        os.write(2, b"E1123 a real error while the profiler starts\n")

    monkeypatch.setattr(torch.profiler.profile, "start", start_and_complain)
    engine = ht.initialize(MLPStack(), {"device": "cpu"}, loss_fn=mse)
    capfd.readouterr()
    engine.profile(_regression_batches(1)[0], steps=3)
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err, err
    assert err.count("E1123 a real error while the profiler starts\n") == 2, err


def test_micro_batch_done_counts_each_micro_batch_and_leaves_the_math_alone() -> None:
    case = model_cases()["sequential"]
    torch.manual_seed(1234)
    engine = ht.initialize(case.build(), engine_config(MODES["accum4"]), loss_fn=case.loss_fn)
    calls: list[tuple[int, int]] = []
    engine.micro_batch_done = lambda done, of: calls.append((done, of))
    torch.manual_seed(1235)
    losses = [engine.train_batch(batch) for batch in case.batches(2)]
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)] * 2
    assert_same_training(plain_run(case, MODES["accum4"], steps=2), (losses, engine.model_state_dict()),
                         rtol=1e-5, atol=1e-6)


# DeepSpeed's fp16 wrapper takes the fp16 init step (zero gradients) on the optimizer it holds when built
# (deepspeed/runtime/fp16/fused_optimizer.py, unfused_optimizer.py: initialize_optimizer_states),
# a caller's too (runtime/engine.py _configure_optimizer), before the config's LR schedule is
# built. That is the DeepSpeed drop-in's rule (tests/deepspeed/test_initialize.py):
# hybridtrain.initialize trains a DeepSpeed file with plain PyTorch math, and takes the step
# only where the config's optimizer.params.fp16_init_step asks for it.
LR, DECAY = 0.1, 0.1
FP16 = {"device": "cpu", "train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True, "hysteresis": 1}}
WARMUP = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR}}}
DEEPSPEED_OPTIMIZER = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY}}}


def _fp16_reference(init_step: bool, model: torch.nn.Module, batches: list) -> None:
    """The plain loop: AdamW (after DeepSpeed's zero-gradient step when asked), then
    loss-scaled fp16 steps (torch's GradScaler with DeepSpeed's initial scale 2^16)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    if init_step:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


CALLERS_OPTIMIZER_CASES = [
    ({**FP16, **DEEPSPEED_OPTIMIZER}, False),  # a DeepSpeed file: loading adds no step
    (FP16, False),  # written for hybridtrain: no optimizer section
    ({**FP16, "optimizer": {"type": "AdamW", "params": {"lr": LR, "fp16_init_step": True}}}, True),
    ({**FP16, "optimizer": {"type": "AdamW", "params": {"lr": LR, "fp16_init_step": False}}}, False),
]
CASE_IDS = ["deepspeed-file", "native", "asked", "turned-off"]


def _callers_engine(config: dict, path) -> tuple[ht.Engine, torch.nn.Module, list[torch.Tensor]]:
    import json

    path.write_text(json.dumps(config))
    torch.manual_seed(0)
    model = MLPStack()
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    return ht.initialize(model, path, loss_fn=mse, optimizer=optimizer), model, start


@pytest.mark.parametrize(("config", "init_step"), CALLERS_OPTIMIZER_CASES, ids=CASE_IDS)
def test_a_callers_optimizer_takes_the_fp16_init_step_where_the_config_asks(config: dict, init_step: bool,
                                                                         tmp_path) -> None:
    engine, model, _ = _callers_engine(config, tmp_path / "ds_config.json")
    torch.manual_seed(0)
    reference = MLPStack()
    batches = [(x[:4], y[:4]) for x, y in _regression_batches(3)]
    for batch in batches:
        engine.train_batch(batch)
    _fp16_reference(init_step, reference, batches)
    eps = torch.finfo(torch.float16).eps  # one fp16 rounding per step may differ
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=3 * eps, atol=3 * LR * eps)


@pytest.mark.parametrize(("config", "init_step"), CALLERS_OPTIMIZER_CASES, ids=CASE_IDS)
def test_the_fp16_init_step_of_a_callers_optimizer_runs_at_its_own_rate(config: dict, init_step: bool,
                                                                     tmp_path) -> None:
    # DeepSpeed steps before it builds the config's schedule: the warm-up's first rate (0)
    # would hide the weight decay. The schedule's rate is back afterwards.
    engine, model, start = _callers_engine({**config, **WARMUP}, tmp_path / "ds_config.json")
    decayed = 1 - LR * DECAY if init_step else 1.0
    for p, p0 in zip(model.parameters(), start, strict=True):
        torch.testing.assert_close(p.detach(), p0 * decayed, rtol=0, atol=0)
    twin = MLPStack()
    unstepped = ht.initialize(twin, {k: v for k, v in {**config, **WARMUP}.items() if k != "fp16"},
                              optimizer=torch.optim.AdamW(twin.parameters(), lr=LR))
    assert engine.get_lr() == unstepped.get_lr()
