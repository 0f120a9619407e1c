"""Fair share among users and per-user device quotas in the start order (pure decisions)."""

from __future__ import annotations

from hybridtrain.service.devices import Shares, Want, plan_starts, start_order
from hybridtrain.service.preemption import Holder, choose_preemptions

NOW = 1000.0


def test_within_a_priority_the_user_holding_fewer_devices_goes_first() -> None:
    queued = [Want("alice-old", 1, 0, NOW - 50, "alice"), Want("bob-new", 1, 0, NOW - 1, "bob")]
    # Alone, the older job goes first; with alice holding two devices already, bob's does.
    assert plan_starts(queued, [0], NOW) == [("alice-old", (0,))]
    assert plan_starts(queued, [0], NOW, shares=Shares({"alice": 2})) == [("bob-new", (0,))]


def test_jobs_started_in_one_pass_count_toward_their_users_share() -> None:
    queued = [Want("a1", 1, 0, NOW - 30, "alice"), Want("a2", 1, 0, NOW - 20, "alice"),
              Want("b1", 1, 0, NOW - 10, "bob")]
    assert [w.name for w in start_order(queued, NOW)] == ["a1", "b1", "a2"]
    assert plan_starts(queued, [0, 1], NOW) == [("a1", (0,)), ("b1", (1,))]


def test_priority_levels_still_come_before_the_share() -> None:
    queued = [Want("bob-low", 1, 0, NOW - 50, "bob"), Want("alice-high", 1, 5, NOW, "alice")]
    assert plan_starts(queued, [0], NOW, shares=Shares({"alice": 3})) == [("alice-high", (0,))]


def test_a_quota_holds_back_its_users_jobs_and_no_one_elses() -> None:
    shares = Shares({"alice": 1}, quotas={"alice": 2})
    queued = [Want("a-big", 2, 0, NOW - 900, "alice"), Want("a-one", 1, 0, NOW - 800, "alice"),
              Want("b-one", 1, 0, NOW - 1, "bob")]
    # a-big would hold 3 > 2: it waits, and though it waited past reserve_after_s it does
    # not reserve the slots (its own quota blocks it, not the free devices).
    assert plan_starts(queued, [0, 1, 2], NOW, shares=shares) == [("a-one", (0,)), ("b-one", (1,))]
    assert shares.held == {"alice": 1}  # the caller's counts are not changed by planning
    assert plan_starts(queued, [0, 1], NOW, shares=Shares({"alice": 2}, {"alice": 2})) == [
        ("b-one", (0,))]


def test_a_job_its_quota_holds_back_preempts_nobody() -> None:
    holders = [Holder("low", 1, 0, True, 1.0)]
    urgent = [Want("urgent", 1, 5, NOW, "alice")]
    assert choose_preemptions(urgent, holders, 0, NOW) == [("low", "urgent")]
    capped = Shares({"alice": 1}, quotas={"alice": 1})
    assert choose_preemptions(urgent, holders, 0, NOW, shares=capped) == []
