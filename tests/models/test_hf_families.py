"""Every Hugging Face model family × every single-process technique: N steps of the engine
equal a plain PyTorch loop (fp32 rtol 1e-5; see tests/equivalence.py for the modes and
tests/models/hf_families.py for the tiny models).

The whole product (families × ``MODES``) runs at the suite's step count: one to two minutes
on two CPU cores.

``REFUSED`` lists the combinations the engine refuses, with the one-line error they must
give (a technique that cannot apply to a model says which and why, before any work).
"""

from __future__ import annotations

import pytest

import hybridtrain as ht
from tests.equivalence import MODES, STEPS, assert_same_training, engine_run, plain_run
from tests.models.hf_families import FAMILIES, available, family_case

# ---------------------------------------------------------------------------- refused
# Layer-major streaming cuts the graph at every block's output; an encoder–decoder's decoder
# blocks all read the encoder's output from outside that chain, so its graph would be
# backwarded once per decoder block.
_LAYER_MAJOR_ENC_DEC = r"layer_streaming.layer_major needs one list of blocks, but the model has .*layer_major: false"
REFUSED: dict[tuple[str, str], str] = {
    (family, mode): _LAYER_MAJOR_ENC_DEC
    for family in ("t5", "bart")
    for mode in ("stream_layer_major_accum4", "stream_layer_major_host_accum2_clip", "stream_layer_major_device_accum2")
}
# -------------------------------------------------------------------------------------------


def test_refusals_name_real_cases() -> None:
    unknown = [key for key in REFUSED if key[0] not in FAMILIES or key[1] not in MODES]
    assert not unknown, f"REFUSED entries for no family/mode: {unknown}"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_plain_loop(family: str, mode: str) -> None:
    pytest.importorskip("transformers")
    reason = available(FAMILIES[family])
    if reason:
        pytest.skip(reason)
    case = family_case(FAMILIES[family])
    m = MODES[mode]
    if (family, mode) in REFUSED:
        with pytest.raises(ht.ConfigError, match=REFUSED[family, mode]):
            engine_run(case, m, steps=1)
        return
    expected = plain_run(case, m, steps=STEPS)
    actual = engine_run(case, m, steps=STEPS)
    assert_same_training(expected, actual, rtol=m.rtol, atol=m.atol)
