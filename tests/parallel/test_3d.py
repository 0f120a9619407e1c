"""3D parallelism: data × tensor × pipeline (2 × 2 × 2 on 8 CPU ranks) trains like one
process. Slow on a 2-core machine, but it runs in CI."""

from __future__ import annotations

import pytest

from tests.parallel.scenarios import GroupRunner, assert_equivalent

GROUPS = {
    "three_d": (8, {
        "dp2_tp2_pp2": ("gpt_deep", {"data_parallel": {"size": 2}, "tensor_parallel": {"size": 2},
                                     "pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 2}}),
    }),
}
RUNNER = GroupRunner(GROUPS, timeout=300.0)


@pytest.mark.slow
def test_dp2_tp2_pp2_matches_single_process() -> None:
    assert_equivalent(RUNNER.find("dp2_tp2_pp2"), "gpt_deep")
