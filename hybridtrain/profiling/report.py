"""A profile as text: the step's parts, throughput against the peak, the module table and
the diagnosis, in the order a reader asks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridtrain.runtime.memory_limit import format_bytes

if TYPE_CHECKING:
    from hybridtrain.profiling.profiler import Profile


def _flops(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} "


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def format_profile(profile: Profile) -> str:
    """The readable table ``hybridtrain profile`` prints."""
    step = profile.step_seconds
    lines = [f"profile: {profile.device}, {profile.dtype}, step {_ms(step)} "
             f"(mean of {profile.timed_steps} timed step{'s' if profile.timed_steps > 1 else ''})", ""]
    lines.append(f"  {'part':<18}{'time':>12}{'share':>9}")
    for name, seconds in profile.parts.items():
        share = seconds / step if step > 0 else 0.0
        lines.append(f"  {name:<18}{_ms(seconds):>12}{100 * share:>8.1f}%")
    lines.append(f"  collectives running (on any thread, overlapped ones too): {_ms(profile.collective_seconds)}; "
                 f"device utilisation {100 * profile.device_utilisation:.0f} %")
    if profile.device_parts:
        lines.append("  on the device: " + ", ".join(f"{kind} {_ms(seconds)}"
                                                    for kind, seconds in profile.device_parts.items()))
    lines.append("")
    flops = profile.flops
    lines.append(f"  FLOPs per step: forward {_flops(flops['forward'])}, backward {_flops(flops['backward'])} "
                 f"({flops['backward'] / flops['forward']:.2f}× forward)" if flops["forward"] else
                 f"  FLOPs per step: forward {_flops(flops['forward'])}, backward {_flops(flops['backward'])}")
    lines.append(f"  achieved {_flops(profile.achieved_tflops * 1e12)}FLOP/s of {_flops(profile.peak_tflops * 1e12)}"
                 f"FLOP/s peak ({profile.peak_source}): MFU {100 * profile.mfu:.1f} %")
    memory = f"  peak live tensor bytes {format_bytes(profile.peak_live_bytes)}"
    if profile.allocator_peak_bytes is not None:
        memory += f", CUDA peak allocated {format_bytes(profile.allocator_peak_bytes)}"
    if profile.allocator_reserved_peak_bytes is not None:
        memory += f", peak reserved {format_bytes(profile.allocator_reserved_peak_bytes)}"
    lines += [memory, ""]
    header = f"  {'module':<28}{'kind':<10}{'params':>11}{'fwd FLOPs':>12}{'bwd FLOPs':>12}" \
             f"{'saved act.':>12}{'fwd time':>11}{'bwd time':>11}"
    lines.append(header)
    for m in profile.modules:
        lines.append(f"  {m.name[:27]:<28}{m.kind:<10}{m.params:>11,}{_flops(m.forward_flops):>12}"
                     f"{_flops(m.backward_flops):>12}{format_bytes(m.saved_bytes):>12}"
                     f"{_ms(m.forward_seconds):>11}{_ms(m.backward_seconds):>11}")
    lines.append("")
    lines.append("diagnosis:" if profile.diagnosis else "diagnosis: no part passes its threshold")
    lines += [f"  - {line}" for line in profile.diagnosis]
    lines += [f"note: {line}" for line in profile.notes]
    if profile.files:
        lines.append("files: " + ", ".join(profile.files.values()))
    return "\n".join(lines)
