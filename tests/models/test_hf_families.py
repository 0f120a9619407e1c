"""Every Hugging Face model family × every single-process technique: N steps of the engine
equal a plain PyTorch loop (fp32 rtol 1e-5; see tests/equivalence.py for the modes and
tests/models/hf_families.py for the tiny models).

The whole product (families × ``MODES``) runs at the suite's step count: one to two minutes
on two CPU cores. Families added for one failure class of ``scripts/hf_family_sweep.py``
run only the modes that exercise it (``Family.modes``).

Modes without autocast train the models in float64. The engine changes the order in which
some gradient contributions are added (micro-batches, recomputed blocks, an encoder output read
by every decoder layer); Adam divides each element by its running RMS, so for an element whose
gradient is near zero fp32 rounding of that order becomes a parameter difference of 1e-5
relative or more, on some CPUs and not others (T5 under checkpointing, Qwen3 under 8-way
accumulation). In float64 the same runs agree to about 1e-14, and the suite's tolerance still
catches any difference in the math. Autocast modes keep fp32 parameters (autocast leaves
float64 alone) under the tolerance derived from their precision, as do the mixture-of-experts
families (``Family.float64``); fp32 itself is covered by the model cases of
tests/test_equivalence.py.

``REFUSED`` lists the combinations the engine refuses, with the one-line error they must
give (a technique that cannot apply to a model says which and why, before any work).
"""

from __future__ import annotations

import pytest
import torch

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
    for mode in ("stream_layer_major_accum4", "stream_layer_major_host_accum2_clip", "stream_layer_major_device_accum2",
                 "stream_layer_major_host_bf16_accum2_clip", "stream_layer_major_fp16_overflow_accum2_clip")
}
# -------------------------------------------------------------------------------------------


CASES = [(family, mode) for family, f in FAMILIES.items() for mode in MODES if f.modes is None or mode in f.modes]


def test_refusals_and_family_modes_name_real_cases() -> None:
    unknown = [key for key in REFUSED if key not in CASES]
    unknown += [(f.name, m) for f in FAMILIES.values() for m in f.modes or () if m not in MODES]
    assert not unknown, f"REFUSED entries / family modes for no family × mode: {unknown}"


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_family_matches_plain_loop(family: str, mode: str) -> None:
    pytest.importorskip("transformers")
    reason = available(FAMILIES[family])
    if reason:
        pytest.skip(reason)
    m = MODES[mode]
    f = FAMILIES[family]
    case = family_case(f, torch.float64 if m.autocast_dtype is None and f.float64 else torch.float32)
    if (family, mode) in REFUSED:
        with pytest.raises(ht.ConfigError, match=REFUSED[family, mode]):
            engine_run(case, m, steps=1)
        return
    expected = plain_run(case, m, steps=STEPS)
    actual = engine_run(case, m, steps=STEPS)
    assert_same_training(expected, actual, rtol=m.rtol, atol=m.atol)
