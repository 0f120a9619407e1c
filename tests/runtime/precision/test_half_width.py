"""Half-width streaming: under bf16/fp16 autocast, nn.Linear weights cross host⇄device in
half and their gradients come back in half, with bit-identical results to streaming them
in fp32 (the plain-loop equivalence is in the shared suite, ``stream_*bf16*`` and
``stream_*fp16_overflow*`` modes; the bytes by kind are in ``test_device.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hybridtrain as ht
import hybridtrain.plan.build as build
from hybridtrain.models.gpt import GPT
from hybridtrain.runtime.precision.half_width import half_width_params
from tests.equivalence import HALF_WIDTH_MODES, MODES, SEED, engine_config, gpt_case

ALL_MODES = {**MODES, **HALF_WIDTH_MODES}
CASE = gpt_case()


def _linear_params(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}


def test_rule_takes_linear_weights_and_leaves_norms_embeddings_and_tied_weights_fp32() -> None:
    model = CASE.build()
    assert isinstance(model, GPT)
    half = half_width_params(model, torch.bfloat16)
    tied = {id(model.head.weight)} if model.head.weight is model.tok_emb.weight else set()
    assert tied, "the reference GPT ties its head to the token embedding"
    assert set(half) == _linear_params(model) - tied
    assert set(half.values()) == {torch.bfloat16}
    assert all(id(p) not in half for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.Embedding))
               for p in m.parameters(recurse=False))
    assert set(half_width_params(model, torch.float16).values()) == {torch.float16}
    assert half_width_params(model, None) == {}  # fp32 runs move fp32


class _Reused(nn.Module):
    """A Linear registered twice, one whose forward reads its weight otherwise, one fp64."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.again = self.shared
        self.custom = _Scaled(4, 4)
        self.wide = nn.Linear(4, 4).double()
        self.plain = nn.Linear(4, 4)


class _Scaled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight * 2).T


def test_rule_refuses_reused_linears_other_forwards_and_non_fp32_weights() -> None:
    model = _Reused()
    assert set(half_width_params(model, torch.bfloat16)) == {id(model.plain.weight), id(model.plain.bias)}


def _train(mode: str, half: bool, steps: int = 2) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int]]:
    torch.manual_seed(SEED)
    model = CASE.build()
    decide = build.half_width_params if half else (lambda _model, _dtype, _world=1: {})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "half_width_params", decide)
        engine = ht.initialize(model, engine_config(ALL_MODES[mode]), loss_fn=CASE.loss_fn)
    torch.manual_seed(SEED + 1)
    losses = [engine.train_batch(batch) for batch in CASE.batches(steps)]
    return losses, engine.model_state_dict(), engine.last_timings.transfer_bytes


@pytest.mark.parametrize("mode", ["stream_bf16_accum2_clip", "stream_layer_major_bf16",
                                  "stream_layer_major_fp16_overflow_accum2_clip", "offload_opt_bf16_accum2_clip",
                                  "offload_opt_fp16_overflow"])
def test_half_width_transfers_give_bit_identical_training_with_fewer_bytes(mode: str) -> None:
    """Against the same engine moving fp32 both ways: every loss and parameter equal to
    the bit, weights_up about half (optimizer offload's too), gradients_down half with one micro-batch (or per
    micro-batch landing), the same with layer-major's device-side fp32 sum."""
    # Three steps: the fp16 modes' last step then updates (the second overflows).
    half_losses, half_state, half_bytes = _train(mode, half=True, steps=3)
    full_losses, full_state, full_bytes = _train(mode, half=False, steps=3)
    assert half_losses == full_losses
    assert half_state.keys() == full_state.keys()
    for name, value in full_state.items():
        assert torch.equal(half_state[name], value), name
    # Optimizer offload's device weights stay fp32 parameters, widened from the half copy.
    assert half_bytes["weights_up"] < 0.6 * full_bytes["weights_up"]
    layer_major_sum = "layer_major" in mode and "accum2" in mode
    if layer_major_sum:  # summed on the device in fp32 over the micro-batches
        assert half_bytes["gradients_down"] == full_bytes["gradients_down"]
    else:
        assert half_bytes["gradients_down"] < 0.6 * full_bytes["gradients_down"]


def test_a_checkpoint_loaded_into_a_trained_engine_reaches_the_device(tmp_path: Any) -> None:
    """A checkpoint load writes the host masters directly; the next uploads must carry the
    loaded weights, not the half images cast from the weights before the load."""
    batches = CASE.batches(4)

    def make() -> ht.Engine:
        torch.manual_seed(SEED)
        return ht.initialize(CASE.build(), engine_config(ALL_MODES["stream_layer_major_bf16"]), loss_fn=CASE.loss_fn)

    straight = make()
    expected = [straight.train_batch(b) for b in batches]
    first = make()
    for batch in batches[:2]:
        first.train_batch(batch)
    first.save_checkpoint(tmp_path)
    other = make()
    other.train_batch(batches[3])  # its images now hold other weights
    other.load_checkpoint(tmp_path)
    assert [other.train_batch(b) for b in batches[2:]] == expected[2:]
    final = other.model_state_dict()
    for name, value in straight.model_state_dict().items():
        assert torch.equal(final[name], value), name


