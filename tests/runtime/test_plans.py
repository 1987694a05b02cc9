"""runtime/plans.py on hand-made traces, without torch running: a family of one structure at three
sizes, first plans borrowed or made quick, predictions, re-timing, and the policy's plans
installed when ready.

The family (``fam(s)``): T0 of ``s`` bytes and T1 of ``2s``; e0 pack0, e1 pack1, e2 unpack1,
e3 unpack0, 1 s before each (ideal 4 s). Its activation peak is ``3s``, its smallest feasible
budget ``2s`` (T1 alone), and "70%" stands for ``2.1s``. On a 100 B/s link (``make_hw``) at
s = 100 and 210 B: keeping everything needs the guard (6.0 s); evicting T0 after e0 and
prefetching it after e1 takes 5.0 s (its swap-in waits for T1 to go, after e2, and takes 1 s).
"""

from __future__ import annotations

import numpy as np
import pytest

from swapsched.env.simulator import simulate
from swapsched.plan import Eviction, SwapPlan
from swapsched.runtime.budgets import ShapeBudgets
from swapsched.runtime.plans import ShapePlans, rank, without_small
from swapsched.runtime.reports import StepReport
from tests.conftest import make_hw, make_trace

SIGHT = {0: 0, 1: 1}  # the order of first sight every size of the family shares


def fam(s: int, gap: float = 1.0):
    return make_trace([s, 2 * s], [("pack", 0, gap), ("pack", 1, gap), ("unpack", 1, gap), ("unpack", 0, gap)],
                      name=f"s{s}")


def evict_t0(trace) -> SwapPlan:
    return SwapPlan.of(trace, "evict-t0", [Eviction(0, 0, 1)])


def report(gaps, tail=0.0, followed=True) -> StepReport:
    return StepReport(step=1, mode="execute", step_s=sum(gaps), stall_s=0.0, predicted_step_s=None, evicted_bytes=0,
                      prefetched_bytes=0, on_demand_bytes=0, peak_device_bytes=0, budget_bytes=0,
                      plan_followed=followed, guard_evictions=0, kept_small=0, gaps_s=tuple(gaps), tail_s=tail)


class Planner:
    """A policy for the tests: ``plan`` evicts T0 as ``evict_t0`` does (or keeps all), counted."""

    def __init__(self, name: str = "evict-t0", evict: bool = True):
        self.name, self.evict, self.calls = name, evict, 0

    def plan(self, trace, budget, hardware):
        self.calls += 1
        return SwapPlan.of(trace, self.name, [Eviction(0, 0, 1)] if self.evict else [])


def plans_of(*sizes: int, budget="70%", policy=None, quick=None, background=False) -> ShapePlans:
    """ShapePlans with a profiled layout of each size, all keeping everything."""
    out = ShapePlans(make_hw(), ShapeBudgets(budget), policy, quick, background=background)
    for s in sizes:
        t = fam(s)
        out.keep(out.lay_out(t, SwapPlan.of(t, "keep", []), first_sight=SIGHT))
    return out


def test_kin_are_the_layouts_of_one_structure_and_one_order_of_first_sight():
    plans = plans_of(100, 300)
    other = make_trace([50, 50], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 0, 1.0), ("unpack", 1, 1.0)])
    plans.keep(plans.lay_out(other, SwapPlan.of(other, "keep", []), first_sight=SIGHT))
    assert sorted(lay.shape_key for lay in plans.kin(fam(200), SIGHT)) == [100, 300]
    assert plans.kin(fam(200), {0: 1, 1: 0}) == []


def test_a_borrowed_plan_is_the_nearest_larger_sizes_and_says_whose():
    plans = plans_of(100, 300)
    plans.keep(plans.lay_out(fam(300), evict_t0(fam(300)), first_sight=SIGHT))  # 300's plan evicts T0
    plan, res = plans.borrowed(fam(200), plans.kin(fam(200), SIGHT))
    assert plan.evictions == (Eviction(0, 0, 1),) and plan.meta["borrowed_from"] == "s300"
    # at 420 B: T0's 2 s swap-out holds pack1 back 1 s, its 2 s swap-in starts when T1 goes (t=4): 7 s
    assert res.iteration_s == pytest.approx(7.0) and not res.guard_evictions
    assert rank(res) < rank(simulate(fam(200), SwapPlan.of(fam(200), "keep", []), make_hw(), 420, guard=True))


