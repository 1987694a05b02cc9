"""runtime/retime.py: a trace's timing from several steps, hand-computed."""

from __future__ import annotations

import pytest

from swapsched.runtime.reports import StepReport
from swapsched.runtime.retime import RETIME_EVERY_MOST, ExecutedSteps, median_trace
from tests.conftest import make_hw, make_trace


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


def test_executed_steps_re_time_after_the_first_interval_then_at_doubling_ones_until_a_new_trace():
    trace = _step(1.0)

    def executed(gap: float) -> StepReport:
        return StepReport(step=0, mode="execute", step_s=5 * gap, stall_s=0.0, predicted_step_s=None, evicted_bytes=0,
                          prefetched_bytes=0, on_demand_bytes=0, peak_device_bytes=0, budget_bytes=0, plan_followed=True,
                          guard_evictions=0, kept_small=0, hook_s=0.0, gaps_s=(gap,) * 4, tail_s=gap)

    steps = ExecutedSteps(2, make_hw(), fit_host=False)
    due = [k for k in range(1, 31) if steps.add(executed(float(k)), trace) is not None]
    assert due == [2, 6, 14, 30]  # after 2, then 4, 8 and 16 more
    # each re-timing is the median of the steps since the last: steps 15-30 -> 22.5
    steps = ExecutedSteps(2, make_hw(), fit_host=False)
    for k in range(1, 15):
        steps.add(executed(float(k)), trace)
    out = [steps.add(executed(float(k)), trace) for k in range(15, 31)]
    assert out[:-1] == [None] * 15 and out[-1] is not None and out[-1][0].gaps.tolist() == [22.5] * 4
    steps.forget()  # a new trace: re-timed after 2 of its steps again
    assert [steps.add(executed(1.0), trace) is not None for _ in range(2)] == [False, True]
    # the interval stops doubling at RETIME_EVERY_MOST
    long = ExecutedSteps(64, make_hw(), fit_host=False)
    due = [k for k in range(1, 64 + 96 + 96 + 1) if long.add(executed(1.0), trace) is not None]
    assert due == [64, 64 + RETIME_EVERY_MOST, 64 + 2 * RETIME_EVERY_MOST]
