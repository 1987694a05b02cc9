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
    assert latency >= 0 and 1e6 < bandwidth < 1e12  # timings on a shared machine: only their sense


def test_the_fit_reads_latency_and_bandwidth_off_exact_points():
    from swapsched.runtime.calibrate import _fit

    # 0.5 ms plus 1 GB/s, every size exact: the fit returns both
    points = [(b, 5e-4 + b / 1e9) for b in (2**19, 2**21, 2**23, 2**25)]
    latency, bandwidth = _fit(points)
    assert latency == pytest.approx(5e-4, rel=1e-6) and bandwidth == pytest.approx(1e9, rel=1e-6)


def test_without_a_process_group_it_says_how_to_get_one():
    with pytest.raises(UserError, match="--world-size N"):
        calibrate_collectives()