def test_a_borrowed_plan_that_needs_the_guard_gives_way_to_a_nearer_one_that_does_not():
    plans = plans_of(100, 400)  # 400 keeps all (needs the guard at 200); 100 evicts T0
    plans.keep(plans.lay_out(fam(100), evict_t0(fam(100)), first_sight=SIGHT))
    plan, res = plans.borrowed(fam(200), plans.kin(fam(200), SIGHT))
    assert plan.meta["borrowed_from"] == "s100" and res.guard_evictions == 0


def test_a_predicted_size_is_fitted_from_the_profiled_ones_and_replanned_on_the_planner_thread():
    policy = Planner()
    plans = plans_of(100, 300, policy=policy, background=True)
    try:
        lay = plans.predict(plans.layouts[100], 200)
        assert lay is not None and lay.predicted and lay.trace.tensor_bytes.tolist() == [200, 400]
        assert plans.layouts[200] is lay and lay.plan_source == "borrowed" and lay.budget_bytes == 420
        assert plans.planning  # the policy's plan for 200 is being made
        ((replaced, new),) = plans.install_ready(wait=True)
        assert replaced is lay and plans.layouts[200] is new and new.plan.policy == "evict-t0" and new.predicted
        assert policy.calls == 1 and new.family is lay.family
        assert plans.predict(plans.layouts[100], 700) is None  # beyond twice the largest: no prediction
    finally:
        plans.shutdown()


def test_a_job_for_a_layout_that_has_gone_is_dropped():
    policy = Planner()
    plans = plans_of(100, 300, policy=policy, background=True)
    try:
        plans.plan_later(plans.layouts[100])
        plans.forget(100)
        assert plans.install_ready(wait=True) == [] and 100 not in plans.layouts
        plans.plan_later(plans.layouts[300])
        plans.clear()
        assert plans.install_ready(wait=True) == [] and plans.layouts == {}
    finally:
        plans.shutdown()


def test_a_job_for_a_layout_re_timed_since_is_installed():
    """The shape ran and came again while its plan was being made: get() re-timed its layout (the
    same borrowed plan, a new layout). The policy's plan still replaces it; a plan laid out anew
    (a different plan object) is not replaced by a job made for the one before."""
    import threading

    class Slow(Planner):
        def __init__(self) -> None:
            super().__init__()
            self.go = threading.Event()

        def plan(self, trace, budget, hardware):
            self.go.wait(10)
            return super().plan(trace, budget, hardware)

    policy = Slow()
    plans = plans_of(100, 300, policy=policy, background=True)
    try:
        lay = plans.predict(plans.layouts[100], 200)
        plans.note_other_shape(lay, report([0.5, 0.5, 0.5, 0.5]))
        again = plans.get(200)
        assert again is not lay and again.plan is lay.plan and "timed_by_execution" in again.trace.meta
        policy.go.set()
        ((replaced, new),) = plans.install_ready(wait=True)
        assert replaced is again and plans.layouts[200] is new and new.plan.policy == "evict-t0"
        # laid out anew with another plan while a job ran: the job's plan is dropped
        policy.go.clear()
        plans.plan_later(plans.layouts[100])
        t = plans.layouts[100].trace
        plans.keep(plans.lay_out(t, SwapPlan.of(t, "other", []), first_sight=SIGHT))
        policy.go.set()
        assert plans.install_ready(wait=True) == [] and plans.layouts[100].plan.policy == "other"
    finally:
        plans.shutdown()


def test_a_borrowed_plan_at_the_floor_as_predicted_is_replanned_when_the_step_ran_slower():
    """Three tensors of s B, 4 s gaps, each size evicting T0 during gap 1 and bringing it back
    once T2 is freed: predicted at s = 200 (budget 420 B, 180 B over while T2 is held), the
    borrowed plan hides T0's 2 s copies and meets R8's floor, the ideal 24 s, so the policy is
    not asked. The step then ran with 0.5 s gaps: re-timed there, the copies stall (5.5 s against a
    3.8 s floor), so the policy plans the shape after all, once."""
    sight = {0: 0, 1: 1, 2: 2}

    def three(n: int):
        return make_trace([n] * 3, [*(("pack", k, 4.0) for k in range(3)), *(("unpack", k, 4.0) for k in (2, 1, 0))],
                          name=f"t{n}")

    policy = Planner("mine")
    plans = ShapePlans(make_hw(), ShapeBudgets("70%"), policy, None, background=True)
    try:
        for n in (100, 300):
            t = three(n)
            plans.keep(plans.lay_out(t, SwapPlan.of(t, "evict-t0", [Eviction(0, 0, 3)]), first_sight=sight))
        lay = plans.predict(plans.layouts[100], 200)
        assert lay.plan_source == "borrowed" and lay.predicted_s == pytest.approx(24.0) and not plans.planning
        plans.note_other_shape(lay, report([0.5] * 6))
        again = plans.get(200)
        assert again.predicted_s > 3.8 * 1.1 and plans.planning  # above the floor now: the policy plans it
        ((replaced, new),) = plans.install_ready(wait=True)
        assert replaced is again and new.plan.policy == "mine" and policy.calls == 1
        plans.note_other_shape(new, report([0.5] * 6))
        plans.get(200)
        assert not plans.planning  # the policy's own plan is not planned again
    finally:
        plans.shutdown()


