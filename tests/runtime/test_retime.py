"""runtime/retime.py: a trace's timing from several steps, hand-computed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from swapsched.plan import Eviction, SwapPlan
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


def _executed(gap: float, mode: str = "execute") -> StepReport:
    """A step of ``_step``'s trace that ran with ``gap`` s gaps and tail (5 gap s in all); a
    "timing" step ran the compute without hooks (no gaps), in ``gap`` s."""
    timing = mode == "timing"
    return StepReport(step=0, mode=mode, step_s=gap if timing else 5 * gap, stall_s=0.0, predicted_step_s=None,
                      evicted_bytes=0, prefetched_bytes=0, on_demand_bytes=0, peak_device_bytes=0, budget_bytes=0,
                      plan_followed=not timing, guard_evictions=0, kept_small=0, hook_s=None if timing else 0.0,
                      gaps_s=None if timing else (gap,) * 4, tail_s=None if timing else gap, unhooked=timing)


def test_executed_steps_re_time_after_the_first_interval_then_at_doubling_ones_until_a_new_trace():
    trace = _step(1.0)
    executed = _executed
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


def test_steps_run_without_hooks_give_what_the_hooks_cost_the_compute_and_the_gaps_without_it():
    # R1, "hooked gaps": the plan's steps ran with 1 s gaps and tail (5 s of compute under the
    # hooks, 4 events); two steps of its compute without hooks took 3.4 and 3.0 s (the least
    # counts). The hooks cost the compute (5 - 3) / 4 = 0.5 s an event: the gaps are 0.5 s each,
    # and each event that passes the hooks pays 0.5 s more than the hooks' own time
    trace = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)],
                       tail=1.0, modules=["blk.0.ln", "blk.0.fc"])  # a block: a plan could recompute it
    assert trace.segments
    plan = SwapPlan.of(trace, "evict-t0", [Eviction(0, 0, 2)])
    timing = _executed(3.4, mode="timing")

    steps = ExecutedSteps(3, make_hw(), fit_host=False)
    assert not steps.times_compute(plan, trace, allowed=True)  # just before the first re-timing, not at once
    steps.add(_executed(1.0), trace)
    assert not steps.times_compute(plan, trace, allowed=True)
    steps.add(_executed(1.0), trace)
    assert steps.times_compute(plan, trace, allowed=True)
    assert not steps.times_compute(plan, trace, allowed=False)  # watched, blocks checkpointed, CUDA
    assert not steps.times_compute(SwapPlan.of(trace, "keep", []), trace, allowed=True)  # it runs without hooks anyway
    assert not steps.times_compute(plan, trace.with_segments(lambda sg: False), allowed=True)  # nothing to recompute
    assert steps.add(timing, trace) is None and steps.add(replace(timing, step_s=3.0), trace) is None
    assert not steps.times_compute(plan, trace, allowed=True)  # two of them
    retimed, hardware = steps.add(_executed(1.0), trace)  # type: ignore[misc]
    assert steps.hook_gap_s == pytest.approx(0.5)
    assert retimed.gaps.tolist() == pytest.approx([0.5] * 4) and retimed.tail_compute_s == pytest.approx(1.0)
    assert hardware is not None and hardware.hook_cost_s == pytest.approx(0.5)
    # the plan's steps measured 5 s each; without hooks they would have taken 5 - 4 x 0.5 = 3 s
    assert steps.fastest_s == pytest.approx(5.0) and steps.fastest_unhooked_s == pytest.approx(3.0)
    # once measured, it holds for later re-timings (the next after 6 steps); no more steps without hooks
    for _ in range(6):
        assert not steps.times_compute(plan, trace, allowed=True)
        due = steps.add(_executed(1.0), trace)
    assert due is not None and due[0].gaps.tolist() == pytest.approx([0.5] * 4)


def test_steps_timed_with_the_state_moving_charge_what_the_compute_lost_to_each_copy():
    # R1, "hooked gaps", with the state moving: the timing steps keep the hooks (the mover needs
    # them) and every activation, so their gaps are the compute without the activations' copies:
    # 3.6 and 3.0 s in all (gaps and tail; the least counts). The plan's steps ran 5 s of compute
    # with 4 copies each: the compute lost (5 - 3) / 4 = 0.5 s a copy, charged per copy (not per
    # event: a plan that copies less, every block recomputed, loses less), the gaps 0.5 s each
    trace = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)],
                       tail=1.0, modules=["blk.0.ln", "blk.0.fc"])
    hooked = replace(_executed(1.0), copies=4)
    timing = replace(hooked, mode="timing", gaps_s=(0.65,) * 4, tail_s=1.0, plan_followed=False)
    steps = ExecutedSteps(3, make_hw(), fit_host=False)
    steps.add(hooked, trace)
    steps.add(hooked, trace)
    assert steps.add(timing, trace) is None and steps.add(replace(timing, gaps_s=(0.5,) * 4), trace) is None
    retimed, hardware = steps.add(hooked, trace)  # type: ignore[misc]
    assert steps.per_copy and steps.copy_gap_s == pytest.approx(0.5)
    assert retimed.gaps.tolist() == pytest.approx([0.5] * 4) and retimed.tail_compute_s == pytest.approx(1.0)
    assert hardware is not None and hardware.copy_issue_s == pytest.approx(0.5) and hardware.hook_cost_s == 0
