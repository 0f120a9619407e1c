"""fp16 loss scaling: an inf gradient skips the step and shrinks the scale; windows grow it."""

from __future__ import annotations

import pytest
import torch

import hybridtrain as ht
from hybridtrain.runtime.precision.scaling import LossScaleAtMinimumError, LossScaler
from tests.equivalence import MODES, MLPStack, _regression_batches, engine_config


def _fp16_engine(**fp16: object) -> ht.Engine:
    torch.manual_seed(0)
    cfg = engine_config(MODES["fp16"])
    cfg["fp16"] = {"enabled": True, **fp16}
    return ht.initialize(MLPStack(), cfg, loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]))


def test_injected_inf_skips_the_step_and_shrinks_the_scale() -> None:
    engine = _fp16_engine(hysteresis=1, initial_scale_power=10)
    batches = _regression_batches(3)
    weight = engine.module[0].weight
    inject = {"on": True}
    weight.register_hook(lambda g: g * float("inf") if inject["on"] else g)
    before = {k: v.clone() for k, v in engine.model_state_dict().items()}
    engine.train_batch(batches[0])
    after = engine.model_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step must not change parameters"
    # The skipped step stepped nothing (and natively no DeepSpeed fp16 init step ran at build).
    assert all(int(s.get("step", 0)) == 0 for s in engine.optimizer.state.values())
    assert engine.skipped_steps == 1
    assert engine.loss_scale == 2.0**9
    inject["on"] = False
    engine.train_batch(batches[1])
    assert engine.skipped_steps == 1
    assert not torch.equal(engine.model_state_dict()["0.weight"], before["0.weight"])


def test_hysteresis_delays_the_shrink() -> None:
    scaler = LossScaler(initial_scale_power=4, hysteresis=2, window=100)
    scaler.update(overflow=True)
    assert scaler.scale == 16 and scaler.skipped_steps == 1
    scaler.update(overflow=True)
    assert scaler.scale == 8 and scaler.skipped_steps == 2


def test_scale_grows_after_window_and_stops_the_run_at_the_minimum() -> None:
    scaler = LossScaler(initial_scale_power=1, hysteresis=1, window=3, min_scale=1.0)
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 2  # DeepSpeed: the stable interval is the step minus one
    scaler.update(overflow=False)
    assert scaler.scale == 4
    scaler.update(overflow=True)
    scaler.update(overflow=True)
    assert scaler.scale == 1.0
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    with pytest.raises(LossScaleAtMinimumError, match=r"^fp16 step 7 overflowed with the loss scale already at its "
                                                      r"minimum \(fp16.min_loss_scale = 1\)"):
        scaler.update(overflow=True)


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("window", [1, 2, 3, 1000])
def test_the_scale_follows_deepspeeds_own_loss_scaler(hysteresis: int, window: int) -> None:
    """Side by side with DeepSpeed's ``DynamicLossScaler`` (its defaults: no consecutive
    hysteresis, an error at the minimum scale) over the same random overflows."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    gen = torch.Generator().manual_seed(hysteresis * 100 + window)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loss_scaler.dist, "get_rank", lambda: 0)  # its log line's rank; no group needed
        theirs = loss_scaler.DynamicLossScaler(init_scale=2.0**6, scale_window=window, min_scale=1.0,
                                               delayed_shift=hysteresis, consecutive_hysteresis=False)
        ours = LossScaler(initial_scale_power=6, window=window, hysteresis=hysteresis, min_scale=1.0)
        for step in range(200):
            overflow = bool(torch.rand(1, generator=gen) < 0.35)
            try:
                theirs.update_scale(overflow)
            except Exception as stopped:  # DeepSpeed's at the minimum scale: a bare Exception
                with pytest.raises(LossScaleAtMinimumError):
                    ours.update(overflow)
                assert "minimum" in str(stopped)
                break
            ours.update(overflow)
            assert ours.scale == theirs.cur_scale, step
            restored = LossScaler(initial_scale_power=6, window=window, hysteresis=hysteresis)
            restored.load_state_dict(ours.state_dict())
            ours = restored  # a resume at any step follows the same trajectory


def test_a_scaler_saved_before_the_step_count_loads() -> None:
    scaler = LossScaler(window=3)
    scaler.load_state_dict({"scale": 8.0, "hysteresis_left": 2, "good_steps": 2, "skipped_steps": 1})
    scaler.update(overflow=False)
    assert scaler.scale == 8.0
    scaler.update(overflow=False)
    assert scaler.scale == 16.0


def test_static_loss_scale_never_changes() -> None:
    scaler = LossScaler(static_scale=128.0)
    scaler.update(overflow=True)
    for _ in range(5):
        scaler.update(overflow=False)
    assert scaler.scale == 128.0 and scaler.skipped_steps == 1


def test_unscale_divides_and_detects() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 8.0)
    scaler = LossScaler(initial_scale_power=3)
    assert scaler.unscale_and_check([p])
    assert torch.equal(p.grad, torch.ones(3))
    p.grad = torch.tensor([1.0, float("nan"), 1.0])
    assert not scaler.unscale_and_check([p])


class _ReadTwice(torch.nn.Module):
    """One Linear applied twice (ALBERT's shared layer, a weight-tied loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


@pytest.mark.parametrize("offload", [False, True])
def test_a_weight_read_twice_trains_as_a_plain_autocast_loop(offload: bool) -> None:
    """torch.autocast's default cache casts a weight once per forward: its two half
    gradients are summed in half, then widened. The engine keeps the cache where the saved
    tensors hold the copies anyway, so the bits are the plain loop's (they differ without)."""
    def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(1)
        return [(torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(3)]

    def loss_fn(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (out.float() - batch[1]).pow(2).mean()

    torch.manual_seed(0)
    plain = _ReadTwice()
    torch.manual_seed(0)
    model = _ReadTwice()
    # SGD: the update is the gradient itself (Adam's first steps would hide its last bits).
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    expected = []
    for batch in batches():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(plain(batch[0]), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    config: dict[str, object] = {"device": "cpu", "bf16": {"enabled": True},
                                 "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if offload:
        config["zero_optimization"] = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    engine = ht.initialize(model, config, loss_fn=loss_fn)
    assert engine.options.autocast_cache
    assert [engine.train_batch(b) for b in batches()] == expected
    final = engine.model_state_dict()
    assert all(torch.equal(final[k], v) for k, v in plain.state_dict().items())
    checkpointed = ht.initialize(torch.nn.Sequential(_ReadTwice(), torch.nn.Linear(1, 1)),
                                 {**config, "activation_checkpointing": {"enabled": True}}, loss_fn=loss_fn)
    assert not checkpointed.options.autocast_cache  # its saved tensors leave: no cached copies
