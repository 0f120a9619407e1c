"""OOM recovery under a CPU device_memory_limit: the switch reruns the same step from the same
state, so the losses and weights equal a run of the fallback plan from the start."""

from __future__ import annotations

import functools
import gc
import json
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hybridtrain as ht
import hybridtrain.trainer as trainer
from hybridtrain.config import BatchSizes, Config, ConfigError, load_config
from hybridtrain.engine import Engine
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from hybridtrain.plan.build import build
from hybridtrain.plan.resolve import resolve
from hybridtrain.recovery.oom import MemoryGuard, _release, initialize_guarded
from hybridtrain.runtime.memory_limit import DeviceMemoryLimitError, LiveTensorBytes, tensors_alive
from tests.equivalence import OPTIMIZER, SEED, gpt_case

STEPS = 3
PLAIN = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "optimizer": OPTIMIZER, "device": "cpu",
         "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}
CHECKPOINTED = {**PLAIN, "activation_checkpointing": {"enabled": True}}
SMALLER = {**CHECKPOINTED, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
PLANS = {"plain": PLAIN, "checkpointed": CHECKPOINTED, "smaller": SMALLER}


def _factory(dropout: float) -> Any:
    case = gpt_case(dropout)

    def make(config: Config) -> nn.Module:
        torch.manual_seed(SEED)
        return case.build()
    return make


def _engine(config: Config, dropout: float) -> Engine:
    model = _factory(dropout)(config)
    return build(resolve(config, model, world_size=1), model, gpt_case(dropout).loss_fn)


def _run(raw: dict[str, Any], dropout: float, **guarded: Any) -> tuple[list[float], MemoryGuard]:
    """Losses of STEPS steps and the guard that ran them (counting from a clean heap)."""
    config = load_config({**raw, **guarded})
    gc.collect()
    others = tensors_alive()  # earlier runs' results do not count against this run's limit
    engine = _engine(config, dropout)
    torch.manual_seed(0)  # dropout's stream, the same in every run
    with MemoryGuard(engine, config, _factory(dropout), untracked=others) as guard:
        losses = [guard.train_batch(batch) for batch in gpt_case(dropout).batches(STEPS)]
    return losses, guard


@dataclass(frozen=True)
class Reference:
    """An unlimited run: its losses, final weights and learning rate, and each step's peak."""

    losses: list[float]
    weights: dict[str, torch.Tensor]
    lr: list[float]
    peaks: list[int]


@functools.cache
def _reference(plan: str, dropout: float) -> Reference:
    gc.collect()
    others = tensors_alive()
    engine = _engine(load_config(PLANS[plan]), dropout)
    torch.manual_seed(0)
    losses, peaks = [], []
    with LiveTensorBytes(ignore=others) as live:
        for batch in gpt_case(dropout).batches(STEPS):
            live.reset_peak()
            losses.append(engine.train_batch(batch))
            peaks.append(live.peak_bytes)
    return Reference(losses, engine.module.state_dict(), engine.get_lr(), peaks)


def _same_run(guard: MemoryGuard, losses: list[float], reference: Reference) -> None:
    torch.testing.assert_close(losses, reference.losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(guard.engine.module.state_dict(), reference.weights, rtol=1e-5, atol=1e-6)
    assert guard.engine.global_step == STEPS and guard.engine.get_lr() == reference.lr


def test_step_two_out_of_memory_reruns_with_checkpointing_and_keeps_the_trajectory(caplog: Any) -> None:
    plain, checkpointed = _reference("plain", 0.1).peaks, _reference("checkpointed", 0.1).peaks
    # Adam's moments exist from step 2 on, so step 2 needs more than step 1
    assert plain[0] < plain[1] and max(checkpointed) < plain[1]
    limit = (max(plain[0], *checkpointed) + plain[1]) // 2
    with caplog.at_level(logging.WARNING, logger="hybridtrain.recovery.oom"):
        losses, guard = _run(PLAIN, 0.1, device_memory_limit=limit, oom_recovery={"enabled": True})
    _same_run(guard, losses, _reference("checkpointed", 0.1))
    [switch] = guard.switches
    assert switch.step == 2 and switch.change == "activation checkpointing of every block"
    assert switch.limit_bytes == limit and switch.needed_bytes is not None and switch.needed_bytes > limit
    [line] = [r.getMessage() for r in caplog.records if "oom_recovery" in r.getMessage()]
    assert "step 2" in line and str(limit) in line and "\n" not in line


def test_two_switches_reach_a_smaller_micro_batch_with_the_same_math() -> None:
    checkpointed, smaller = _reference("checkpointed", 0.0).peaks, _reference("smaller", 0.0).peaks
    assert max(smaller) < checkpointed[1]
    limit = (max(smaller) + checkpointed[1]) // 2
    losses, guard = _run(PLAIN, 0.0, device_memory_limit=limit, oom_recovery={"enabled": True})
    _same_run(guard, losses, _reference("smaller", 0.0))
    assert [(s.step, s.change) for s in guard.switches] == [
        (1, "activation checkpointing of every block"),
        (2, "micro-batch 8 -> 4 with 1 -> 2 accumulation steps")]
    assert guard.engine.options.batch == BatchSizes(8, 4, 2, 1)


def test_attempts_are_bounded_then_one_line_with_the_numbers() -> None:
    limit = min(_reference("smaller", 0.0).peaks) - 1
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _run(PLAIN, 0.0, device_memory_limit=limit, oom_recovery={"enabled": True, "max_attempts": 2})
    message = str(caught.value)
    assert "\n" not in message and "after 2 plan switches" in message and f"limit {limit} bytes" in message


def test_with_dropout_the_micro_batch_is_not_changed_and_recovery_stops_in_one_line() -> None:
    limit = min(_reference("checkpointed", 0.1).peaks) - 1  # only a smaller micro-batch would fit
    with pytest.raises(torch.OutOfMemoryError, match="no plan computing the same math needs less memory") as caught:
        _run(PLAIN, 0.1, device_memory_limit=limit, oom_recovery={"enabled": True})
    assert "\n" not in str(caught.value)


def test_without_recovery_the_limit_error_reaches_the_caller() -> None:
    limit = _reference("plain", 0.1).peaks[0] - 1
    with pytest.raises(DeviceMemoryLimitError, match=f"against the limit of {limit} bytes"):
        _run(PLAIN, 0.1, device_memory_limit=limit)


def _wide_mlp() -> tuple[Config, Engine, Any]:
    """Weights dominate: the optimizer step is the step's peak."""
    config = load_config({"train_batch_size": 2, "optimizer": OPTIMIZER, "device": "cpu",
                          "device_memory_limit": 10**9, "oom_recovery": {"enabled": True}})

    def make(_: Config) -> nn.Module:
        torch.manual_seed(SEED)
        return nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))

    model = make(config)
    loss = nn.functional.mse_loss
    engine = build(resolve(config, model, world_size=1), model, lambda out, batch: loss(out, batch[1]))
    return config, engine, make


