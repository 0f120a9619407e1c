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
