"""The step-part hook: nothing without a clock, innermost part counts, other threads ignored."""

from __future__ import annotations

import threading
import time

from hybridtrain.runtime.step_parts import PartClock, step_part


def test_nothing_is_measured_without_a_running_clock() -> None:
    clock = PartClock()
    with step_part("transfer"):
        pass
    assert dict(clock.seconds) == {}


def test_nested_parts_count_once_in_the_innermost() -> None:
    switches: list[tuple[str | None, str | None]] = []
    clock = PartClock(on_switch=lambda left: switches.append((left, clock.current)))
    start = time.perf_counter()
    with clock.running(), step_part("backward"):
        time.sleep(0.02)
        with step_part("communication"):
            time.sleep(0.03)
        time.sleep(0.01)
    wall = time.perf_counter() - start
    # Each part holds at least its own sleeps, and together no more than the wall time:
    # the nested part's seconds are not also the outer part's.
    assert clock.seconds["communication"] >= 0.03 and clock.seconds["backward"] >= 0.03
    assert clock.seconds["backward"] + clock.seconds["communication"] <= wall
    assert switches == [(None, "backward"), ("backward", "communication"), ("communication", "backward"),
                        ("backward", None)]


def test_other_threads_do_not_report_to_the_clock() -> None:
    clock = PartClock()

    def elsewhere() -> None:
        with step_part("host_optimizer"):
            time.sleep(0.01)

    with clock.running():
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
    assert "host_optimizer" not in clock.seconds
