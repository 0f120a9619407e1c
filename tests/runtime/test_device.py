"""Devices are normalized once (``cuda`` → ``cuda:N``, ``cpu:0`` → ``cpu``), so every
technique that compares a tensor's device with the training device moves what it should
whatever spelling the config used; the bytes each technique moves per step, by kind, are
computed here from the model's sizes and compared with what the transfer code counted."""

from __future__ import annotations

import pytest
import torch

import hybridtrain as ht
from hybridtrain.runtime.device import normalize_device, resolve_device
from tests.equivalence import (
    HALF_WIDTH_MODES,
    MODES,
    SEED,
    assert_same_training,
    engine_config,
    gpt_case,
    plain_run,
)

ALL_MODES = {**MODES, **HALF_WIDTH_MODES}
CASE = gpt_case()
STEPS = 2
MICRO = 8  # the suite's batch (tests/equivalence.BATCH) in one micro-batch
SEQ, WIDTH, LAYERS = 16, 32, 3


def test_normalize_device_gives_the_spelling_tensors_report() -> None:
    assert normalize_device("cpu:0") == torch.device("cpu") == torch.empty(0, device="cpu:0").device
    assert normalize_device(torch.device("cpu", 3)) == torch.device("cpu")
    assert normalize_device("meta") == torch.device("meta")
    assert normalize_device("cuda").index is not None  # the current device's index
    assert normalize_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu:0") == torch.device("cpu")


def _param_bytes(modules: list[torch.nn.Module]) -> int:
    seen = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}
    return sum(p.numel() * p.element_size() for p in seen.values())


def _half_width_bytes(modules: list[torch.nn.Module]) -> int:
    """Under bf16/fp16: nn.Linear weights and biases 2 bytes each, the rest (norms, and the
    head's weight tied to the token embedding) 4."""
    owners: dict[int, int] = {}
    for m in modules:
        for sub in m.modules():
            for p in sub.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
    linear = {id(p) for m in modules for sub in m.modules() if isinstance(sub, torch.nn.Linear)
              for p in sub.parameters(recurse=False) if owners[id(p)] == 1}
    seen = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * (2 if i in linear else 4) for i, p in seen.items())


def _expected(mode: str, model: torch.nn.Module) -> dict[str, int]:
    """Bytes per step by kind, from the model's sizes and the mode's settings."""
    blocks = list(model.blocks)  # type: ignore[attr-defined]
    block = _param_bytes(blocks[:1])
    half_block = _half_width_bytes(blocks[:1])
    everything = _param_bytes([model])
    resident = everything - _param_bytes(blocks)
    accum = ALL_MODES[mode].config.get("gradient_accumulation_steps", 1)
    block_input = MICRO // accum * SEQ * WIDTH * 4  # (B, T, C) fp32 residual stream
    zero = {"activations_out": 0, "activations_in": 0, "weights_up": 0, "gradients_down": 0, "device_map": 0}
    if mode == "swap_checkpoint_bf16":  # checkpointed and swapped: only block inputs travel
        return {**zero, "activations_out": LAYERS * block_input, "activations_in": LAYERS * block_input}
    if mode == "offload_opt":  # every gradient down once, every updated weight up once
        return {**zero, "gradients_down": everything, "weights_up": everything}
    if mode == "stream_host_accum2_clip":
        # Per micro-batch: each block up in forward and again in backward, except the last
        # (kept for backward); its input out and back; every gradient down. The resident
        # parameters' updated weights go up once, after the (deferred) step.
        return {**zero, "activations_out": accum * LAYERS * block_input,
                "activations_in": accum * LAYERS * block_input,
                "weights_up": accum * (2 * LAYERS - 1) * block + resident,
                "gradients_down": accum * everything}
    if mode == "offload_opt_bf16_accum2_clip":
        # Every gradient down per micro-batch and every updated weight up once — the Linear
        # weights in half, the tied embedding/head and the norms in fp32.
        half_everything = LAYERS * half_block + _half_width_bytes([model]) - _half_width_bytes(blocks)
        return {**zero, "weights_up": half_everything, "gradients_down": accum * half_everything}
    if mode == "stream_bf16_accum2_clip":
        # As above with half-width blocks: their Linear weights up and gradients down at 2
        # bytes a parameter per micro-batch (norms and the resident tied embedding at 4).
        return {**zero, "weights_up": accum * (2 * LAYERS - 1) * half_block + resident,
                "gradients_down": accum * (LAYERS * half_block + resident)}
    if mode in ("stream_layer_major_bf16", "stream_layer_major_host_bf16_accum2_clip"):
        # Layer-major: each block up in half once in forward and again in backward (the
        # half copy is not kept between them), except the last; gradients down once per
        # step: half with one micro-batch, the fp32 sum of several (exact sums need fp32).
        swapped = accum * LAYERS * block_input if "host" in mode else 0
        return {**zero, "activations_out": swapped, "activations_in": swapped,
                "weights_up": (2 * LAYERS - 1) * half_block + resident,
                "gradients_down": LAYERS * (half_block if accum == 1 else block) + resident}
    raise AssertionError(mode)


# "cpu" itself: the equivalence suite, and the swap test below (same bytes as "cpu:0").
@pytest.mark.parametrize("device", ["cpu:0", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("mode", ["swap_checkpoint_bf16", "offload_opt", "stream_host_accum2_clip",
                                  "offload_opt_bf16_accum2_clip", "stream_bf16_accum2_clip", "stream_layer_major_bf16",
                                  "stream_layer_major_host_bf16_accum2_clip"])
def test_techniques_move_the_bytes_their_sizes_say_on_every_spelling_of_the_device(mode: str, device: str) -> None:
    """On CUDA too: ``device: cuda`` used to stay index-less, and swapping kept everything
    (``cuda:0 != cuda``); there the batches are moved by the engine and the plain loop runs
    on the same device (CPU and CUDA bf16 kernels round differently: an AdamW update of a
    gradient near zero can flip its sign between them)."""
    expected = plain_run(CASE, ALL_MODES[mode], steps=STEPS, device=device)
    torch.manual_seed(SEED)
    model = CASE.build()
    engine = ht.initialize(model, engine_config(ALL_MODES[mode], device=device), loss_fn=CASE.loss_fn)
    assert engine.device == normalize_device(device) and engine.device.index == (0 if device == "cuda" else None)
    torch.manual_seed(SEED + 1)
    losses = [engine.train_batch(batch) for batch in CASE.batches(STEPS)]
    rtol, atol = ALL_MODES[mode].rtol, ALL_MODES[mode].atol
    state = {k: v.cpu() for k, v in engine.model_state_dict().items()}
    assert_same_training(expected, (losses, state), rtol, atol)
    assert engine.last_timings.transfer_bytes == _expected(mode, model)


def test_swap_moves_every_saved_activation_on_cpu0() -> None:
    """``cpu:0`` used to keep every saved tensor (``cpu != cpu:0``): nothing travelled."""
    sent = {}
    for device in ("cpu", "cpu:0"):
        torch.manual_seed(SEED)
        engine = ht.initialize(CASE.build(), engine_config(ALL_MODES["swap"], device=device), loss_fn=CASE.loss_fn)
        engine.train_batch(CASE.batches(1)[0])
        sent[device] = engine.last_timings.transfer_bytes
    assert sent["cpu:0"] == sent["cpu"]
    assert sent["cpu"]["activations_out"] == sent["cpu"]["activations_in"] > LAYERS * MICRO * SEQ * WIDTH * 4
