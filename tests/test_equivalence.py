"""Every technique × every model shape: the engine equals the plain loop (fp32 rtol 1e-5;
autocast modes at the tolerance derived from their precision, `reduced_precision_tolerance`)."""

from __future__ import annotations

import pytest

from tests.equivalence import (
    HALF_WIDTH_MODES,
    MODES,
    assert_same_training,
    engine_run,
    model_cases,
    plain_run,
)

CASES = model_cases()


@pytest.mark.parametrize("mode", list(MODES) + list(HALF_WIDTH_MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_plain_loop(case: str, mode: str) -> None:
    if case.startswith("hf_"):
        pytest.importorskip("transformers")
    m = {**MODES, **HALF_WIDTH_MODES}[mode]
    expected = plain_run(CASES[case], m)
    actual = engine_run(CASES[case], m)
    assert_same_training(expected, actual, rtol=m.rtol, atol=m.atol)


OFFLOAD_MODES = [name for name, m in {**MODES, **HALF_WIDTH_MODES}.items()
                 if any(key in m.config for key in ("zero_optimization", "layer_streaming"))]
CLIPPING = [name for name in OFFLOAD_MODES if {**MODES, **HALF_WIDTH_MODES}[name].clip]
OVERFLOWING = [name for name in OFFLOAD_MODES if "init_scale" in {**MODES, **HALF_WIDTH_MODES}[name].extra]


@pytest.mark.parametrize("mode", sorted(set(CLIPPING) | set(OVERFLOWING)))
def test_offload_modes_clip_and_overflow_for_real(mode: str) -> None:
    """The equivalence above proves exactness under clipping and overflow only if they
    happen: in these modes clipping scales gradients down in every model case that takes
    a step, and an fp16 step overflows and is skipped in at least one."""
    import torch

    import hybridtrain as ht
    from tests.equivalence import SEED, STEPS, engine_config

    m = {**MODES, **HALF_WIDTH_MODES}[mode]
    skipped = {}
    for name, case in CASES.items():
        if name.startswith("hf_"):
            pytest.importorskip("transformers")
        torch.manual_seed(SEED)
        engine = ht.initialize(case.build(), engine_config(m), loss_fn=case.loss_fn)
        engine.overlap_updates = bool(m.extra.get("overlap_updates"))
        torch.manual_seed(SEED + 1)
        norms = []
        for batch in case.batches(STEPS):
            engine.train_batch(batch)
            if engine.last_grad_norm is not None:
                norms.append(float(engine.last_grad_norm))
        skipped[name] = engine.skipped_steps
        if m.clip and skipped[name] < STEPS:
            assert max(norms) > m.clip, (name, norms)
    if mode in OVERFLOWING:
        assert any(skipped.values()), skipped