def test_out_of_memory_in_the_first_optimizer_step_reruns_from_the_factorys_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    batch = (torch.randn(2, 128, generator=torch.Generator().manual_seed(1)), torch.ones(2, 1))
    _, reference, _ = _wide_mlp()
    expected = [reference.train_batch(batch) for _ in range(2)]
    config, engine, make = _wide_mlp()
    # partly updated weights are never saved: the rerun starts from the factory's
    monkeypatch.setattr(engine, "save_checkpoint", lambda *args: pytest.fail("saved a partly updated state"))

    def more_memory(config: Config, measured: int, limit: int) -> Config:
        """A stand-in planner: its plan needs no less memory, but the limit it leaves is larger."""
        return config.model_copy(update={"device_memory_limit": 2 * 10**9})

    with MemoryGuard(engine, config, make, replan=more_memory) as guard:
        assert guard.live is not None
        params = sum(p.numel() * 4 for p in engine.module.parameters())
        # forward and backward fit beside the weights and gradients; Adam's two moments do not,
        # and the first of them is made after the optimizer's step began
        guard.live.limit_bytes = guard.live.current_bytes + params + 16384
        losses = [guard.train_batch(batch) for _ in range(2)]
    [switch] = guard.switches
    assert switch.step == 1 and switch.change == "device_memory_limit: 2000000000"
    assert losses == expected and guard.engine is not engine
    torch.testing.assert_close(guard.engine.module.state_dict(), reference.module.state_dict(), rtol=0, atol=0)


