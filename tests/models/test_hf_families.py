"""Every Hugging Face model family × every single-process technique: N steps of the engine
equal a plain PyTorch loop (fp32 rtol 1e-5; see tests/equivalence.py for the modes and
tests/models/hf_families.py for the tiny models).

The whole product (families × ``MODES``) runs at the suite's step count: one to two minutes
on two CPU cores.

``KNOWN_FAILURES`` lists the combinations that fail today, each with its root cause; they
are ``xfail(strict=True)``, so a fix makes its entry fail as XPASS until it is removed.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.equivalence import MODES, STEPS, assert_same_training, engine_run, plain_run
from tests.models.hf_families import FAMILIES, available, family_case

# ---------------------------------------------------------------------------- known failures
# Diagnosed against the package at a0dabed (+ its uncommitted work of the same hour). Before
# it (b04c80f) T5 also failed checkpoint / checkpoint_every2_accum2 / stream /
# stream_host_accum2_clip: the decoder's own config kept use_cache=True (now disable_caches).
_SWAP_RECOMPUTE_LEAF = ("runtime/activation_offload._SwappedRecompute.backward re-enters autocast with the "
                        "weight-cast cache on (the engine's forward runs cache_enabled=False) over detached "
                        "*leaf* inputs: one cached bf16 cast feeds q/k/v, whose input grads then sum in bf16")
_SWAP_RECOMPUTE_NO_GRAD = ("runtime/activation_offload._SwappedRecompute.forward runs the block under no_grad "
                           "and makes every output require grad: T5's position-bias attn_mask flips "
                           "requires_grad, so CPU SDPA takes another kernel than the plain loop (rounding)")
_LAYER_MAJOR_ENC_DEC = ("plan/resolve refuses layer_major for an encoder-decoder (ConfigError); the reason: "
                        "runtime/layer_major cuts the graph only at blocks' outputs and the encoder output "
                        "feeds every decoder block uncut (backward through the graph a second time)")
_FP16_HYSTERESIS = ("suite spec, not the package: the fp16 modes keep DeepSpeed's hysteresis=2 (LossScaler "
                    "halves after 2 overflows) but plain_run's GradScaler halves after every one; OLMo2's "
                    "fp16 gradients overflow at 2**16, so the skipped steps diverge (set hysteresis: 1 in MODES)")

KNOWN_FAILURES: dict[tuple[str, str], str] = {
    # Swapped recompute (activation offload + checkpointing, cpu_checkpointing) is not
    # bit-faithful: with bf16, blocks whose input goes straight into q/k/v (post-LN BERT,
    # RoBERTa, BART; OLMo2's post-norm); T5 (learned position bias) even in fp32.
    ("bert", "swap_checkpoint_bf16"): _SWAP_RECOMPUTE_LEAF,
    ("roberta", "swap_checkpoint_bf16"): _SWAP_RECOMPUTE_LEAF,
    ("bart", "swap_checkpoint_bf16"): _SWAP_RECOMPUTE_LEAF,
    ("olmo2", "swap_checkpoint_bf16"): _SWAP_RECOMPUTE_LEAF,
    ("t5", "swap_checkpoint_bf16"): f"{_SWAP_RECOMPUTE_NO_GRAD}; and {_SWAP_RECOMPUTE_LEAF}",
    ("t5", "cpu_checkpointing_accum2_offload"): _SWAP_RECOMPUTE_NO_GRAD,
    # Layer-major streaming of an encoder-decoder.
    ("t5", "stream_layer_major_accum4"): _LAYER_MAJOR_ENC_DEC,
    ("t5", "stream_layer_major_host_accum2_clip"): _LAYER_MAJOR_ENC_DEC,
    ("t5", "stream_layer_major_device_accum2"): _LAYER_MAJOR_ENC_DEC,
    ("bart", "stream_layer_major_accum4"): _LAYER_MAJOR_ENC_DEC,
    ("bart", "stream_layer_major_host_accum2_clip"): _LAYER_MAJOR_ENC_DEC,
    ("bart", "stream_layer_major_device_accum2"): _LAYER_MAJOR_ENC_DEC,
    # The suite's fp16 plain loop does not follow the engine's loss-scale schedule on overflow.
    ("olmo2", "fp16"): _FP16_HYSTERESIS,
    ("olmo2", "offload_opt_twinflow_fp16"): _FP16_HYSTERESIS,
}
# -------------------------------------------------------------------------------------------


def _params() -> list[Any]:
    out: list[Any] = []
    for family in FAMILIES:
        for mode in MODES:
            reason = KNOWN_FAILURES.get((family, mode))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(family, mode, marks=marks, id=f"{family}-{mode}"))
    return out


def test_known_failures_name_real_cases() -> None:
    unknown = [key for key in KNOWN_FAILURES if key[0] not in FAMILIES or key[1] not in MODES]
    assert not unknown, f"KNOWN_FAILURES entries for no family/mode: {unknown}"


@pytest.mark.parametrize(("family", "mode"), _params())
def test_family_matches_plain_loop(family: str, mode: str) -> None:
    pytest.importorskip("transformers")
    reason = available(FAMILIES[family])
    if reason:
        pytest.skip(reason)
    case = family_case(FAMILIES[family])
    m = MODES[mode]
    expected = plain_run(case, m, steps=STEPS)
    actual = engine_run(case, m, steps=STEPS)
    assert_same_training(expected, actual, rtol=m.rtol, atol=m.atol)