class _Twice(nn.Module):
    def __init__(self, twice: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        return self.fc(y) if self.twice else y


def _train_twice(config: dict[str, Any], half: bool, steps: int = 3, twice: bool = True,
                 ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int], ht.Engine]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Twice(twice), nn.Linear(8, 1))
    config = {"device": "cpu", "bf16": {"enabled": True}, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **config}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "half_width_params", build.half_width_params if half else lambda _m, _d, _w=1: {})
        engine = ht.initialize(model, config, loss_fn=lambda out, batch: (out - batch[1]).pow(2).mean())
    gen = torch.Generator().manual_seed(1)
    losses = [engine.train_batch((torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)))
              for _ in range(steps)]
    return losses, engine.model_state_dict(), engine.last_timings.transfer_bytes, engine


LINEAR_8X8, LINEAR_8X1 = 8 * 8 + 8, 8 + 1


@pytest.mark.parametrize("technique", ["streaming", "offload"])
def test_a_linear_called_twice_in_one_forward_stays_fp32(technique: str) -> None:
    """Its gradient is a sum of two gradients. Streaming (autocast without its cache: each
    call casts anew, and the two widened gradients are summed in fp32) learns it in the
    first step (moved in fp32) and keeps that Linear fp32. Optimizer offload keeps autocast's
    cache (a plain loop's math): both calls share one half copy, whose gradients autograd
    sums in half, so that gradient is one widened half value and crosses in half too.
    Bit-identical to fp32 transfers either way; the other Linears cross in half."""
    config: dict[str, Any] = ({"layer_streaming": {"enabled": True}} if technique == "streaming" else
                              {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})
    half, full = _train_twice(config, True), _train_twice(config, False)
    assert half[0] == full[0]
    assert all(torch.equal(half[1][k], v) for k, v in full[1].items())
    # per micro-batch (two per step): blocks 0 and 2 in half, block 1 (the twice-used fc) in
    # fp32 under streaming, in half under optimizer offload (one cached cast)
    assert full[2]["gradients_down"] == 2 * 4 * (2 * LINEAR_8X8 + LINEAR_8X1)
    twice = 4 if technique == "streaming" else 2
    assert half[2]["gradients_down"] == 2 * (2 * LINEAR_8X8 + twice * LINEAR_8X8 + 2 * LINEAR_8X1)


def test_a_linear_that_starts_running_twice_after_the_first_step_is_refused() -> None:
    engine = _train_twice({"layer_streaming": {"enabled": True}}, True, steps=2, twice=False)[3]
    twice = engine.module[1]
    assert isinstance(twice, _Twice)
    twice.twice = True  # the decision after step 1 saw fc once: a second call would sum half gradients
    ran_twice = r"^Linear fc of streamed block 1 ran twice in one forward \(once per forward in the first step"
    with pytest.raises(RuntimeError, match=ran_twice):
        engine.train_batch((torch.randn(8, 8), torch.randn(8, 1)))


def test_rule_takes_gpt2_conv1d_weights_read_by_addmm() -> None:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    conv = {id(p) for m in model.modules() if isinstance(m, Conv1D) for p in m.parameters()}
    assert conv and set(half_width_params(model, torch.bfloat16)) == conv  # lm_head is tied to wte


def test_optimizer_offload_sends_a_weight_the_loss_also_reads_in_fp32() -> None:
    """A regularizer in the loss reads a Linear's weight in fp32: its gradient is no
    widened half value, so it crosses in fp32 (the graph shows the second use)."""
    def train(half: bool) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        config: dict[str, Any] = {"device": "cpu", "bf16": {"enabled": True},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                  "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}

        def loss_fn(out: torch.Tensor, batch: Any) -> torch.Tensor:
            return (out - batch[1]).pow(2).mean() + 1e-3 * model[0].weight.pow(2).sum()

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(build, "half_width_params", build.half_width_params if half else lambda _m, _d, _w=1: {})
            engine = ht.initialize(model, config, loss_fn=loss_fn)
        gen = torch.Generator().manual_seed(1)
        losses = [engine.train_batch((torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)))
                  for _ in range(3)]
        return losses, engine.model_state_dict(), engine.last_timings.transfer_bytes

    half, full = train(True), train(False)
    assert half[0] == full[0]
    assert all(torch.equal(half[1][k], v) for k, v in full[1].items())
    assert half[2]["gradients_down"] == 4 * 8 * 8 + 2 * 8 + 2 * LINEAR_8X1  # weight 0 fp32, the rest half
