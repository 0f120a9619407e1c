"""A profile's numbers (:class:`Profile`, what :mod:`~hybridtrain.profiling.profiler`
measures) and the profile as text: the step's parts, throughput against the peak, the module
table and the diagnosis, in the order a reader asks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from hybridtrain.units import format_bytes


@dataclass
class ModuleProfile:
    """One row of the module table (FLOPs and times per step, bytes per micro-batch)."""

    name: str
    kind: str
    params: int
    forward_flops: int
    backward_flops: int
    saved_bytes: int
    forward_seconds: float
    backward_seconds: float


@dataclass
class Profile:
    """A profile's numbers; :meth:`to_dict` is ``profile.json``.

    Attributes:
        device / dtype: where and in what precision the steps ran.
        timed_steps: steps the times are averaged over.
        step_seconds: mean wall time of a timed step (from the profiler's step ranges).
        parts: mean seconds per part of :data:`~hybridtrain.profiling.breakdown.PARTS`
            (they add up to ``step_seconds``).
        collective_seconds: seconds per step in which a collective ran on some thread
            (gloo/NCCL work that overlaps compute included; ``parts["communication"]`` is
            what the step waited for).
        host_step_seconds: seconds per step the offloaded optimizer's host update computed,
            on whichever thread (0 without optimizer offload or layer streaming).
        host_step_hidden: share of that work hidden behind the step's other work: 1 minus
            what the step waited for it (``parts["host_optimizer"]``) over the work, at least 0.
        device_utilisation: share of the step the device computed (CUDA: kernels and
            copies; CPU: tensor ops on any thread).
        device_parts: CUDA only: seconds per step of compute kernels, ``memcpy`` and NCCL
            ``communication`` on the device (overlapping one another).
        flops: ``forward`` / ``backward`` / ``total`` FLOPs of one step (this process).
        achieved_tflops / peak_tflops / mfu: FLOPs per second against the peak, and
            ``peak_source`` (``table: H100 SXM`` or ``measured matmul``).
        modules: per-module rows.
        peak_live_bytes: the most tensor bytes alive on the device during the counted step;
            ``allocator_peak_bytes``: CUDA's peak allocated bytes and
            ``allocator_reserved_peak_bytes`` its peak reserved bytes, what the device's
            capacity and a memory fraction cap (None on CPU).
        diagnosis: one line per finding.
        notes: what this profile could not measure.
        files: what was written (name → path).
    """

    device: str
    dtype: str
    timed_steps: int
    step_seconds: float
    parts: dict[str, float]
    collective_seconds: float
    device_utilisation: float
    flops: dict[str, int]
    achieved_tflops: float
    peak_tflops: float
    peak_source: str
    mfu: float
    modules: list[ModuleProfile]
    peak_live_bytes: int
    allocator_peak_bytes: int | None = None
    allocator_reserved_peak_bytes: int | None = None
    device_parts: dict[str, float] | None = None
    stream_parts: dict[str, float] | None = None
    """Seconds per timed step of the marked stream work (:mod:`hybridtrain.runtime.stream_marks`):
    ``uploads``, ``downloads``, ``recomputation`` — CUDA timing events on the stream that ran
    them, wall clock on a CPU device; the same figures as the offload benchmark's ``timeline``."""
    host_step_seconds: float = 0.0
    host_step_hidden: float = 0.0
    techniques: list[str] = field(default_factory=list)
    diagnosis: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return asdict(self)

    def table(self) -> str:
        """The profile as a readable text table (:func:`format_profile`)."""
        return format_profile(self)


def hidden_share(work: float, waited: float) -> float:
    """Share of ``work`` seconds done in the background: 1 − ``waited`` / ``work``, in [0, 1]
    (0 when there was no work). The waits also hold copies and hand-offs, so this is a
    lower bound."""
    return min(1.0, max(0.0, 1.0 - waited / work)) if work > 0 else 0.0


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
    if profile.host_step_seconds > 0:
        lines.append(f"  host optimizer step: {_ms(profile.host_step_seconds)} of work, "
                     f"{_ms(profile.parts.get('host_optimizer', 0.0))} waited for: "
                     f"{100 * profile.host_step_hidden:.0f} % hidden behind the step's other work")
    if profile.stream_parts:
        lines.append("  on their streams: " + ", ".join(f"{kind} {_ms(seconds)}"
                                                       for kind, seconds in profile.stream_parts.items()))
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
