"""Devices as slots, and which queued jobs start next (gang, priority, no starvation).

The machine's devices are numbered slots: its GPUs (a job's ranks see them through
``CUDA_VISIBLE_DEVICES``), or on a machine without GPUs its CPU cores (the job's processes
are pinned to them and ``OMP_NUM_THREADS`` is set to their number). A job starts only
when *all* the slots it asks for are free (gang allocation: no rank waits on a peer that
has no device).

Order: the highest *effective* priority level first. Waiting raises a job's effective
priority by one level every ``aging_s`` seconds, so a stream of high-priority jobs cannot
starve a low one forever. Within a level, users share fairly: the job of the user holding
the fewest devices goes first (counting the jobs started in the same pass), then the
oldest. A user's device quota caps what their running jobs hold together: a job that would
pass it waits, without holding anyone else back (:class:`Shares`). A job that does not fit is skipped and
smaller jobs behind it may start on the free slots (backfill), so small jobs do not wait
behind a big one; but once the blocked job has waited ``reserve_after_s`` seconds it
reserves: nothing behind it starts until it has run, so the big job is not starved either.

    >>> plan_starts([Want("big", 4, 0, 0.0), Want("small", 1, 0, 1.0)], free=[0, 1], now=2.0)
    [('small', (0,))]
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: Overrides the detected slots: ``"gpu:0,1,2,3"``, ``"cpu:0-7"`` or a count ``"cpu:8"``.
DEVICES_ENV = "HYBRIDTRAIN_SERVICE_DEVICES"


@dataclass(frozen=True)
class Slots:
    """The devices the service hands out: ``kind`` ``gpu`` or ``cpu`` and their ids."""

    kind: str
    ids: tuple[int, ...]


def detect_slots() -> Slots:
    """This machine's slots: ``$HYBRIDTRAIN_SERVICE_DEVICES``, else its GPUs, else the CPU
    cores this process may run on.

    With ``CUDA_VISIBLE_DEVICES`` set, its ids are the slots (a job's own
    ``CUDA_VISIBLE_DEVICES`` replaces the service's, so it names physical ids).

    Raises:
        ValueError: the variable is malformed (one line with the allowed forms).
    """
    text = os.environ.get(DEVICES_ENV, "").strip()
    if text:
        return parse_slots(text)
    gpus = _nvidia_gpus()
    if gpus:
        return Slots("gpu", gpus)
    return Slots("cpu", tuple(sorted(os.sched_getaffinity(0))))


def _nvidia_gpus() -> tuple[int, ...]:
    """GPU ids this process may use, without importing torch (seconds that every HPO
    controller would pay): ``CUDA_VISIBLE_DEVICES`` when set (numeric ids), else as many as
    the NVIDIA driver lists in ``/proc``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        ids = ids[:ids.index("-1")] if "-1" in ids else ids
        if not all(v.isdigit() for v in ids):
            raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r}: the service needs numeric GPU "
                             f"ids; set {DEVICES_ENV}=gpu:0,1,… instead")
        return tuple(int(v) for v in ids)
    try:
        return tuple(range(len(os.listdir("/proc/driver/nvidia/gpus"))))
    except OSError:
        return ()


def parse_slots(text: str) -> Slots:
    """Parse ``KIND:IDS`` (``gpu:0,1``, ``cpu:0-7``, ``cpu:4`` = four cores 0-3)."""
    kind, _, ids = text.partition(":")
    allowed = f"{DEVICES_ENV}={text!r}: use gpu:0,1,2 or cpu:0-7 or cpu:8"
    if kind not in ("gpu", "cpu") or not ids:
        raise ValueError(allowed)
    out: list[int] = []
    try:
        if "," not in ids and "-" not in ids:
            out = list(range(int(ids)))
        else:
            for part in ids.split(","):
                lo, _, hi = part.partition("-")
                out += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(allowed) from None
    if not out or min(out) < 0:
        raise ValueError(allowed)
    return Slots(kind, tuple(sorted(set(out))))


@dataclass(frozen=True)
class Want:
    """A queued job as the planner sees it (``user``: who submitted it; ``""`` for the
    service's own administrator)."""

    name: str
    devices: int
    priority: int
    queued_at: float
    user: str = ""


@dataclass
class Shares:
    """Devices each user holds, and their quotas: what fair-share order and quotas read.

    Attributes:
        held: devices each user's running jobs hold now (the scheduler counts them).
        quotas: the most devices a user's jobs may hold together; a user missing here
            has no quota.
    """

    held: dict[str, int] = field(default_factory=dict)
    quotas: Mapping[str, int] = field(default_factory=dict)

    def allows(self, want: Want) -> bool:
        """Whether ``want`` may start without its user passing their quota."""
        quota = self.quotas.get(want.user)
        return quota is None or self.held.get(want.user, 0) + want.devices <= quota

    def take(self, want: Want) -> None:
        """Count ``want``'s devices as its user's (it starts, or is placed first)."""
        self.held[want.user] = self.held.get(want.user, 0) + want.devices

    def copy(self) -> Shares:
        """A copy to plan with (the scheduler's own counts stay as they are)."""
        return Shares(dict(self.held), self.quotas)


def effective_priority(want: Want, now: float, aging_s: float) -> float:
    """Priority plus one per ``aging_s`` seconds waited."""
    return want.priority + max(0.0, now - want.queued_at) / aging_s


def _order_key(want: Want, now: float, aging_s: float, shares: Shares
               ) -> tuple[float, int, float, str]:
    """Start-order key: the effective priority's level, then the user's held devices,
    then the oldest, then the name (a total order: the same queue always plans alike)."""
    level = math.floor(effective_priority(want, now, aging_s))
    return (-level, shares.held.get(want.user, 0), want.queued_at, want.name)


def start_order(queued: Sequence[Want], now: float, aging_s: float = 300.0,
                shares: Shares | None = None) -> list[Want]:
    """The queue in the order jobs are considered for starting (see the module docstring:
    priority level, fair share among users, then the longest waiting), as if each one
    started in turn. A job that does not fit may be passed by a smaller one."""
    shares = (shares or Shares()).copy()
    left, order = list(queued), []
    while left:
        best = min(left, key=lambda w: _order_key(w, now, aging_s, shares))
        left.remove(best)
        order.append(best)
        shares.take(best)
    return order


def plan_starts(queued: Sequence[Want], free: Sequence[int], now: float,
                aging_s: float = 300.0, reserve_after_s: float = 600.0,
                shares: Shares | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """Which queued jobs start now, and on which slots (see the module docstring).

    Args:
        queued: the waiting jobs.
        free: free slot ids.
        now: the time (``time.time()``).
        aging_s: seconds of waiting worth one priority level.
        reserve_after_s: a blocked job waiting this long stops backfill behind it (a job
            held back by its own user's quota reserves nothing).
        shares: devices each user holds now, and the quotas (default: one user, no quota).

    Returns:
        ``(name, slots)`` for every job to start, in start order.
    """
    shares = (shares or Shares()).copy()
    pool = sorted(free)
    left = list(queued)
    starts: list[tuple[str, tuple[int, ...]]] = []
    while left:
        want = min(left, key=lambda w: _order_key(w, now, aging_s, shares))
        left.remove(want)
        if not shares.allows(want):
            continue
        if want.devices <= len(pool):
            taken, pool = tuple(pool[:want.devices]), pool[want.devices:]
            starts.append((want.name, taken))
            shares.take(want)
        elif now - want.queued_at >= reserve_after_s:
            break  # reserved: the slots that free up next are this job's
    return starts
