"""Diagnosis rules on made-up profiles: each fires past its threshold, with the number."""

from __future__ import annotations

from typing import Any

from hybridtrain.profiling.diagnosis import diagnose


def _profile(step: float = 1.0, **parts: float) -> dict[str, Any]:
    return {"step_seconds": step, "parts": {"forward": 0.3, "backward": 0.6, **parts}}


def test_balanced_profile_has_no_findings() -> None:
    assert diagnose(_profile(device_optimizer=0.1, idle=0.0)) == []


def test_host_optimizer_share_names_its_number_and_the_fix() -> None:
    [finding] = diagnose(_profile(host_optimizer=0.41))
    assert finding.rule == "host_optimizer"
    assert finding.message == ("the host optimizer step is 41 % of the step: raise the micro-batch (more compute "
                               "per host step) or use layer_major (the host steps each block while the next one "
                               "computes)")
    [already] = diagnose({**_profile(host_optimizer=0.41), "techniques": ["layer_major"]})
    assert "layer_major" not in already.message


def test_a_host_step_nothing_hides_says_what_makes_it_wait() -> None:
    [waiting] = diagnose({**_profile(host_optimizer=0.41), "host_step_seconds": 0.4, "host_step_hidden": 0.0})
    assert waiting.message.endswith("none of it is hidden behind backward: gradient clipping, fp16 loss scaling "
                                    "and nonfinite_loss: skip make it wait for every gradient")
    [hiding] = diagnose({**_profile(host_optimizer=0.41), "host_step_seconds": 0.8, "host_step_hidden": 0.5})
    assert "none of it is hidden" not in hiding.message


def test_communication_above_20_percent() -> None:
    [finding] = diagnose(_profile(step=2.0, communication=0.54))
    assert finding.rule == "communication" and "communication is 27 % of the step (> 20 %)" in finding.message
    assert diagnose(_profile(step=2.0, communication=0.39)) == []


def test_utilisation_idle_transfer_mfu_recompute_largest_first() -> None:
    profile = {**_profile(transfer=0.25, idle=0.3), "device_utilisation": 0.55, "mfu": 0.12,
               "peak_source": "table: H100 SXM", "flops": {"forward": 10, "backward": 29}}
    rules = [f.rule for f in diagnose(profile)]
    assert rules == ["recompute", "mfu", "utilisation", "idle", "transfer"]
    messages = " | ".join(f.message for f in diagnose(profile))
    assert "device utilisation is 55 % (below 70 %)" in messages
    assert "MFU is 12 %" in messages and "backward does 2.9× the forward FLOPs" in messages
    # Layer streaming recomputes its blocks itself (its forward FLOPs are counted under
    # layer-major too): the advice names its setting, not checkpointing.
    [streamed] = [f.message for f in diagnose({**profile, "techniques": ["layer_streaming", "layer_major"]})
                  if f.rule == "recompute"]
    assert "boundary_activations: device" in streamed and "checkpoint" not in streamed
    # A measured (not tabled) peak says little about the hardware: no MFU finding.
    assert "mfu" not in [f.rule for f in diagnose({**profile, "peak_source": "measured matmul"})]
