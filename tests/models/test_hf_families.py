"""Every Hugging Face model family × the single-process techniques: the engine equals the
plain loop (see tests/equivalence.py and tests/models/hf_families.py)."""

from __future__ import annotations

import pytest

from tests.equivalence import MODES, assert_same_training, engine_run, plain_run
from tests.models.hf_families import FAMILIES, available, family_case

STEPS = 2

@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_plain_loop(family: str, mode: str) -> None:
    pytest.importorskip("transformers")
    fam = FAMILIES[family]
    reason = available(fam)
    if reason:
        pytest.skip(reason)
    case = family_case(fam)
    m = MODES[mode]
    expected = plain_run(case, m, steps=STEPS)
    actual = engine_run(case, m, steps=STEPS)
    assert_same_training(expected, actual, rtol=m.rtol, atol=m.atol)
