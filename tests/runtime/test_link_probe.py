"""runtime/link_probe.py: what copies in flight take of the compute, by hand and against busy work."""

from __future__ import annotations

import time

import pytest

from swapsched.runtime.backends import CpuBackend
from swapsched.runtime.link_probe import copy_interference, interference_costs


def test_interference_costs_by_hand():
    # 40 copies of 1 KB add 0.1 s, of 101 KB 0.5 s: 10 ms per 100 KB, so 0.1 us per byte; at 1 KB
    # 2.5 ms a copy, less 0.1 ms for its bytes: 2.4 ms per copy
    per_copy, per_byte = interference_costs(1.0, (1.1, 1.5), 40, (1_000, 101_000))
    assert per_copy == pytest.approx(2.4e-3) and per_byte == pytest.approx(1e-7)
    # noise that makes the copies look free, or larger copies cheaper: 0, never negative
    assert interference_costs(1.0, (0.9, 0.95), 40, (1_000, 101_000)) == (0.0, 0.0)
    assert interference_costs(1.0, (1.4, 1.2), 40, (1_000, 101_000)) == (pytest.approx(0.01), 0.0)


@pytest.mark.slow  # timed: the microbenchmark against busy work of a known length
def test_copy_interference_is_what_copies_in_flight_take_of_the_compute_per_copy_and_per_byte():
    # an engine that also takes the compute thread itself, 300 us per copy and 1 ns per byte of
    # busy work in the caller: the microbenchmark finds them again, beyond what the same engine
    # costs without them
    class Busy(CpuBackend):
        def copy_out(self, src):
            end = time.perf_counter() + 300e-6 + src.numel() * 1e-9
            while time.perf_counter() < end:
                pass
            return super().copy_out(src)

    plain, busy = CpuBackend(), Busy()
    try:
        base_copy, base_byte = copy_interference(plain, rounds=7)
        per_copy, per_byte = copy_interference(busy, rounds=7)
        assert per_copy - base_copy == pytest.approx(300e-6, rel=0.25) and per_byte - base_byte == pytest.approx(1e-9, rel=0.25)
    finally:
        plain.shutdown()
        busy.shutdown()
