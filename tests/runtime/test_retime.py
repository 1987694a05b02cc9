"""runtime/retime.py: a trace's timing from several steps, hand-computed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from swapsched.runtime.retime import median_trace
from tests.conftest import make_trace


def _step(gap: float, size: int = 100):
    return make_trace([size, size], [("pack", 0, gap), ("pack", 1, gap), ("unpack", 1, gap), ("unpack", 0, gap)],
                      tail=gap)


def test_median_trace_takes_each_gap_over_the_steps_of_the_last_ones_shape():
    # gaps 1, 3, 2 s for three steps of one shape: the median 2 everywhere, and in the tail
    med = median_trace([_step(1.0), _step(3.0), _step(2.0)])
    assert med.gaps.tolist() == [2.0] * 4 and med.tail_compute_s == 2.0 and med.meta["median_of_steps"] == 3
    # a step of another size (same events, other bytes) times other compute: left out. The last
    # step (200 B) has no other step of its shape: its own timing stands
    mixed = median_trace([_step(1.0), _step(1.0), _step(5.0, size=200)])
    assert mixed.gaps.tolist() == [5.0] * 4 and "median_of_steps" not in mixed.meta
    two = median_trace([_step(1.0, size=200), _step(9.0), _step(3.0, size=200)])
    assert two.gaps.tolist() == pytest.approx([2.0] * 4) and two.meta["median_of_steps"] == 2


def test_on_several_ranks_median_trace_keeps_each_gaps_most_other_bytes_over_the_steps_of_its_shape():
    def step(other: list[int], size: int = 100):
        return make_trace([size, size], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)],
                          other=other)

    # a step that reduce-scatters holds more in its last gaps than one accumulating without sync:
    # the plan must fit both (R18); a step of another shape does not count, nor the first step
    # (one-off costs), where later ones are there to take the most over
    steps = [step([50, 50, 50, 50]), step([5, 0, 7, 1]), step([9, 0, 2, 1], size=200), step([1, 3, 2, 8])]
    merged = median_trace(steps, most_other=True)  # FSDP2
    assert [e.other_bytes for e in merged.events] == [5, 3, 7, 8]
    assert [e.other_bytes for e in median_trace(steps).events] == [1, 3, 2, 8]  # one rank, or DDP: the last step's
    two = median_trace([step([50, 50, 50, 50]), step([1, 3, 2, 8])], most_other=True)  # the last's, where there are two
    assert [e.other_bytes for e in two.events] == [1, 3, 2, 8]


def _report(gaps: list[float], tail: float, copies: int, nbytes: int, hook_s: float = 0.0):
    from swapsched.runtime.reports import StepReport

    return StepReport(step=1, mode="execute", step_s=sum(gaps) + tail, stall_s=0.0, predicted_step_s=None,
                      evicted_bytes=nbytes // 2, prefetched_bytes=nbytes - nbytes // 2, on_demand_bytes=0,
                      peak_device_bytes=0, budget_bytes=0, plan_followed=True, guard_evictions=0, kept_small=0,
                      hook_s=hook_s, copies=copies, gaps_s=tuple(gaps), tail_s=tail)


def test_retiming_takes_what_the_copies_took_of_the_compute_out_of_the_gaps():
    from swapsched.runtime.retime import MAX_INTERFERENCE, timed_by_execution

    trace = _step(1.0)
    # 4 gaps of 2 s and a tail of 2 s: 10 s of compute; 20 copies of 100 B each at 0.1 s + 1 ms per
    # byte: 2 s + 2 s = 4 s of it were the copies' (40%), taken from each gap in proportion
    rep = _report([2.0, 2.0, 2.0, 2.0], 2.0, copies=20, nbytes=2000)
    timed = timed_by_execution(trace, [rep], (0.1, 1e-3))
    assert timed.gaps.tolist() == pytest.approx([1.2] * 4) and timed.tail_compute_s == 2.0
    assert timed_by_execution(trace, [rep]).gaps.tolist() == [2.0] * 4  # none given: the gaps as measured
    # a measure that would leave next to no compute takes at most MAX_INTERFERENCE of it
    most = timed_by_execution(trace, [rep], (1.0, 0.0))
    assert most.gaps.tolist() == pytest.approx([2.0 * (1 - MAX_INTERFERENCE)] * 4)
    # a step without copies keeps its gaps; the median is over the steps, each corrected alone
    quiet = _report([1.0, 1.0, 1.0, 1.0], 1.0, copies=0, nbytes=0)
    two = timed_by_execution(trace, [rep, quiet, quiet], (0.1, 1e-3))
    assert two.gaps.tolist() == pytest.approx([1.0] * 4)


def test_the_fitted_per_copy_costs_add_the_interference_retiming_took_out():
    from swapsched.hardware import load_hardware
    from swapsched.runtime.retime import ExecutedSteps, fitted_host_costs

    hw = load_hardware("cpu-emulated")
    # one plan: the hooks' time per event, and the interference kept as the per-copy costs
    reps = [_report([1.0] * 4, 0.0, copies=10, nbytes=1000, hook_s=4e-3) for _ in range(2)]
    one = fitted_host_costs(hw, reps, 100, (5e-5, 2e-9))
    assert one.hook_cost_s == pytest.approx(4e-5) and one.copy_issue_s == 5e-5 and one.copy_host_s_per_byte == 2e-9
    # plans apart: the hooks' per-copy costs fitted, the interference on top of them
    truth = [(c, b, 100 * 10e-6 + c * 50e-6 + b * 1e-9) for c, b in [(0, 0), (10, 1_000_000), (40, 200_000), (20, 3_000_000)]]
    fit = fitted_host_costs(hw, [_report([1.0] * 4, 0.0, c, b, h) for c, b, h in truth], 100, (5e-5, 2e-9))
    assert fit.copy_issue_s == pytest.approx(1e-4, rel=1e-6) and fit.copy_host_s_per_byte == pytest.approx(3e-9, rel=1e-6)
    # what the runtime hands ExecutedSteps: the given per-copy costs are the interference only
    # where it fits the host (uncalibrated); a calibrated profile's are re-timed as measured
    measured = replace(hw, copy_issue_s=5e-5, copy_host_s_per_byte=2e-9)
    assert ExecutedSteps(2, measured, fit_host=True).interference == (5e-5, 2e-9)
    assert ExecutedSteps(2, measured, fit_host=False).interference == (0.0, 0.0)
