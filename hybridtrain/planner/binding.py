"""What binds a plan, per resource: device and host memory against what the machine has,
and the step's seconds on each resource that can hold it back (device compute, the
host⇄device link, the host optimizer step, communication) against the step.

A step can be no shorter than its busiest resource, so ``step ÷ binding resource`` says how
much of the step is lost to work that did not hide behind it (1.0: nothing exposed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridtrain.planner.estimate import Estimate
from hybridtrain.units import format_bytes


@dataclass(frozen=True)
class MemoryUse:
    """Bytes one memory must hold against what it has.

    Attributes:
        resource: ``device memory`` or ``host memory``.
        needs: bytes the plan holds there.
        has: bytes available to it (the device's less the planner's margin); None: unlimited.
    """

    resource: str
    needs: int
    has: int | None

    @property
    def over(self) -> int:
        """Bytes beyond what it has (0 when it fits or is unlimited)."""
        return 0 if self.has is None else max(0, self.needs - self.has)

    def describe(self) -> str:
        """``host memory: needs 215 GiB, has 125 GiB: over by 90 GiB (1.72x)`` or ``… (58 % used)``."""
        if self.has is None:
            return f"{self.resource}: needs {format_bytes(self.needs)} (not limited)"
        head = f"{self.resource}: needs {format_bytes(self.needs)}, has {format_bytes(self.has)}"
        if self.over:
            return f"{head}: over by {format_bytes(self.over)} ({self.needs / self.has:.2f}x)"
        return f"{head} ({self.needs / self.has:.0%} used)"


@dataclass(frozen=True)
class TimeUse:
    """Seconds of one step's work on one resource.

    Attributes:
        resource: ``device compute``, ``host<->device link``, ``host optimizer step`` or
            ``communication``.
        seconds: busy time of that resource in one step.
        exposed: the part no other work hides (what it adds beyond device compute).
    """

    resource: str
    seconds: float
    exposed: float


def memory_uses(est: Estimate, margin: float) -> list[MemoryUse]:
    """Device and host memory of ``est`` against its target (the device less ``margin``)."""
    device = est.target.memory_bytes
    return [MemoryUse("device memory", est.device_peak_bytes, None if device is None else int(device * (1 - margin))),
            MemoryUse("host memory", est.host_bytes, est.target.host_memory_bytes)]


def time_uses(est: Estimate) -> list[TimeUse]:
    """The step's seconds per resource, busiest first (device compute counts recomputation,
    the device optimizer step and the pipeline bubble: the device runs them all in turn)."""
    t = est.time
    compute = t.compute + t.recompute + t.optimizer + t.bubble
    uses = [TimeUse("device compute", compute, compute),
            TimeUse("host<->device link", t.transfers, t.transfers_exposed),
            TimeUse("host optimizer step", t.host_step, t.host_step_exposed),
            TimeUse("communication", t.communication, t.communication_exposed)]
    return sorted((u for u in uses if u.seconds > 0), key=lambda u: -u.seconds)


def binding_report(est: Estimate, margin: float) -> list[str]:
    """Lines for ``hybridtrain plan``: what binds the step and by how much, then each
    resource's seconds and each memory's use."""
    uses = time_uses(est)
    total = est.step_seconds
    lines = []
    if uses:
        top = uses[0]
        lines.append(f"binds: {top.resource}, {top.seconds:.3g} s of the {total:.3g} s step "
                     f"(step = {total / top.seconds:.2f}x its binding resource)")
        for use in uses:
            if use.resource == "device compute":
                lines.append(f"  device compute: {use.seconds:.3g} s (recomputation, device optimizer step included)")
                continue
            lines.append(f"  {use.resource}: {use.seconds:.3g} s, {use.exposed:.3g} s of it exposed"
                         f"{' (added to the step: no device work hides it)' if use.exposed > 0.005 * total else ''}")
    lines += [f"  {use.describe()}" for use in memory_uses(est, margin)]
    return lines


def least_needs(estimates: Sequence[tuple[str, Estimate]], margin: float) -> list[str]:
    """When no variant fits, which memory binds and by how much: for each memory, the least
    of it any variant needs among those that fit the *other* memory (the trade-off the
    search could not make), naming the variant (``estimates`` pairs its words and estimate)."""
    lines = []
    names = ("device memory", "host memory")
    for index, resource in enumerate(names):
        other = 1 - index
        fitting = [(words, est) for words, est in estimates if not memory_uses(est, margin)[other].over]
        if not fitting:
            lines.append(f"{resource}: no variant fits the {names[other]} either")
            continue
        words, best = min(fitting, key=lambda pair: memory_uses(pair[1], margin)[index].needs)
        use = memory_uses(best, margin)[index]
        if not use.over:
            continue
        lines.append(f"{resource} binds: of the variants that fit the {names[other]}, the least needs "
                     f"{use.describe().removeprefix(resource + ': needs ')} ({words})")
    return lines
