"""Preemption: which running jobs give their devices up to a higher-priority queued job.

A queued job that does not fit on the free slots, and would fit if some running jobs of
lower priority stopped, preempts the fewest of them, the lowest priority first. They get
SIGTERM (a trainer saves a checkpoint and exits 130), wait as ``preempted`` and resume
from that checkpoint when devices free up. :func:`choose_preemptions` decides (a pure
function of the queue and the holders); the scheduler applies it.

    >>> holders = [Holder("a", 1, 0, True, 1.0), Holder("b", 1, 0, True, 2.0)]
    >>> choose_preemptions([Want("urgent", 1, 5, 3.0)], holders, free=0, now=4.0)
    [('b', 'urgent')]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridtrain.service.devices import Shares, Want, start_order


@dataclass(frozen=True)
class Holder:
    """A running job as the preemption decision sees it.

    Attributes:
        name: the job's name.
        devices: slots it holds.
        priority: its submitted priority (waiting raised it while queued; running, it
            counts as submitted, so a job that waited long is not safe forever).
        preemptible: whether it may be preempted (spec ``preemptible``).
        started_at: when its attempt started (of equals, the latest started loses the
            least work).
        stopping: it is being stopped already (cancel or preemption sent): its slots free
            up soon and it is not chosen again.
    """

    name: str
    devices: int
    priority: int
    preemptible: bool
    started_at: float
    stopping: bool = False


def _fewest(candidates: list[Holder], needed: int) -> list[Holder]:
    """The fewest of ``candidates`` (lowest priority first) freeing ``needed`` slots, or
    ``[]`` when all of them together free fewer."""
    if sum(h.devices for h in candidates) < needed:
        return []
    # Lowest priority first; within a priority the biggest first (fewer jobs stopped),
    # then the latest started (least work lost).
    ordered = sorted(candidates, key=lambda h: (h.priority, -h.devices, -h.started_at, h.name))
    chosen: list[Holder] = []
    for holder in ordered:
        if sum(h.devices for h in chosen) >= needed:
            break
        chosen.append(holder)
    # A big job taken late may make earlier small ones unnecessary: drop those, the
    # highest priority first.
    for holder in sorted(chosen, key=lambda h: (-h.priority, h.devices)):
        if sum(h.devices for h in chosen) - holder.devices >= needed:
            chosen.remove(holder)
    return chosen


def choose_preemptions(queued: Sequence[Want], holders: Sequence[Holder], free: int,
                       now: float, aging_s: float = 300.0, shares: Shares | None = None
                       ) -> list[tuple[str, str]]:
    """The running jobs to preempt now.

    The queue is walked in start order (:func:`~hybridtrain.service.devices.start_order`);
    a job that fits on the slots left takes them, one that does not preempts the fewest
    preemptible holders of lower priority (its submitted priority against theirs) that
    make it fit, if any do. Slots of holders already stopping count as free (they are
    not stopped twice).

    Args:
        queued: the waiting jobs (queued or preempted).
        holders: the running jobs that hold slots of this machine.
        free: slots free now.
        now: the time (``time.time()``).
        aging_s: seconds of waiting worth one priority level (start order only).
        shares: devices each user holds and the quotas: a job its user's quota holds back
            preempts nobody.

    Returns:
        ``(holder, waiting job it makes room for)`` for each holder to preempt.
    """
    pool = free + sum(h.devices for h in holders if h.stopping)
    left = [h for h in holders if not h.stopping and h.preemptible and h.devices > 0]
    preempt: list[tuple[str, str]] = []
    shares = (shares or Shares()).copy()
    for want in start_order(queued, now, aging_s, shares):
        if not shares.allows(want):
            continue
        if want.devices <= pool:
            pool -= want.devices
            shares.take(want)
            continue
        chosen = _fewest([h for h in left if h.priority < want.priority], want.devices - pool)
        if not chosen:
            continue
        shares.take(want)
        preempt += [(h.name, want.name) for h in chosen]
        left = [h for h in left if h not in chosen]
        pool += sum(h.devices for h in chosen) - want.devices
    return preempt
