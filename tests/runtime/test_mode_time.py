"""runtime/mode_time.py: the profiling modes' own time, left out of the recorded gaps (R1)."""

from __future__ import annotations

import time

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from swapsched.runtime.mode_time import ModeTime, dispatch_entry_s
from swapsched.runtime.recorder import OpNames, TraceRecorder
from swapsched.runtime.transients import TransientMeter

SLEEP_S = 0.01


class _Slow(TorchDispatchMode):
    """A profiling mode that spends SLEEP_S of its own on every op, charged to ``timer``."""

    def __init__(self, timer: ModeTime | None) -> None:
        super().__init__()
        self.timer, self.ops = timer, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        time.sleep(SLEEP_S)
        self.ops += 1
        if self.timer is not None:
            self.timer.own_s += time.perf_counter() - t0
        return func(*args, **(kwargs or {}))


def _recorded_compute(timer: ModeTime | None) -> tuple[float, int]:
    """(seconds of compute the recorder put in the gaps and tail, ops run) of a tiny step run under
    a slow mode charged to ``timer``."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    rec = TraceRecorder("cpu", timer=timer)
    slow = _Slow(timer)
    rec.start()
    with rec.hooks(), slow:
        m(torch.randn(4, 8)).sum().backward()
    trace = rec.finish("tiny", "cpu", 0, "measured")
    return float(trace.gaps.sum() + trace.tail_compute_s), slow.ops


def test_the_modes_charged_time_is_left_out_of_the_gaps() -> None:
    uncharged, ops = _recorded_compute(None)
    assert ops >= 10 and uncharged >= ops * SLEEP_S  # every op's sleep lands in a gap
    charged, _ = _recorded_compute(ModeTime())
    # the sleeps are gone; what is left is the ops themselves and the entries' estimate: a few us
    # an op alone, 3 ms on a loaded 2-core machine (CI, session 32: 91 ms for 31 ops), still well
    # under half of what one sleep per op leaks
    assert charged < 0.5 * ops * SLEEP_S, (charged, ops)


def test_the_profiling_modes_charge_each_op_once_and_not_the_op_itself() -> None:
    timer = ModeTime()
    ops, meter = OpNames(), TransientMeter(lambda: 0)
    ops.timer = meter.timer = timer
    a = torch.randn(256, 256)
    with ops, meter:
        t0 = time.perf_counter()
        for _ in range(20):
            a = a @ a / 256
        wall = time.perf_counter() - t0
    assert timer.entries == 2 * 40  # a matmul and a division per round, one entry per mode
    # the matmuls' own time is not charged: what is, is less than the whole
    assert 0 < timer.own_s < wall


def test_entering_a_python_mode_costs_microseconds() -> None:
    entry = dispatch_entry_s()
    assert 0 <= entry < 1e-3 and dispatch_entry_s() == entry  # measured once per process


def test_the_measurement_leaves_the_random_numbers_and_the_grad_mode_as_they_were() -> None:
    # it runs inside the user's first profiling step, whose dropout masks must not move
    dispatch_entry_s.cache_clear()
    before = torch.get_rng_state()
    with torch.no_grad():
        entry = dispatch_entry_s()
        assert not torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), before) and entry >= 0
