"""Every Hugging Face model family × every single-process technique: N steps of the engine
equal a plain PyTorch loop (fp32 rtol 1e-5; see tests/equivalence.py for the modes and
tests/models/hf_families.py for the tiny models).

The whole product (families × ``MODES``) runs at the suite's step count: about a minute
on two CPU cores.

``KNOWN_FAILURES`` lists the combinations that fail today, each with its root cause; they
are ``xfail(strict=True)``, so a fix makes its entry fail as XPASS until it is removed.
"""

from __future__ import annotations

import pytest

from tests.equivalence import MODES, STEPS, assert_same_training, engine_run, plain_run
from tests.models.hf_families import FAMILIES, available, family_case

# ---------------------------------------------------------------------------- known failures
_T5_CACHE = ("compose._disable_hf_cache sets use_cache=False on model.config only; T5's decoder "
             "T5Stack has its own deep-copied config (use_cache=True), so training fills an "
             "EncoderDecoderCache and the recomputation reuses/extends cached K/V")
_SWAP_RECOMPUTE_LEAF = ("activation_offload._SwappedRecompute.backward re-enters autocast with the weight-cast "
                        "cache on (the engine runs with cache_enabled=False) over detached *leaf* inputs: one "
                        "cached bf16 cast feeds q/k/v, their input gradients are summed in bf16 (plain: fp32)")
_SWAP_RECOMPUTE_NO_GRAD = ("activation_offload._SwappedRecompute.forward runs the block under no_grad and "
                           "makes every output require grad: T5's position-bias attn_mask changes "
                           "requires_grad, so CPU SDPA picks another kernel (rounding differs)")
_FP16_HYSTERESIS = ("suite spec, not the package: the fp16 modes keep DeepSpeed's hysteresis=2 (LossScaler "
                    "halves after 2 overflows) but plain_run's GradScaler halves after every one; OLMo2's "
                    "fp16 gradients overflow at 2**16, so the skipped steps diverge (set hysteresis: 1 in MODES)")
_LAYER_MAJOR_SHARED = ("layer_major.LayerMajorRunner cuts the graph only at streamed blocks' outputs; "
                       "the encoder output feeds every decoder block uncut, so block N-1's segment "
                       "backward frees the encoder graph and block N-2's walks it again")

KNOWN_FAILURES: dict[tuple[str, str], str] = {
    # T5: the decoder keeps its KV cache in training (CheckpointError / size mismatch).
    ("t5", "checkpoint"): _T5_CACHE,
    ("t5", "checkpoint_every2_accum2"): _T5_CACHE,
    ("t5", "stream"): _T5_CACHE,
    ("t5", "stream_host_accum2_clip"): _T5_CACHE,
    # T5: the cache first; with it fixed, _SwappedRecompute's two numerical differences remain.
    ("t5", "swap_checkpoint_bf16"): f"{_T5_CACHE}; then {_SWAP_RECOMPUTE_NO_GRAD}; then {_SWAP_RECOMPUTE_LEAF}",
    ("t5", "cpu_checkpointing_accum2_offload"): f"{_T5_CACHE}; then {_SWAP_RECOMPUTE_NO_GRAD}",
    # Layer-major streaming of an encoder–decoder (T5 also hits the cache first where it recomputes).
    ("t5", "stream_layer_major_accum4"): f"{_T5_CACHE}; then {_LAYER_MAJOR_SHARED}",
    ("t5", "stream_layer_major_host_accum2_clip"): f"{_T5_CACHE}; then {_LAYER_MAJOR_SHARED}",
    ("t5", "stream_layer_major_device_accum2"): _LAYER_MAJOR_SHARED,
    ("bart", "stream_layer_major_accum4"): _LAYER_MAJOR_SHARED,
    ("bart", "stream_layer_major_host_accum2_clip"): _LAYER_MAJOR_SHARED,
    ("bart", "stream_layer_major_device_accum2"): _LAYER_MAJOR_SHARED,
    # Blocks whose input goes straight into q/k/v (post-LN: BERT, RoBERTa, BART; OLMo2's
    # post-norm) under bf16 + swapped recompute.
    ("bert", "swap_checkpoint_bf16"): _SWAP_RECOMPUTE_LEAF,
    ("roberta", "swap_checkpoint_bf16"): _SWAP_RECOMPUTE_LEAF,
    ("bart", "swap_checkpoint_bf16"): _SWAP_RECOMPUTE_LEAF,
    ("olmo2", "swap_checkpoint_bf16"): _SWAP_RECOMPUTE_LEAF,
    # The suite's fp16 plain loop does not follow the engine's loss-scale schedule on overflow.
    ("olmo2", "fp16"): _FP16_HYSTERESIS,
    ("olmo2", "offload_opt_twinflow_fp16"): _FP16_HYSTERESIS,
}
# -------------------------------------------------------------------------------------------


def _params() -> list[object]:
    out = []
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
