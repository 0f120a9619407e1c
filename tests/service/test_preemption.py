"""The preemption decision: which running jobs a queued job of higher priority stops."""

from __future__ import annotations

from hybridtrain.service.devices import Want
from hybridtrain.service.preemption import Holder, choose_preemptions


def _preempted(queued: list[Want], holders: list[Holder], free: int) -> list[str]:
    return sorted(name for name, _ in choose_preemptions(queued, holders, free, now=1.0))


def _holder(name: str, devices: int = 1, priority: int = 0, preemptible: bool = True,
            started_at: float = 0.0, stopping: bool = False) -> Holder:
    return Holder(name, devices, priority, preemptible, started_at, stopping)


def test_a_job_that_fits_preempts_nothing() -> None:
    assert _preempted([Want("urgent", 1, 9, 0.0)], [_holder("low")], free=1) == []


def test_the_fewest_lowest_priority_holders_are_preempted() -> None:
    holders = [_holder("p0-old", priority=0, started_at=1.0),
               _holder("p0-new", priority=0, started_at=2.0),
               _holder("p1", priority=1), _holder("p3-big", devices=2, priority=3)]
    # Two slots needed: both priority-0 jobs, not the priority-1 one.
    assert _preempted([Want("urgent", 2, 5, 0.0)], holders, 0) == ["p0-new", "p0-old"]
    # One slot needed: the latest started of the lowest priority loses the least work.
    assert _preempted([Want("urgent", 1, 5, 0.0)], holders, 0) == ["p0-new"]
    # One big holder beats several small ones of the same priority.
    same = [_holder("a"), _holder("b"), _holder("big", devices=2)]
    assert _preempted([Want("urgent", 2, 5, 0.0)], same, 0) == ["big"]


def test_equal_priority_unpreemptible_and_too_few_are_left_alone() -> None:
    assert _preempted([Want("peer", 1, 0, 0.0)], [_holder("low")], 0) == []
    keep = [_holder("keep", preemptible=False), _holder("low")]
    assert _preempted([Want("urgent", 1, 5, 0.0)], keep, 0) == ["low"]
    # Preempting every lower-priority job would still not make room: nothing is stopped.
    assert _preempted([Want("urgent", 2, 5, 0.0)], keep, 0) == []


def test_slots_already_freeing_count_and_each_want_gets_its_own() -> None:
    stopping = [_holder("going", stopping=True), _holder("low")]
    assert _preempted([Want("urgent", 1, 5, 0.0)], stopping, 0) == []
    two = [Want("u1", 1, 5, 0.0), Want("u2", 1, 4, 0.0), Want("lower", 1, -1, 0.0)]
    holders = [_holder("a"), _holder("b"), _holder("c", priority=4)]
    assert sorted(choose_preemptions(two, holders, 0, 1.0)) == [("a", "u1"), ("b", "u2")]
