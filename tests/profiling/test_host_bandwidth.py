"""The host-memory triad measures a positive, physically plausible bandwidth and refuses
sizes that measure nothing."""

from __future__ import annotations

import pytest

from hybridtrain.profiling.host_bandwidth import ADAM_BYTES_PER_PARAM, triad_bandwidth


def test_triad_is_a_plausible_dram_rate() -> None:
    rate = triad_bandwidth(4 * 2**20, repeats=2)
    # Any machine that runs torch streams more than 100 MB/s and less than 10 TB/s of DRAM.
    assert 1e8 < rate < 1e13


@pytest.mark.parametrize(("numel", "repeats"), [(0, 1), (10, 0)])
def test_triad_refuses_empty_measurements(numel: int, repeats: int) -> None:
    with pytest.raises(ValueError, match="must both be >= 1"):
        triad_bandwidth(numel, repeats)


def test_adam_bytes_are_four_reads_three_writes_of_fp32() -> None:
    assert ADAM_BYTES_PER_PARAM == (4 + 3) * 4