def test_out_of_memory_in_a_later_optimizer_step_is_refused_in_one_line() -> None:
    config, engine, make = _wide_mlp()
    batch = (torch.randn(2, 128), torch.randn(2, 1))
    with MemoryGuard(engine, config, make) as guard:
        guard.train_batch(batch)
        assert guard.live is not None
        params = sum(p.numel() * 4 for p in engine.module.parameters())
        # forward and backward fit beside the weights, gradients and two moments; the
        # optimizer's temporaries do not
        guard.live.limit_bytes = guard.live.current_bytes + params + 4096
        with pytest.raises(torch.OutOfMemoryError, match="step 2 ran out of memory in its optimizer step") as caught:
            guard.train_batch(batch)
    assert "cannot be rerun" in str(caught.value) and "\n" not in str(caught.value)


def test_a_limit_below_what_the_model_already_holds_is_one_line_before_any_step() -> None:
    config, engine, make = _wide_mlp()
    config = config.model_copy(update={"device_memory_limit": 1000})
    with pytest.raises(ValueError, match="device_memory_limit = 1000 bytes .* already take") as caught, \
            MemoryGuard(engine, config, make):
        pass
    assert "\n" not in str(caught.value)


def test_only_the_engines_own_tensors_count_when_the_guard_starts() -> None:
    # A notebook or a test suite holds other tensors in host memory: they are not this
    # training's memory, and a limit the engine's state fits in is not refused for them.
    config, engine, make = _wide_mlp()
    held = sum(p.numel() * 4 for p in engine.module.parameters())
    elsewhere = torch.zeros(2 * held)  # 8x the weights' bytes, alive throughout
    # weights, gradients and Adam's two moments, with room for the step's temporaries
    config = config.model_copy(update={"device_memory_limit": 6 * held})
    with MemoryGuard(engine, config, make) as guard:
        assert guard.live is not None and guard.live.current_bytes == held
        guard.train_batch((torch.randn(2, 128), torch.randn(2, 1)))
    assert not guard.switches and elsewhere.nbytes > config.device_memory_limit


def test_recovery_needs_a_model_factory() -> None:
    config, engine, _ = _wide_mlp()
    with pytest.raises(ValueError, match="oom_recovery.enabled needs a model factory"):
        MemoryGuard(engine, config)



LAYER_MAJOR_GPT = GPTConfig(n_layer=6, n_head=2, d_model=64, seq_len=8, vocab_size=64)


def _layer_major(keep: int, limit: int, recovery: bool = False) -> tuple[list[float], list[int], MemoryGuard]:
    """Layer-major streaming with ``keep`` blocks kept for backward, two micro-batches,
    under ``limit``: the losses, each step's peak live bytes and the guard."""
    def make(_: Config) -> nn.Module:
        torch.manual_seed(SEED)
        return GPT(LAYER_MAJOR_GPT)

    config = load_config({"device": "cpu", "train_batch_size": 4, "gradient_accumulation_steps": 2,
                          "optimizer": OPTIMIZER, "device_memory_limit": limit, "oom_recovery": {"enabled": recovery},
                          "layer_streaming": {"enabled": True, "layer_major": True, "keep_blocks_for_backward": keep}})
    torch.manual_seed(1)
    tokens = [torch.randint(0, LAYER_MAJOR_GPT.vocab_size, (4, LAYER_MAJOR_GPT.seq_len + 1)) for _ in range(STEPS)]
    gc.collect()
    others = tensors_alive()
    model = make(config)
    engine = build(resolve(config, model, world_size=1), model, causal_lm_loss)
    losses, peaks = [], []
    with MemoryGuard(engine, config, make, untracked=others) as guard:
        for t in tokens:
            losses.append(guard.train_batch((t[:, :-1], t[:, 1:])))
            assert guard.live is not None
            peaks.append(guard.live.peak_bytes)
    return losses, peaks, guard


