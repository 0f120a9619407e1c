"""Optimizer offload sends updated weights that autocast reads only in half as half
(:mod:`hybridtrain.runtime.offload.half_uploads`): the device parameters stay fp32 and hold the
half rounding of their masters, the training is bit-identical to fp32 uploads (that and
the bytes: ``test_half_width.py``; against the plain loop: the shared suite's
``offload_opt_*bf16*``/``*fp16*`` modes), and whatever reads the weights sees them exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hybridtrain as ht
from hybridtrain.runtime.offload.half_uploads import HalfWidthReadError
from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from tests.equivalence import MODES, SEED, engine_config, gpt_case

CASE = gpt_case()
MODE = MODES["offload_opt_bf16_accum2_clip"]


def _engine(overlap: bool = True, device: str = "cpu") -> ht.Engine:
    torch.manual_seed(SEED)
    engine = ht.initialize(CASE.build(), engine_config(MODE, device=device), loss_fn=CASE.loss_fn)
    engine.overlap_updates = overlap
    return engine


def _offload(engine: ht.Engine) -> OffloadOptimizer:
    assert isinstance(engine.optimizer, OffloadOptimizer)
    return engine.optimizer


def _masters(engine: ht.Engine) -> dict[str, torch.Tensor]:
    """Each parameter's host master, by name (what the plain loop's weights are)."""
    offload = _offload(engine)
    master_of = {id(p): m for b in offload.buckets for p, m in zip(b.params, b.masters, strict=True)}
    return {name: master_of[id(p)].detach().clone() for name, p in engine.module.named_parameters()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_device_weights_hold_the_rounding_and_every_reader_gets_the_masters(device: str) -> None:
    """On CUDA the half copy crosses asynchronously on the upload stream while the next
    forward may run (overlapped updates): the values must still be these."""
    engine = _engine(device=device)
    batches = CASE.batches(4)
    for batch in batches[:2]:
        engine.train_batch(batch)
    offload = _offload(engine)
    offload.wait_for_updates()
    masters = _masters(engine)
    rounded = {name for name, p in engine.module.named_parameters() if id(p) in offload.half_uploads.rounded}
    linears = {f"{n}.{k}" for n, m in engine.module.named_modules() if isinstance(m, nn.Linear)
               for k, _ in m.named_parameters(recurse=False)}
    assert rounded and rounded <= linears
    for name, p in engine.module.named_parameters():
        expected = masters[name].to(torch.bfloat16).float() if name in rounded else masters[name]
        assert torch.equal(p.detach().cpu(), expected), name
    assert any(not torch.equal(p.detach().cpu(), masters[n]) for n, p in engine.module.named_parameters()
               if n in rounded)
    # state_dict (checkpoints, save_pretrained) and model_state_dict give the masters.
    for source in (engine.module.state_dict(), engine.model_state_dict()):
        for name, value in masters.items():
            assert torch.equal(source[name].cpu(), value), name
    # wait_for_updates() makes the parameters themselves exact; the next steps round them again and
    # train exactly as a run that never waited.
    engine.wait_for_updates()
    assert not offload.half_uploads.rounded
    for name, p in engine.module.named_parameters():
        assert torch.equal(p.detach().cpu(), masters[name]), name
    straight = _engine(device=device)
    expected = [straight.train_batch(b) for b in batches]
    assert [engine.train_batch(b) for b in batches[2:]] == expected[2:]
    assert offload.half_uploads.rounded
    final, reference = engine.model_state_dict(), straight.model_state_dict()
    assert all(torch.equal(final[k], v) for k, v in reference.items())


def test_closing_the_optimizer_leaves_the_exact_weights_on_the_device() -> None:
    """An OOM recovery closes the optimizer and builds the next one from the parameters."""
    engine = _engine(overlap=False)
    for batch in CASE.batches(2):
        engine.train_batch(batch)
    masters = _masters(engine)
    assert _offload(engine).half_uploads.rounded
    _offload(engine).close()
    for name, p in engine.module.named_parameters():
        assert torch.equal(p.detach(), masters[name]), name


def test_weights_loaded_into_a_trained_model_reach_the_masters(tmp_path: Path) -> None:
    """Loading while the device holds roundings: through ``load_state_dict`` (a framework
    resuming) and through the engine's checkpoint (loaded in place): the run continues
    exactly as one that never diverged."""
    batches = CASE.batches(4)
    straight = _engine()
    expected = [straight.train_batch(b) for b in batches]
    first = _engine()
    for batch in batches[:2]:
        first.train_batch(batch)
    first.save_checkpoint(tmp_path)
    model_state, optimizer_state = first.module.state_dict(), first.optimizer.state_dict()
    for reload in ("state_dict", "checkpoint"):
        other = _engine()
        other.train_batch(batches[3])  # its device weights are now roundings of other weights
        _offload(other).wait_for_updates()
        assert _offload(other).half_uploads.rounded
        if reload == "state_dict":
            other.module.load_state_dict(model_state)
            other.optimizer.load_state_dict(optimizer_state)  # refreshes the masters from the model
            other.global_step = first.global_step
            assert other.scheduler is None
        else:
            other.load_checkpoint(tmp_path)
        assert [other.train_batch(b) for b in batches[2:]] == expected[2:], reload
        final = other.model_state_dict()
        for name, value in straight.model_state_dict().items():
            assert torch.equal(final[name], value), (reload, name)


class _Head(nn.Module):
    """Two Linears; ``again`` makes the forward also read ``second``'s weight in fp32.
    (Calling ``second`` twice would not: each call casts the weight to half, the same
    bits from the rounding as from the master.)"""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.again = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.second(torch.tanh(self.first(x)))
        return y + self.second.weight.mean() if self.again else y


def _head_engine(penalty: bool = False) -> ht.Engine:
    torch.manual_seed(0)
    model = _Head()

    def loss_fn(out: torch.Tensor, batch: Any) -> torch.Tensor:
        loss = (out.float() - batch[1]).pow(2).mean()
        return loss + 1e-3 * model.first.weight.pow(2).sum() if penalty else loss  # read in fp32

    config = {"device": "cpu", "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    return ht.initialize(model, config, loss_fn=loss_fn)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)


LINEAR = 8 * 8 + 8


def test_a_weight_the_loss_also_reads_goes_up_in_fp32() -> None:
    engine = _head_engine(penalty=True)
    for seed in range(2):
        engine.train_batch(_batch(seed))
    model = engine.module
    assert isinstance(model, _Head)
    rounded = _offload(engine).half_uploads.rounded
    assert rounded == {id(model.second.weight), id(model.second.bias), id(model.first.bias)}
    assert engine.last_timings.transfer_bytes["weights_up"] == 4 * 8 * 8 + 2 * (8 + LINEAR)


def test_a_weight_a_later_forward_reads_otherwise_refuses_the_step_before_any_update() -> None:
    engine = _head_engine()
    for seed in range(2):
        engine.train_batch(_batch(seed))
    assert engine.last_timings.transfer_bytes["weights_up"] == 2 * 2 * LINEAR  # both Linears in half
    before, state = engine.model_state_dict(), engine.optimizer.state_dict()
    model = engine.module
    assert isinstance(model, _Head)
    model.again = True  # its forward now reads second.weight in fp32: it computed with the rounding
    with pytest.raises(HalfWidthReadError, match=r"^parameter second\.weight went to the device in half"):
        engine.train_batch(_batch(2))
    after = engine.model_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert engine.optimizer.state_dict()["state"].keys() == state["state"].keys()
    for key, entry in state["state"].items():
        assert all(torch.equal(engine.optimizer.state_dict()["state"][key][k], v) for k, v in entry.items()
                   if isinstance(v, torch.Tensor))


def test_reloading_the_optimizer_alone_keeps_the_masters_of_rounded_weights() -> None:
    """``load_state_dict`` on the optimizer refreshes the masters from the model's
    parameters; a rounded one's master stays what it is (the parameter is not the weight)."""
    batches = CASE.batches(4)
    straight = _engine(overlap=False)
    expected = [straight.train_batch(b) for b in batches]
    engine = _engine(overlap=False)
    for batch in batches[:2]:
        engine.train_batch(batch)
    assert _offload(engine).half_uploads.rounded
    engine.optimizer.load_state_dict(engine.optimizer.state_dict())
    assert [engine.train_batch(b) for b in batches[2:]] == expected[2:]