def test_without_a_background_planner_a_replan_is_made_at_once():
    plans = plans_of(100, policy=Planner())
    plans.replan(plans.layouts[100], fam(100))
    assert plans.layouts[100].plan.policy == "evict-t0" and not plans.planning


def test_the_quick_planner_plans_a_new_shape_where_it_is_faster_and_the_share_allows():
    quick = Planner("quick")
    plans = plans_of(100, 300, quick=quick)  # both keep all: at 420 B for 200, the guard's 6.0 s
    t = fam(200)
    plan, _ = plans.first_plan(t, plans.kin(t, SIGHT))
    assert quick.calls == 0 and "borrowed_from" in plan.meta  # no run time yet: no share to plan in
    plans.note_step(10.0, 0.0)  # 2% of 10 s = 0.2 s, above the 10 ms a quick plan is expected to take
    plan, res = plans.first_plan(t, plans.kin(t, SIGHT))
    assert quick.calls == 1 and plan.meta["planned_by"] == "quick" and plan.evictions == (Eviction(0, 0, 1),)
    plans.note_step(0.0, 0.2)  # the share spent
    plan, _ = plans.first_plan(t, plans.kin(t, SIGHT))
    assert quick.calls == 1 and "borrowed_from" in plan.meta


def test_a_quick_plan_no_faster_than_the_borrowed_one_is_not_taken():
    quick = Planner("quick", evict=False)  # keeps all, as the borrowed plan does
    plans = plans_of(100, 300, quick=quick)
    plans.note_step(10.0, 0.0)
    plan, _ = plans.first_plan(fam(200), plans.kin(fam(200), SIGHT))
    assert quick.calls == 1 and "borrowed_from" in plan.meta


def test_a_shapes_first_executed_step_re_times_it_when_it_comes_again():
    plans = plans_of(100, 300)
    lay = plans.layouts[100]
    plans.note_other_shape(lay, report([0.5, 0.5, 0.5, 0.5]))
    assert plans.layouts[100] is lay  # not before it comes again
    again = plans.get(100)
    assert again is not lay and again.trace.gaps.tolist() == [0.5, 0.5, 0.5, 0.5]
    assert again.trace.meta["timed_by_execution"] == 1 and plans.get(100) is again


def test_a_predicted_shape_whose_plan_did_not_hold_is_replanned_on_the_trace_as_it_ran():
    policy = Planner()
    plans = plans_of(100, 300, policy=policy)
    lay = plans.predict(plans.layouts[100], 200)
    plans.note_other_shape(lay, report([2.0, 2.0, 2.0, 2.0], followed=False))
    new = plans.layouts[200]
    assert policy.calls == 1 and new.plan.policy == "evict-t0" and new.trace.gaps.tolist() == [2.0] * 4


def test_executed_gaps_time_the_familys_later_predictions():
    plans = plans_of(100, 300)
    plans.note_times(plans.layouts[300], report([3.0, 3.0, 3.0, 3.0]))
    lay = plans.predict(plans.layouts[100], 250)  # between 100 (1 s gaps) and 300 (now 3 s): 3/4 of the way
    assert lay is not None and np.allclose(lay.trace.gaps, 2.5)
    plans.note_times(plans.layouts[100], report([1.0, 1.0]))  # a step that did not run the whole trace
    assert plans.predict(plans.layouts[100], 250) is not None


def test_evictions_of_tensors_under_min_bytes_are_dropped_and_counted():
    t = fam(100)
    plan = SwapPlan.of(t, "both", [Eviction(0, 0, 1), Eviction(1, 1, 1)])
    small = without_small(plan, t, min_bytes=150)
    assert small.evictions == (Eviction(1, 1, 1),) and small.meta["kept_small"] == 1
    assert without_small(plan, t, min_bytes=0) is plan
