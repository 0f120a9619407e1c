"""Optimizer offload (ZeRO-Offload on one process): eager host steps during backward,
deferral when all gradients are needed, checkpoints, refusals. Equivalence with the plain
loop is in the shared suite (``offload_*`` modes)."""

from __future__ import annotations

import pytest
import torch

import hybridtrain as ht
from hybridtrain.config import ConfigError
from hybridtrain.engine import NonFiniteLossError
from hybridtrain.runtime import transfer
from hybridtrain.runtime.optimizer_offload import OffloadOptimizer
from tests.equivalence import MODES, assert_resume_exact, engine_config, gpt_case

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
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
                         lasting_grads=lasting).close()
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
