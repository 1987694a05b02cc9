"""runtime/calibrate.py, R18: all-gathers over ranks started on this machine (gloo), fitted to
``latency + S (N - 1) / N / bandwidth``."""

from __future__ import annotations

import pytest

from swapsched.errors import UserError
from swapsched.runtime.calibrate import COLLECTIVE_SIZES, calibrate_collectives, measure_collectives


@pytest.mark.timeout(120)
def test_two_ranks_time_their_all_gathers_and_the_fit_reads_them():
    latency, bandwidth, points = measure_collectives(2)
    # each rank receives the other's half of every size: S (N - 1) / N bytes
    assert [b for b, _ in points] == [s // 2 for s in COLLECTIVE_SIZES]
    assert all(t > 0 for _, t in points) and points[-1][1] > points[0][1]  # more bytes, more time
    assert latency >= 0 and 1e6 < bandwidth < 1e12
    # the fit reads the largest gather within a factor of two (its bytes dominate its time)
    b, t = points[-1]
    assert t / 2 < latency + b / bandwidth < 2 * t


def test_without_a_process_group_it_says_how_to_get_one():
    with pytest.raises(UserError, match="--world-size N"):
        calibrate_collectives()
