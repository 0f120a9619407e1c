"""What a measured profile says to do: a few rules, each with its threshold and its numbers.

A pure function of the profile's numbers (the ``profile.json`` dict), so every rule is
tested on made-up profiles. The thresholds are the ones users quote: communication above
20 % of the step and device utilisation below 70 % (our source document's), a host
optimizer or transfers taking a quarter / a fifth of the step (ZeRO-Offload's own
measurements put a well-overlapped host step under ~10 %).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HOST_OPTIMIZER_SHARE = 0.25
NOTHING_HIDDEN = 0.05
"""Below this share of the host step hidden, it is said to wait for every gradient."""
COMMUNICATION_SHARE = 0.20
TRANSFER_SHARE = 0.20
IDLE_SHARE = 0.20
UTILISATION = 0.70
MFU = 0.30
RECOMPUTE_RATIO = 2.6
"""Backward FLOPs over forward FLOPs above which backward recomputes forwards (2 without
recomputation; 3 when every block is recomputed)."""


@dataclass(frozen=True)
class Finding:
    """One rule that fired.

    Attributes:
        rule: its name (``host_optimizer``, ``communication``, ``transfer``, ``idle``,
            ``utilisation``, ``mfu``, ``recompute``).
        share: the measured figure that fired it (a fraction).
        message: one line with the number and what to do.
    """

    rule: str
    share: float
    message: str


def _pct(value: float) -> str:
    return f"{100 * value:.0f} %"


def diagnose(profile: dict[str, Any]) -> list[Finding]:
    """The findings of a profile, the largest share first.

    Args:
        profile: at least ``step_seconds`` and ``parts`` (seconds per part); optional
            ``device_utilisation``, ``mfu`` with ``peak_source``, ``flops``
            (``forward``/``backward``), ``techniques`` (names in use, e.g. ``layer_major``).

    Returns:
        Findings; empty when nothing passes its threshold.
    """
    step = float(profile["step_seconds"])
    parts: dict[str, float] = profile["parts"]
    share = {name: (seconds / step if step > 0 else 0.0) for name, seconds in parts.items()}
    using = set(profile.get("techniques", ()))
    found: list[Finding] = []
    host = share.get("host_optimizer", 0.0)
    if host > HOST_OPTIMIZER_SHARE:
        advice = "raise the micro-batch (more compute per host step)"
        if "layer_major" not in using:
            advice += " or use layer_major (the host steps each block while the next one computes)"
        work, hidden = float(profile.get("host_step_seconds") or 0.0), float(profile.get("host_step_hidden") or 0.0)
        if work > 0 and hidden < NOTHING_HIDDEN:
            advice += ("; none of it is hidden behind backward: gradient clipping, fp16 loss scaling and "
                       "nonfinite_loss: skip make it wait for every gradient")
            if "optimizer_offload" in using and "overlapped_updates" not in using:
                advice += (" (set engine.overlap_updates = True, as hybridtrain train does, to update "
                           "while the next forward starts)")
        found.append(Finding("host_optimizer", host, f"the host optimizer step is {_pct(host)} of the step: {advice}"))
    comm = share.get("communication", 0.0)
    if comm > COMMUNICATION_SHARE:
        found.append(Finding("communication", comm, f"communication is {_pct(comm)} of the step (> 20 %): raise "
                             "gradient_accumulation_steps (one gradient exchange per step), compress gradients "
                             "(data_parallel.gradient_compression) or use a lower ZeRO stage"))
    moved = share.get("transfer", 0.0)
    if moved > TRANSFER_SHARE:
        found.append(Finding("transfer", moved, f"host↔device transfer is {_pct(moved)} of the step (> 20 %): raise "
                             "the micro-batch, prefetch more blocks, or swap / stream fewer blocks"))
    idle = share.get("idle", 0.0)
    if idle > IDLE_SHARE:
        found.append(Finding("idle", idle, f"{_pct(idle)} of the step is outside forward, backward, optimizer, "
                             "transfers and communication (the engine's bookkeeping, waiting): raise the micro-batch"))
    utilisation = profile.get("device_utilisation")
    if utilisation is not None and utilisation < UTILISATION:
        found.append(Finding("utilisation", 1.0 - float(utilisation),
                             f"device utilisation is {_pct(float(utilisation))} (below 70 %): the device waits for "
                             "the host; raise the micro-batch or move less per step"))
    mfu = profile.get("mfu")
    if mfu is not None and str(profile.get("peak_source", "")).startswith("table") and mfu < MFU:
        found.append(Finding("mfu", 1.0 - float(mfu), f"MFU is {_pct(float(mfu))} of the device's dense peak "
                             f"(below {_pct(MFU)}): see the parts above for where the time goes"))
    flops = profile.get("flops") or {}
    forward, backward = float(flops.get("forward", 0)), float(flops.get("backward", 0))
    if forward > 0 and backward / forward > RECOMPUTE_RATIO:
        ratio = backward / forward
        cause = ("layer streaming recomputes each block in backward; set layer_streaming.boundary_activations: "
                 "device (keep the activations) if memory allows" if "layer_streaming" in using else
                 "activation checkpointing recomputes forwards; checkpoint fewer blocks if memory allows")
        found.append(Finding("recompute", ratio / 3.0, f"backward does {ratio:.1f}× the forward FLOPs (2× without "
                             f"recomputation): {cause}"))
    return sorted(found, key=lambda f: -f.share)