def test_layer_major_gives_up_its_kept_blocks_first_and_trains_to_the_same_bits(caplog: Any) -> None:
    """Every block kept for backward holds N-2 more weight images at the turn from forward to
    backward; out of memory in step 1, the step reruns with none kept: the same bits."""
    unlimited = 10**12  # counted, never reached
    expected, none_kept, reference = _layer_major(0, unlimited)
    kept_losses, all_kept, _ = _layer_major(-1, unlimited)
    assert kept_losses == expected  # keeping changes no bit
    assert max(none_kept) < min(all_kept)
    limit = (max(none_kept) + min(all_kept)) // 2
    with caplog.at_level(logging.WARNING, logger="hybridtrain.recovery.oom"):
        losses, _, guard = _layer_major(-1, limit, recovery=True)
    [switch] = guard.switches
    assert switch.step == 1 and switch.change == "no streamed blocks kept for backward (all -> 0)"
    assert switch.needed_bytes is not None and switch.needed_bytes > limit
    assert guard.config.layer_streaming.keep_blocks_for_backward == 0
    assert losses == expected and guard.engine.global_step == STEPS
    torch.testing.assert_close(guard.engine.model_state_dict(), reference.engine.model_state_dict(), rtol=0, atol=0)
    [line] = [r.getMessage() for r in caplog.records if "rerunning" in r.getMessage()]
    assert "step 1 ran out of memory" in line and line.endswith("no streamed blocks kept for backward (all -> 0)")


class _RecordingGuard(MemoryGuard):
    """The trainer's guard, noting each step's peak live bytes."""

    peaks: list[int] = []

    def train_batch(self, batch: Any) -> float:
        loss = super().train_batch(batch)
        assert self.live is not None
        _RecordingGuard.peaks.append(self.live.peak_bytes)
        return loss


def _train(tmp_path: Path, name: str, **settings: Any) -> tuple[list[float], list[int]]:
    """``hybridtrain train`` on the reference GPT: the step losses and peak live bytes."""
    raw = {"device": "cpu", "seed": 3, "train_batch_size": 4, "optimizer": OPTIMIZER,
           "model": {"name": "gpt-tiny", "overrides": {"dropout": 0.1}}, "data": {"seq_len": 32},
           "train": {"steps": 3, "eval_batches": 1, "output_dir": str(tmp_path / name)}, **settings}
    _RecordingGuard.peaks = []
    gc.collect()
    trainer.run_training(load_config(raw), progress=False)
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r], list(_RecordingGuard.peaks)


def test_hybridtrain_train_recovers_and_keeps_the_fallback_plans_losses(tmp_path: Path, caplog: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer, "MemoryGuard", _RecordingGuard)
    unlimited = 10**12  # counted, never reached
    _, plain = _train(tmp_path, "plain", device_memory_limit=unlimited)
    expected, checkpointed = _train(tmp_path, "checkpointed", device_memory_limit=unlimited,
                                    activation_checkpointing={"enabled": True})
    assert plain[0] < plain[1] and max(checkpointed) < plain[1]
    limit = (max(plain[0], *checkpointed) + plain[1]) // 2
    with caplog.at_level(logging.WARNING, logger="hybridtrain.recovery.oom"):
        losses, _ = _train(tmp_path, "recovered", device_memory_limit=limit, oom_recovery={"enabled": True})
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    # the planner's choice (it estimates the config's model) or the ladder's first rung:
    # checkpointing of some blocks, the same losses either way
    [line] = [r.getMessage() for r in caplog.records if "rerunning" in r.getMessage()]
    assert "step 2 ran out of memory" in line and "checkpointing" in line


