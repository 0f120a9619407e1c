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
    bad = lambda out, batch: F.mse_loss(out, batch[1]) * (float("nan") if batch[1][0, 0] == batches[1][1][0, 0] else 1.0)  # noqa: E731
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
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