def test_initialize_refuses_what_only_a_guard_can_do_and_initialize_guarded_does_it() -> None:
    model = nn.Linear(4, 1)
    for settings, needs in [({"oom_recovery": {"enabled": True}}, "cannot rebuild the model"),
                            ({"device_memory_limit": "1MiB"}, "device_memory_limit = 1048576 on cpu")]:
        with pytest.raises(ConfigError, match=needs):
            ht.initialize(model, {"device": "cpu", "train_batch_size": 2, **settings})

    def make(_: Config) -> nn.Module:
        torch.manual_seed(SEED)
        return nn.Linear(4, 1)

    config = {"device": "cpu", "train_batch_size": 2, "device_memory_limit": "1GiB", "oom_recovery": {"enabled": True}}
    guard = initialize_guarded(make, config, loss_fn=lambda out, batch: nn.functional.mse_loss(out, batch[1]))
    with guard:
        loss = guard.train_batch((torch.ones(2, 4), torch.zeros(2, 1)))
        assert guard.live is not None and guard.live.peak_bytes > 0
    assert loss > 0 and guard.engine.global_step == 1 and not guard.switches


def test_release_drops_the_old_engines_host_state_while_the_engine_is_still_held() -> None:
    """The guard still holds the replaced engine while it builds the next one: the old host
    masters and gradient buffers must be gone by then (else twice the host state)."""
    config = load_config({**PLAIN, "layer_streaming": {"enabled": True}})
    engine = _engine(config, 0.0)
    engine.train_batch(gpt_case(0.0).batches(1)[0])
    masters = [weakref.ref(b.flat_master) for b in engine.optimizer.buckets]  # type: ignore[attr-defined]
    assert masters and all(m() is not None for m in masters)
    _release(engine)
    gc.collect()
    assert all(m() is None for m in masters)
    assert all(p.is_meta for p in engine.module.parameters())


def test_oom_in_the_forward_after_an_overlapped_step_is_recovered() -> None:
    """Step 1's host updates still run (overlap_updates, as hybridtrain train sets it) when
    step 2's forward runs out of memory: they are step 1's, so step 2 is rerun under
    another plan instead of refused as "partly updated"."""
    import time

    from hybridtrain.runtime.offload.optimizer import OffloadOptimizer

    raw = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "optimizer": OPTIMIZER, "device": "cpu",
           "gradient_clipping": 0.05, "oom_recovery": {"enabled": True},
           "zero_optimization": {"stage": 1, "reduce_bucket_size": 2000, "offload_optimizer": {"device": "cpu"}}}
    config = load_config(raw)
    case = gpt_case()

    def make(_: Config) -> nn.Module:
        torch.manual_seed(SEED)
        return case.build()

    model = make(config)
    engine = build(resolve(config, model, world_size=1), model, case.loss_fn)
    engine.overlap_updates = True
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer)
    first = min((b for b in opt.buckets if b.optimizer is not None), key=lambda b: opt._first_use[b.index])
    assert first.optimizer is not None
    real = first.optimizer.step
    first.optimizer.step = lambda *a, **k: (time.sleep(0.2), real(*a, **k))[1]  # type: ignore[method-assign]
    forwards = {"n": 0}

    def oom_in_step_two(*_: Any) -> None:
        forwards["n"] += 1
        if forwards["n"] == 2:
            time.sleep(0.5)  # step 1's background updates run meanwhile
            raise torch.OutOfMemoryError("injected: out of memory in step 2's forward")

    model.register_forward_pre_hook(oom_in_step_two)
    batches = case.batches(2)
    with MemoryGuard(engine, config, make) as guard:
        guard.train_batch(batches[0])
        guard.train_batch(batches[1])
    assert len(guard.switches) == 1
