"""env/simulator.py: hand-computed cases (the arithmetic is in each test) and properties."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swapsched.env.floors import analytic_floor, joint_floor
from swapsched.env.simulator import Simulation, simulate
from swapsched.plan import Eviction, PlanError, SwapPlan
from tests.conftest import make_hw, make_trace


def test_keep_all_is_ideal(two_tensors, hw):
    r = simulate(two_tensors, [], hw, 200)
    assert r.iteration_s == 5.0 and r.ideal_s == 5.0 and r.overhead == 0.0
    assert r.peak_bytes == 200 and r.d2h_bytes == r.h2d_bytes == 0 and not r.oom


def test_prefetch_arrives_in_time(two_tensors, hw):
    # T0 out at e0: d2h 1 -> 2. Prefetch at e2 (t=4): h2d 4 -> 5; e3 is at t=5: no stall.
    r = simulate(two_tensors, [Eviction(0, 0, 2)], hw, 200, record=True)
    assert r.iteration_s == 5.0 and r.stall_s == 0.0
    assert r.timeline.d2h == ((1.0, 2.0, 0),) and r.timeline.h2d == ((4.0, 5.0, 0),)
    assert r.d2h_bytes == r.h2d_bytes == 100
    # memory: T0 made (100), T1 made (200), T0's swap-out done (100), T1 freed at e2 (0), T0's
    # swap-in buffer allocated there (100), T0 freed at e3 (0)
    assert r.timeline.memory == ((0.0, 0), (0.0, 100), (1.0, 200), (2.0, 100), (4.0, 0), (4.0, 100), (5.0, 0))


def test_on_demand_stalls_one_transfer(two_tensors, hw):
    # prefetch_at == first unpack (3) means on demand: at e3 (t=5) copy 5 -> 6, stall 1 s in backward.
    r = simulate(two_tensors, [Eviction(0, 0, 3)], hw, 200)
    assert r.iteration_s == 6.0 and r.stall_s == 1.0 and r.stall_bwd_s == 1.0 and r.stall_fwd_s == 0.0


def test_allocation_waits_for_swap_out(two_tensors, hw):
    # Budget 100: T0's swap-out runs 1 -> 2, T1 (gap of e1, from t=1) needs its 100 B: wait 1 s (R4).
    # e1 at 3, e2 at 5 frees T1, prefetch of T0 issued at e2: 5 -> 6; e3 at 6: no further stall.
    r = simulate(two_tensors, [Eviction(0, 0, 2)], hw, 100)
    assert r.stall_fwd_s == 1.0 and r.stall_bwd_s == 0.0 and r.iteration_s == 6.0
    assert r.peak_bytes == 100


def test_a_tensor_the_program_still_holds_is_freed_only_at_its_release(two_tensors, hw):
    # R2: T0's swap-out completes at 2, but the program holds T0 through the gap of e1 (released_at
    # 1): T1's 100 B (made in gap e1, from t=1) find no room at a 100 B budget and nothing frees it
    # by waiting: OOM at e1. At 200 B it fits; T0 leaves at e1 (t=2), after the copy (done at 2).
    from dataclasses import replace

    held = replace(two_tensors, tensors=(replace(two_tensors.tensors[0], released_at=1), two_tensors.tensors[1]))
    assert simulate(two_tensors, [Eviction(0, 0, 2)], hw, 100).oom is False
    r = simulate(held, [Eviction(0, 0, 2)], hw, 100)
    assert r.oom and r.oom_event == 1
    assert held.min_feasible_bytes == 200 and two_tensors.min_feasible_bytes == 100
    r = simulate(held, [Eviction(0, 0, 2)], hw, 200)
    assert not r.oom and r.iteration_s == 5.0 and r.peak_bytes == 200


def test_a_tensor_freed_after_its_node_runs_holds_memory_one_gap_longer(hw):
    # R2: T1 last unpacked at e3 but freed only after the gap of e4 (freed_at 4: the node that read
    # it still runs). Budget 150. T0 out at e0: 1 -> 2; T1's gap (from t=1) waits for it: 1 s
    # forward stall, e1 at 3, e2 at 5, e3 at 6. T0's prefetch is issued at e3 (t=6):
    # - freed at its last unpack: T1 frees at e3, the prefetch runs 6 -> 7 = e4's time: step 7;
    # - freed_at 4: no room until after e4's gap (t=7), the prefetch runs 7 -> 8: 1 s backward stall.
    from dataclasses import replace

    tr = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 1, 1.0),
                                 ("unpack", 0, 1.0)])
    r = simulate(tr, [Eviction(0, 0, 3)], hw, 150)
    assert r.iteration_s == 7.0 and r.stall_fwd_s == 1.0 and r.stall_bwd_s == 0.0
    late = replace(tr, tensors=(tr.tensors[0], replace(tr.tensors[1], freed_at=4)))
    r = simulate(late, [Eviction(0, 0, 3)], hw, 150)
    assert r.iteration_s == 8.0 and r.stall_bwd_s == 1.0
    assert tr.resident_bytes_no_swap.tolist() == [100, 200, 200, 200, 100]
    assert late.resident_bytes_no_swap.tolist() == [100, 200, 200, 200, 200]


def test_prefetch_waits_for_room(hw):
    # T0,T1,T2 of 100 B, 1 s gaps, budget 200. T0 out 1 -> 2. T2 allocated at t=2 (used 200).
    # Prefetch of T0 issued at e2 (t=3) finds no room; e3 (t=4) frees T2, the prefetch starts then:
    # h2d 4 -> 5; e5 at t=6 finds T0 resident. No stall, peak 200.
    tr = make_trace([100, 100, 100], [("pack", 0, 1), ("pack", 1, 1), ("pack", 2, 1),
                                      ("unpack", 2, 1), ("unpack", 1, 1), ("unpack", 0, 1)])
    r = simulate(tr, [Eviction(0, 0, 2)], hw, 200, record=True)
    assert r.timeline.h2d == ((4.0, 5.0, 0),)
    assert r.iteration_s == 6.0 and r.stall_s == 0.0 and r.peak_bytes == 200


def test_oom_is_reported_with_its_event(two_tensors, hw):
    # Keep all under 150 B: T1 needs 100 B at e1 with 100 B resident and nothing in flight.
    r = simulate(two_tensors, [], hw, 150)
    assert r.oom and r.oom_event == 1 and math.isinf(r.iteration_s) and math.isinf(r.overhead)
    assert r.to_dict()["iteration_s"] is None


def test_asymmetric_bandwidth(two_tensors):
    # h2d at 50 B/s: the on-demand copy of 100 B takes 2 s -> stall 2, step 7.
    r = simulate(two_tensors, [Eviction(0, 0, 3)], make_hw(d2h=100, h2d=50), 200)
    assert r.stall_s == 2.0 and r.iteration_s == 7.0


def test_copy_latency(two_tensors):
    # latency 0.5 s per copy: on demand at t=5 -> 5 + 0.5 + 1 = 6.5 -> stall 1.5.
    r = simulate(two_tensors, [Eviction(0, 0, 3)], make_hw(latency=0.5), 200)
    assert r.stall_s == pytest.approx(1.5) and r.iteration_s == pytest.approx(6.5)


def test_copy_engines_run_one_copy_at_a_time(hw):
    # Two 100 B swap-outs issued together at e1 (t=2): the d2h engine runs them 2 -> 3 and 3 -> 4.
    tr = make_trace([100, 100], [("pack", 0, 1), ("pack", 1, 1), ("unpack", 1, 5), ("unpack", 0, 1)])
    r = simulate(tr, [Eviction(0, 1, 3), Eviction(1, 1, 2)], hw, 200, record=True)
    assert [(a, b) for a, b, _ in r.timeline.d2h] == [(2.0, 3.0), (3.0, 4.0)]


def test_other_bytes_count_against_the_budget(hw):
    # 50 B of workspace in the gap of e1 on top of two resident tensors: 250 B > 200 -> OOM at e1.
    tr = make_trace([100, 100], [("pack", 0, 1), ("pack", 1, 1), ("unpack", 1, 1), ("unpack", 0, 1)], other=[0, 50, 0, 0])
    assert simulate(tr, [], hw, 250).peak_bytes == 250
    assert simulate(tr, [], hw, 200).oom_event == 1


def test_the_hooks_cost_every_event_that_passes_them_and_nothing_where_the_plan_moves_nothing(two_tensors, one_block):
    hw = make_hw()
    hw = type(hw)(**{**hw.to_dict(), "hook_cost_s": 0.25})
    # nothing moves: the runtime runs the step without hooks, as plain training (the ideal)
    r = simulate(two_tensors, [], hw, 200)
    assert r.iteration_s == pytest.approx(5.0) and r.ideal_s == pytest.approx(5.0)
    # T0 out at e0 (1.25-2.25) and back from e2 (4.75-5.75, before e3 at 6): every event passes
    # the hooks, 0.25 s each: gaps 1.25 1.25 2.25 1.25, no stall, 6 s
    r = simulate(two_tensors, [Eviction(0, 0, 2)], hw, 200)
    assert r.iteration_s == pytest.approx(6.0) and r.stall_s == 0.0 and r.ideal_s == pytest.approx(5.0)
    # blk.0 recomputed (2 s of its forward) and T2 swapped on an instant link: every event pays
    # the hooks (its member T1's too, though live it passes checkpoint's hooks, not the
    # runtime's: DESIGN R6/R8), 6 s of gaps + 2 s + 6 x 0.25 s = 9.5 s; recomputing alone moves
    # nothing: no hook, 8 s
    fast = type(hw)(**{**make_hw(d2h=1e15, h2d=1e15).to_dict(), "hook_cost_s": 0.25})
    r = simulate(one_block, [Eviction(2, 2, 3)], fast, 1000, recompute=[0])
    assert r.recompute_s == pytest.approx(2.0) and r.iteration_s == pytest.approx(9.5)
    assert simulate(one_block, [], fast, 1000, recompute=[0]).iteration_s == pytest.approx(8.0)


def _with(hw, **fields):
    return type(hw)(**{**hw.to_dict(), **fields})


def test_host_cost_of_copies_is_paid_by_compute(two_tensors, hw):
    # 0.2 s per copy. Out at e0 (t=1): owed 0.2, paid before e1's gap -> e1 at 2.2, e2 at 4.2; the
    # prefetch issued there (h2d 4.2 -> 5.2) owes 0.2 more -> e3 at 5.4, no stall.
    r = simulate(two_tensors, [Eviction(0, 0, 2)], _with(hw, copy_issue_s=0.2), 200, record=True)
    assert r.iteration_s == pytest.approx(5.4) and r.host_s == pytest.approx(0.4) and r.stall_s == 0.0
    assert r.ideal_s == 5.0
    # each debt is paid before the next gap, not at the end: the gaps start at 0, 1.2, 2.2, 4.4
    assert [c for c, _ in r.timeline.compute[:4]] == pytest.approx([0.0, 1.2, 2.2, 4.4])


def test_wait_resume_follows_each_stall(two_tensors, hw):
    # on demand at e3 (t=5): stall 1 s, then 0.5 s to resume before the tail -> 6.5.
    r = simulate(two_tensors, [Eviction(0, 0, 3)], _with(hw, wait_resume_s=0.5), 200)
    assert r.stall_s == 1.0 and r.host_s == pytest.approx(0.5) and r.iteration_s == pytest.approx(6.5)
    assert simulate(two_tensors, [Eviction(0, 0, 2)], _with(hw, wait_resume_s=0.5), 200).host_s == 0.0  # no wait


def test_a_swap_in_waits_for_its_own_swap_out(two_tensors):
    # R6: T0 out at e0 (t=1) on a 25 B/s link: 1 -> 5. Its prefetch is issued at e0 as well and
    # admitted at once (budget 300: T0, its swap-in buffer and T1 fit), but its copy may start only
    # when the host copy is whole: max(1, h2d free 0, out done 5) = 5, 100 B/s: 5 -> 6. Gaps: e1
    # at 2, e2 at 4, e3 at 5, where T0 is needed: stall 1 s, step 6.
    r = simulate(two_tensors, [Eviction(0, 0, 0)], make_hw(d2h=25, h2d=100), 300, record=True)
    assert r.timeline.d2h == ((1.0, 5.0, 0),) and r.timeline.h2d == ((5.0, 6.0, 0),)
    assert r.iteration_s == 6.0 and r.stall_bwd_s == 1.0 and r.stall_fwd_s == 0.0


def test_a_swap_out_is_issued_before_a_prefetch_planned_at_the_same_event(two_tensors, hw):
    # R5: at e0 (t=1), (c) issues T0's swap-out (1 -> 2), then (d) its prefetch, which the plan
    # puts at e0 too: T0 is OUT, so the prefetch is queued and copies 2 -> 3 once the swap-out is
    # done. e3 (t=5) finds T0 resident: step 5, no stall. The other order would see T0 still
    # resident at (d), drop the prefetch, and bring T0 back on demand at e3: 5 -> 6.
    r = simulate(two_tensors, [Eviction(0, 0, 0)], hw, 300, record=True)
    assert r.timeline.h2d == ((2.0, 3.0, 0),)
    assert r.iteration_s == 5.0 and r.stall_s == 0.0


def test_copy_latency_is_paid_by_every_copy(hw):
    # Two 100 B swap-outs issued together at e1 (t=2), 0.5 s latency each: the d2h engine runs
    # them 2 -> 3.5 and 3.5 -> 5 (1 s of bytes + 0.5 s each). Both come back on demand: T1 at e2
    # (t=7): 7 -> 8.5; T0 at e3 (t=9.5 after its 1 s gap): 9.5 -> 11. Stall 1.5 + 1.5, step 11.
    tr = make_trace([100, 100], [("pack", 0, 1), ("pack", 1, 1), ("unpack", 1, 5), ("unpack", 0, 1)])
    r = simulate(tr, [Eviction(0, 1, 3), Eviction(1, 1, 2)], make_hw(latency=0.5), 200, record=True)
    assert [(a, b) for a, b, _ in r.timeline.d2h] == [(2.0, 3.5), (3.5, 5.0)]
    assert [(a, b) for a, b, _ in r.timeline.h2d] == [(7.0, 8.5), (9.5, 11.0)]
    assert r.iteration_s == 11.0 and r.stall_s == 3.0


def test_only_a_copy_that_finds_its_engine_idle_pays_the_wake_up():
    # copy_wake_s 0.25 s, latency 0: T0 and T1 out together at e1 (t=2): the first finds the d2h
    # engine idle, 2 -> 3.25; the second is queued behind it, 3.25 -> 4.25. Both back on demand,
    # each to an idle h2d engine: T1 at e2 (t=7): 7 -> 8.25; T0 at e3 (t=9.25): 9.25 -> 10.5.
    tr = make_trace([100, 100], [("pack", 0, 1), ("pack", 1, 1), ("unpack", 1, 5), ("unpack", 0, 1)])
    r = simulate(tr, [Eviction(0, 1, 3), Eviction(1, 1, 2)], replace(make_hw(), copy_wake_s=0.25), 200, record=True)
    assert [(a, b) for a, b, _ in r.timeline.d2h] == [(2.0, 3.25), (3.25, 4.25)]
    assert [(a, b) for a, b, _ in r.timeline.h2d] == [(7.0, 8.25), (9.25, 10.5)]
    assert r.iteration_s == 10.5 and r.stall_s == 2.5
    # on one stream (R10) T1's swap-in at 7 finds the stream idle too: the same spans
    one = simulate(tr, [Eviction(0, 1, 3), Eviction(1, 1, 2)], replace(make_hw(), copy_wake_s=0.25, copy_streams=1), 200)
    assert one.iteration_s == 10.5


def test_a_tensor_unpacked_twice_is_freed_at_its_last_unpack(hw):
    # T0, T1 of 100 B; T1 is unpacked at e2 and again at e3. Gaps 1, 1, 1, 1, 0. Budget 100.
    # T0 out at e0 (t=1): 1 -> 2; T1's gap waits for it (R4): 1 s forward stall, e1 at 3, e2 at 4.
    # T0's prefetch is issued at e2 but T1 still holds the 100 B (its last unpack is e3): it waits
    # for room (R6) until T1 is freed at e3 (t=5), copies 5 -> 6, and e4 (t=5, a zero gap) stalls
    # 1 s: step 6. Freed at its first unpack, T1 would leave room at e2: the copy 4 -> 5, no stall.
    tr = make_trace([100, 100], [("pack", 0, 1), ("pack", 1, 1), ("unpack", 1, 1), ("unpack", 1, 1), ("unpack", 0, 0)])
    r = simulate(tr, [Eviction(0, 0, 2)], hw, 100, record=True)
    assert r.timeline.h2d == ((5.0, 6.0, 0),)
    assert r.stall_fwd_s == 1.0 and r.stall_bwd_s == 1.0 and r.iteration_s == 6.0 and r.peak_bytes == 100


def test_static_bytes_count_against_the_budget_when_making_room(two_tensors, hw):
    # 50 B static, budget 200: 150 B for saved tensors. T0 out at e0 (1 -> 2); T1's 100 B (gap e1,
    # from t=1) need T0's bytes gone (100 + 100 > 150): wait 1 s (R4). e1 at 3, e2 at 5 frees T1,
    # T0's prefetch 5 -> 6, e3 at 6. Peak 50 + 100. Without the static bytes T1 would fit at once.
    tr = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)], static=50)
    r = simulate(tr, [Eviction(0, 0, 2)], hw, 200)
    assert r.stall_fwd_s == 1.0 and r.iteration_s == 6.0 and r.peak_bytes == 150


def _three_in_a_row(**kw):
    """T0, T1, T2 of 100 B, 1 s gaps; backward reads T2, T1, T0."""
    return make_trace([100, 100, 100], [("pack", 0, 1), ("pack", 1, 1), ("pack", 2, 1),
                                        ("unpack", 2, 1), ("unpack", 1, 1), ("unpack", 0, 1)], **kw)


def test_a_waiting_prefetch_counts_static_and_workspace_bytes(hw):
    # As test_prefetch_waits_for_room (the prefetch of T0 issued at e2, t=3, while T1 and T2 hold
    # 200 B), with 100 B more budget taken by static bytes, or by workspace in the gap of e2:
    # - static: no room until e3 frees T2 (t=4): h2d 4 -> 5, peak 300;
    # - workspace: it goes with e2's gap; after e3's gap (t=4) the prefetch fits: h2d 4 -> 5.
    # Either way, ignoring those bytes would start the copy at 3 and peak at 400.
    for tr in (_three_in_a_row(static=100), _three_in_a_row(other=[0, 0, 100, 0, 0, 0])):
        r = simulate(tr, [Eviction(0, 0, 2)], hw, 300, record=True)
        assert r.timeline.h2d == ((4.0, 5.0, 0),) and r.peak_bytes == 300 and r.iteration_s == 6.0


def test_a_swap_out_finishing_inside_a_gap_admits_a_waiting_prefetch_then(hw):
    # Budget 200. T0 out at e0: 1 -> 2 (gone before T2 arrives at e2). T1 out at e2 (t=3): 3 -> 4.
    # T0's prefetch, issued at e2 (t=3), finds T1 (copying) and T2 holding 200 B: it waits. T1's
    # copy ends at 4, inside e3's 4 s gap (3 -> 7): the prefetch starts then, 4 -> 5, not at the
    # gap's end. e3 frees T2; T1's prefetch at e3 (t=7): 7 -> 8; e4 at 8, e5 at 9: no stall.
    # Admitted only at the gap's end, T0 would copy 7 -> 8 and T1 8 -> 9: a 1 s stall at e4.
    tr = make_trace([100, 100, 100], [("pack", 0, 1), ("pack", 1, 1), ("pack", 2, 1),
                                      ("unpack", 2, 4), ("unpack", 1, 1), ("unpack", 0, 1)])
    r = simulate(tr, [Eviction(0, 0, 2), Eviction(1, 2, 3)], hw, 200, record=True)
    assert r.timeline.h2d == ((4.0, 5.0, 0), (7.0, 8.0, 1))
    assert r.iteration_s == 9.0 and r.stall_s == 0.0 and r.peak_bytes == 200


def test_an_unpack_of_a_tensor_still_waiting_for_room_goes_ahead_on_demand(hw):
    # R5(a) before R6's order. T0 200 B, T1 100 B, T2 200 B; budget 300; 1 s gaps.
    # e0: T0 out 1 -> 3. e1: T1 (300 B in use) out 3 -> 4. e2 (t=2): T2 needs 200 B: wait for T0's
    # copy (3): 1 s forward stall; gap to 4, T1's copy done: T2 alone holds 200 B. Prefetches of
    # T0 then T1 issued at e2 (t=4): T0 (200 B) finds 100 B of room and waits; T1 waits behind it.
    # e3 (t=5) reads T1: it leaves the queue and comes back on demand, 5 -> 6 (1 s stall), and is
    # freed. e4 (t=7) frees T2: T0 copies 7 -> 9; e5 at 8 waits 1 s. Step 9.
    tr = make_trace([200, 100, 200], [("pack", 0, 1), ("pack", 1, 1), ("pack", 2, 1),
                                      ("unpack", 1, 1), ("unpack", 2, 1), ("unpack", 0, 1)])
    r = simulate(tr, [Eviction(0, 0, 2), Eviction(1, 1, 2)], hw, 300, record=True)
    assert r.timeline.h2d == ((5.0, 6.0, 1), (7.0, 9.0, 0))
    assert r.stall_fwd_s == 1.0 and r.stall_bwd_s == 2.0 and r.iteration_s == 9.0
    assert r.h2d_bytes == 300 and r.peak_bytes == 300


def test_host_debt_is_paid_before_an_r4_wait_and_overlaps_it(two_tensors, hw):
    # 0.5 s per copy, budget 100. T0 out at e0: d2h 1 -> 2, owes 0.5. e1's gap (from t=1) needs
    # T1's 100 B, so R4 waits for T0's swap-out (done at 2). The hook issued that copy, so its 0.5 s
    # is spent first (1 -> 1.5), then the wait (1.5 -> 2, a 0.5 s stall). e1 at 3, e2 at 5: the
    # prefetch runs 5 -> 6 and owes 0.5, paid before e3's gap (5.5 -> 6.5); T0 is back at 6: no
    # stall. Step 6.5. (Waiting first and paying after would stall 1 s and end at 7.)
    r = simulate(two_tensors, [Eviction(0, 0, 2)], _with(hw, copy_issue_s=0.5), 100, record=True)
    assert r.stall_fwd_s == pytest.approx(0.5) and r.stall_bwd_s == 0.0 and r.host_s == pytest.approx(1.0)
    assert r.iteration_s == pytest.approx(6.5)
    assert r.timeline.stalls == ((1.5, 2.0, 1),)


def test_host_debt_after_the_anchors_wait_is_paid_before_the_recompute(hw):
    # R9 with 0.5 s to resume after each wait; blk.0 = anchor T0, member T1; T2 in no block.
    # T0 out at e0 (1 -> 2), T2 out at e2 (3 -> 4). e3 (t=4) is T1's first unpack: the anchor
    # comes back on demand, 4 -> 5 (1 s stall, owes 0.5), the 0.5 is paid (5.5), then the block's
    # forward runs 5.5 -> 7.5. T2's prefetch, issued at e3 then, runs 7.5 -> 8.5; e4's gap of
    # 0.5 s ends at 8: 0.5 s stall (owes 0.5), paid before e5's gap: 9 -> 10. Step 10: stalls 1.5,
    # host 1.0. (Paid after the forward instead, T2's prefetch would start at 7 and be in time: 9.)
    tr = make_trace([100, 100, 100], [("pack", 0, 1), ("pack", 1, 1), ("pack", 2, 1), ("unpack", 1, 1),
                                      ("unpack", 2, 0.5), ("unpack", 0, 1)], modules=["blk.0.a", "blk.0.b", "head"])
    plan = SwapPlan.of(tr, "hand", [Eviction(0, 0, 3), Eviction(2, 2, 3)], recompute=["blk.0"])
    r = simulate(tr, plan, _with(hw, wait_resume_s=0.5), 1000, record=True)
    assert r.timeline.recompute == ((5.5, 7.5, 0),) and r.timeline.h2d == ((4.0, 5.0, 0), (7.5, 8.5, 2))
    assert r.iteration_s == pytest.approx(10.0) and r.stall_bwd_s == pytest.approx(1.5) and r.host_s == pytest.approx(1.0)


def test_a_late_free_admits_a_waiting_prefetch_before_an_on_demand_copy(hw):
    # R2 + R6, budget 200; T0, T1 of 100 B, T2 of 200 B, freed only after e4's gap (freed_at 4).
    # T0 out at e0 (1 -> 2), T1 out at e1 (2 -> 3); T2's 200 B (gap e2 from t=2) wait for T1's
    # swap-out: 1 s forward stall, e2 at 4, e3 at 5. T0's prefetch issued at e3 finds no room
    # (T2 still held). After e4's gap (t=6) T2 goes and the prefetch is admitted then: h2d 6 -> 7.
    # e4 reads T1 (no prefetch: on demand), which queues behind it: 7 -> 8, a 2 s stall. e5 at 9.
    # (Were the prefetch admitted only after that wait, T1 would run 6 -> 7 and T0 7 -> 8: step 8.)
    from dataclasses import replace

    tr = make_trace([100, 100, 200], [("pack", 0, 1), ("pack", 1, 1), ("pack", 2, 1), ("unpack", 2, 1),
                                      ("unpack", 1, 1), ("unpack", 0, 1)])
    tr = replace(tr, tensors=(*tr.tensors[:2], replace(tr.tensors[2], freed_at=4)))
    r = simulate(tr, [Eviction(0, 0, 3), Eviction(1, 1, 4)], hw, 200, record=True)
    assert r.timeline.h2d == ((6.0, 7.0, 0), (7.0, 8.0, 1))
    assert r.stall_fwd_s == 1.0 and r.stall_bwd_s == 2.0 and r.iteration_s == 9.0


def test_a_dropped_member_admits_a_waiting_prefetch_before_an_on_demand_copy(hw):
    # R9 + R6, budget 300, 100 B each: T0 and T3 in no block, blk.0 = anchor T1 and member T2,
    # which the program holds through e4's gap (released_at 4). T0 out at e0 (1 -> 2); T3 out at
    # e3 (4 -> 5). T0's prefetch, issued at e3, finds no room (T1, T2, T3 = 300). After e4's gap of
    # 0.5 s (t=4.5) the recomputed T2 is dropped and the prefetch admitted at once: h2d 4.5 -> 5.5.
    # e4 reads T3 on demand: it waits for T3's swap-out (5), then queues behind T0: 5.5 -> 6.5, a
    # 2 s stall. The forward runs again at e5 (7.5 -> 9.5), e6 at 10.5, e7 at 11.5.
    # (Admitted only after that wait, T3 would run 5 -> 6 and T0 6 -> 7: 1.5 s stall, step 11.)
    from dataclasses import replace

    tr = make_trace([100, 100, 100, 100], [("pack", 0, 1), ("pack", 1, 1), ("pack", 2, 1), ("pack", 3, 1),
                                           ("unpack", 3, 0.5), ("unpack", 2, 1), ("unpack", 1, 1), ("unpack", 0, 1)],
                    modules=["head0", "blk.0.a", "blk.0.b", "head1"])
    tr = replace(tr, tensors=(*tr.tensors[:2], replace(tr.tensors[2], released_at=4), tr.tensors[3]))
    plan = SwapPlan.of(tr, "hand", [Eviction(0, 0, 3), Eviction(3, 3, 4)], recompute=["blk.0"])
    r = simulate(tr, plan, hw, 300, record=True)
    assert r.timeline.h2d == ((4.5, 5.5, 0), (5.5, 6.5, 3)) and r.timeline.recompute == ((7.5, 9.5, 0),)
    assert r.stall_fwd_s == 0.0 and r.stall_bwd_s == 2.0 and r.iteration_s == 11.5


def test_host_cost_per_byte_is_paid_by_compute(two_tensors, hw):
    # 0.002 s per byte: each 100 B copy owes 0.2 s, as the 0.2 s per copy in the test above.
    r = simulate(two_tensors, [Eviction(0, 0, 2)], _with(hw, copy_host_s_per_byte=0.002), 200)
    assert r.iteration_s == pytest.approx(5.4) and r.host_s == pytest.approx(0.4)


def test_a_selective_recompute_rebuilds_only_the_cheap_members(hw):
    # R9, selective. blk.0: anchor T0 (layer norm), members T1 (addmm: saved by selective
    # checkpointing, held) and T2 (gelu: rebuilt); T3 outside; 100 B each, 1 s gaps (ideal 8 s).
    # The block is recomputed at e5 (T2's unpack); whole, its forward is e0-e2's gaps, 3 s;
    # selectively, only T2's gap, 1 s. Budget 300: kept, gap 3 holds all four (400): OOM at e3.
    # Selective: T2 goes after gap 2, gap 3 holds T0 T1 T3 = 300; T3 freed at e4 (200); at e5 (t=6)
    # T2 is rebuilt, 6 -> 7 (300), e6 at 8, e7 at 9. Whole: 3 s at e5 instead: 11.
    tr = make_trace([100, 100, 100, 100], [*(("pack", k, 1.0) for k in range(4)), *(("unpack", k, 1.0) for k in (3, 2, 1, 0))],
                    ops=["native_layer_norm", "addmm", "gelu", "addmm"], modules=["blk.0.ln", "blk.0.fc", "blk.0.act", "head"])
    (sg,) = tr.segments
    assert (sg.members, sg.cheap, sg.at, sg.forward_s, sg.cheap_forward_s) == ((1, 2), (2,), 5, 3.0, 1.0)
    assert simulate(tr, [], hw, 300).oom_event == 3
    r = simulate(tr, SwapPlan.of(tr, "hand", [], selective=["blk.0"]), hw, 300, record=True)
    assert not r.oom and r.iteration_s == 9.0 and r.recompute_s == 1.0 and r.stall_s == 0.0 and r.peak_bytes == 300
    assert r.timeline.recompute == ((6.0, 7.0, 0),)
    assert r.timeline.memory == ((0.0, 0), (0.0, 100), (1.0, 200), (2.0, 300), (3.0, 300), (5.0, 200), (6.0, 300),
                                 (7.0, 200), (8.0, 100), (9.0, 0))
    whole = simulate(tr, SwapPlan.of(tr, "hand", [], recompute=["blk.0"]), hw, 300)
    assert whole.iteration_s == 11.0 and whole.recompute_s == 3.0
    # the floor knows the cheaper option. At 1 B/s, 100 B must be away in gap 3 (3 s of compute
    # before it, 5 s from it on): 3 B swapped out in those 3 s, the other 97 B by T2's recompute at
    # 0.01 s/B: 3 + 5 + 0.97. (T2's block recomputed whole would cost 0.02 s/B for the same bytes.)
    assert joint_floor(tr, 300, make_hw(d2h=1, h2d=1)) == pytest.approx(8.97)


def test_the_block_is_found_with_its_anchor_members_event_and_forward_time(one_block):
    (sg,) = one_block.segments
    assert (sg.name, sg.anchor, sg.members, sg.at, sg.forward_s, sg.bytes) == ("blk.0", 0, (1,), 4, 2.0, 100)


def test_a_recomputed_block_is_rebuilt_at_its_first_unpack(one_block, hw):
    # R9, budget 200. Kept, gap 2 holds T0, T1, T2 = 300: OOM at e2. Recomputed, T1 goes when the
    # program lets go of it (after gap 1): gap 2 holds T0 and T2 = 200. e3 at 4 frees T2; e4's gap
    # ends at 5, then the block's forward runs again, 5 -> 7 (T1 back: 200), e4 reads T1, e5 at 8.
    # Step 8 = ideal 6 + 2 s of recompute, no stall, nothing moved.
    assert simulate(one_block, [], hw, 200).oom_event == 2
    plan = SwapPlan.of(one_block, "hand", [], recompute=["blk.0"])
    r = simulate(one_block, plan, hw, 200, record=True)
    assert not r.oom and r.iteration_s == 8.0 and r.recompute_s == 2.0 and r.stall_s == 0.0
    assert r.peak_bytes == 200 and r.d2h_bytes == r.h2d_bytes == 0
    assert r.timeline.recompute == ((5.0, 7.0, 0),)
    # T1 leaves with its release and T2 arrives at t=2 (200 either way); T2 freed at e3 (100); the
    # rebuilt T1 at 5 (200), freed at e4 (100), T0 at e5 (0)
    assert r.timeline.memory == ((0.0, 0), (0.0, 100), (1.0, 200), (2.0, 200), (4.0, 100), (5.0, 200), (7.0, 100), (8.0, 0))


def test_a_recompute_waits_for_its_swapped_anchor(one_block, hw):
    # R9 + R5(a): T0, the block's input, is swapped out at e0 (1 -> 2) and planned back on demand at
    # its own first unpack (e5). The recompute at e4 (t=5) needs it first: on demand 5 -> 6, a 1 s
    # stall, then the forward 6 -> 8; e5 at 9 finds T0 resident. Step 9.
    plan = SwapPlan.of(one_block, "hand", [Eviction(0, 0, 5)], recompute=["blk.0"])
    r = simulate(one_block, plan, hw, 200, record=True)
    assert r.timeline.h2d == ((5.0, 6.0, 0),) and r.timeline.recompute == ((6.0, 8.0, 0),)
    assert r.iteration_s == 9.0 and r.stall_s == 1.0 and r.recompute_s == 2.0


def test_a_recompute_waits_for_room():
    # R9 + R4: T0 (anchor), T1 (member) of blk.0, T2 outside; 100 B each, 1 s gaps; backward reads
    # T1, T0, then T2. Budget 200, d2h 50 B/s. T1 goes after gap 1; T2 is swapped out at e2, 3 -> 5.
    # Backward reaches the block at e3 (t=4): rebuilding T1 needs 100 B, but T0 and T2 (still
    # copying) hold 200: compute waits for the swap-out, 4 -> 5 (a 1 s stall), then the forward
    # runs 5 -> 7; e4 at 8, where T2's prefetch is issued (8 -> 9), e5 at 9: step 9 = 6 + 1 + 2.
    tr = make_trace([100, 100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 1.0), ("unpack", 1, 1.0),
                                      ("unpack", 0, 1.0), ("unpack", 2, 1.0)], modules=["blk.0.ln", "blk.0.fc", "head"])
    r = simulate(tr, SwapPlan.of(tr, "hand", [Eviction(2, 2, 4)], recompute=["blk.0"]), make_hw(d2h=50), 200, record=True)
    assert r.timeline.stalls == ((4.0, 5.0, 3),) and r.timeline.recompute == ((5.0, 7.0, 0),)
    assert r.timeline.h2d == ((8.0, 9.0, 2),)
    assert r.iteration_s == 9.0 and r.stall_bwd_s == 1.0 and r.peak_bytes == 200


def test_plan_breaking_r7_is_rejected(two_tensors, hw):
    with pytest.raises(PlanError, match="R7"):
        simulate(two_tensors, [Eviction(0, 3, 3)], hw, 200)
    with pytest.raises(PlanError, match="R7"):
        simulate(two_tensors, [Eviction(0, 1, 0)], hw, 200)


def test_incremental_equals_whole(two_tensors, hw):
    whole = simulate(two_tensors, [Eviction(0, 0, 2)], hw, 200)
    sim = Simulation(two_tensors, hw, 200)
    sim.run_until(0)
    sim.schedule(0, 0, 2)
    sim.run_until(2)
    assert not sim.done
    sim.run_until(99)  # past the last event: it stops there
    assert sim.done and sim.finish() == whole
    oom = Simulation(two_tensors, hw, 150)
    oom.run_until(2)
    assert oom.done and oom.oom_event == 1  # an OOM ends the step early


def test_copies_scheduled_at_one_event_issue_by_tensor_as_the_plan_lays_them_out():
    # T0, T1, T2 of 100 B, 1 s gaps, 1 s per copy. T0 and T1 go out after e1 and come back from
    # e3, where both prefetches are issued: T0 first (by tensor id, as SwapPlan.of lays them out),
    # back at 5 s for its unpack at e4 (5 s), T1 at 6 s for e5 (6 s): no stall. Scheduled T1
    # first (the environment decides in its own order), T1 issued first would make e4 wait 1 s.
    tr = make_trace([100] * 3, [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 1.0), ("unpack", 2, 1.0),
                                ("unpack", 0, 1.0), ("unpack", 1, 1.0)])
    hw = make_hw()
    sim = Simulation(tr, hw, 300)
    sim.run_until(1)
    sim.schedule(1, 1, 3)
    sim.schedule(0, 1, 3)
    got = sim.finish()
    assert got == simulate(tr, SwapPlan.of(tr, "p", [Eviction(1, 1, 3), Eviction(0, 1, 3)]), hw, 300)
    assert got.stall_s == 0.0
    assert simulate(tr, SwapPlan(tr.name, "p", (Eviction(1, 1, 3), Eviction(0, 1, 3))), hw, 300).stall_s == pytest.approx(1.0)


def test_a_step_without_compute_has_no_overhead_and_a_trace_without_events_its_tail(hw):
    free = make_trace([100], [("pack", 0, 0.0), ("unpack", 0, 0.0)])
    r = simulate(free, [], hw, 100)
    assert r.ideal_s == 0.0 and r.overhead == 0.0
    empty = make_trace([], [], tail=0.5)
    assert analytic_floor(empty, 0, hw) == 0.5 == joint_floor(empty, 0, hw)


# ---------------------------------------------------------------------------- properties


@st.composite
def traces_and_plans(draw):
    n = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(1, 400), min_size=n, max_size=n))
    gap = st.floats(0.0, 3.0, allow_nan=False)
    fwd = [("pack", k, draw(gap)) for k in range(n)]
    fwd += [("pack", draw(st.integers(0, n - 1)), draw(gap)) for _ in range(draw(st.integers(0, 3)))]
    bwd_order = draw(st.permutations(list(range(n))))
    bwd = [("unpack", k, draw(gap)) for k in bwd_order]
    bwd += [("unpack", draw(st.sampled_from(bwd_order)), draw(gap)) for _ in range(draw(st.integers(0, 3)))]
    # extra unpacks must come after the first unpack of their tensor: append at the end
    tr = make_trace(sizes, fwd + bwd, tail=draw(gap))
    fp, fu = tr.first_pack, tr.first_unpack
    evs = []
    for k in range(n):
        if draw(st.booleans()):
            so = draw(st.integers(int(fp[k]), int(fu[k]) - 1))
            evs.append(Eviction(k, so, draw(st.integers(so, int(fu[k])))))
    hw = make_hw(d2h=draw(st.floats(10, 1000)), h2d=draw(st.floats(10, 1000)), latency=draw(st.floats(0, 0.5)))
    lo, hi = tr.min_feasible_bytes, tr.peak_bytes_no_swap
    budget = draw(st.integers(lo, hi + 100))
    return tr, SwapPlan.of(tr, "random", evs), hw, budget


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces_and_plans())
def test_properties_of_any_valid_plan(case):
    tr, plan, hw, budget = case
    r = simulate(tr, plan, hw, budget)
    a = simulate(tr, plan, hw, budget)
    assert a == r  # deterministic
    if r.oom:
        assert r.oom_event is not None and 0 <= r.oom_event < tr.n_events
        return
    assert r.peak_bytes <= budget
    assert r.iteration_s >= r.ideal_s - 1e-9
    assert r.iteration_s >= analytic_floor(tr, budget, hw) - 1e-9
    assert r.stall_s == pytest.approx(r.iteration_s - r.ideal_s, abs=1e-9)
    moved = sum(tr.tensors[e.tensor].bytes for e in plan.evictions)
    assert r.d2h_bytes == r.h2d_bytes == moved


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces_and_plans())
def test_every_swap_in_starts_after_its_swap_out_ends(case):
    """R6 on any plan: a host copy is read back only once it is whole, and each engine runs one
    copy at a time, in issue order."""
    tr, plan, hw, budget = case
    r = simulate(tr, plan, hw, budget, record=True)
    out_end = {k: end for _, end, k in r.timeline.d2h}
    for start, _, k in r.timeline.h2d:
        assert start >= out_end[k]
    for copies in (r.timeline.d2h, r.timeline.h2d):
        assert all(b[0] >= a[1] for a, b in zip(copies, copies[1:], strict=False))


@st.composite
def joint_cases(draw):
    """A trace whose tensors sit in blocks (``blk.i``) or outside, and a random keep / swap /
    recompute plan for it (R7, R9)."""
    n = draw(st.integers(2, 6))
    sizes = draw(st.lists(st.integers(1, 400), min_size=n, max_size=n))
    gap = st.floats(0.0, 3.0, allow_nan=False)
    fwd = [("pack", k, draw(gap)) for k in range(n)]
    bwd = [("unpack", k, draw(gap)) for k in draw(st.permutations(list(range(n))))]
    modules = [draw(st.sampled_from([f"blk.{k // 3}.op{k % 3}", "head"])) for k in range(n)]
    # ops selective checkpointing saves (addmm), rebuilds (gelu) or counts kept (unknown)
    ops = [draw(st.sampled_from(["", "addmm", "gelu"])) for _ in range(n)]
    tr = make_trace(sizes, fwd + bwd, tail=draw(gap), modules=modules, ops=ops)
    modes = {sg.name: draw(st.sampled_from(["keep", "whole", "selective"] if sg.cheap else ["keep", "whole"]))
             for sg in tr.segments}
    blocks = [sg for sg in tr.segments if modes[sg.name] != "keep"]
    rebuilt = {k for sg in blocks for k in sg.members}
    fp, fu = tr.first_pack, tr.first_unpack
    evs = []
    for k in range(n):
        if k not in rebuilt and draw(st.booleans()):
            so = draw(st.integers(int(fp[k]), int(fu[k]) - 1))
            evs.append(Eviction(k, so, draw(st.integers(so, int(fu[k])))))
    # links from far too slow for the step (where recompute pays) to fast
    hw = make_hw(d2h=draw(st.floats(1, 1000)), h2d=draw(st.floats(1, 1000)), latency=draw(st.floats(0, 0.5)))
    budget = draw(st.integers(tr.min_feasible_bytes, tr.peak_bytes_no_swap + 100))
    return tr, SwapPlan.of(tr, "random", evs, recompute=[n for n, m in modes.items() if m == "whole"],
                           selective=[n for n, m in modes.items() if m == "selective"]), hw, budget


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(joint_cases())
def test_properties_of_any_joint_plan(case):
    """R9 on any keep / swap / recompute plan: within budget, never faster than the joint floor,
    and its time is the ideal plus stalls plus the recomputed blocks' forward time."""
    tr, plan, hw, budget = case
    floor = joint_floor(tr, budget, hw)
    # every block recomputed and nothing swapped, the plan that most often beats R8's swap floor
    every = simulate(tr, SwapPlan.of(tr, "all", [], recompute=[sg.name for sg in tr.segments]), hw, budget)
    assert every.oom or every.iteration_s >= floor * (1 - 1e-9)
    r = simulate(tr, plan, hw, budget)
    assert simulate(tr, plan, hw, budget) == r
    if r.oom:
        return
    assert r.peak_bytes <= budget
    assert r.iteration_s >= floor * (1 - 1e-9)
    assert r.recompute_s == pytest.approx(sum(tr.segments[s].forward_s for s in plan.recomputed(tr))
                                          + sum(tr.segments[s].cheap_forward_s for s in plan.recomputed_selectively(tr)))
    assert r.iteration_s == pytest.approx(r.ideal_s + r.stall_s + r.recompute_s, abs=1e-9)
    moved = sum(tr.tensors[e.tensor].bytes for e in plan.evictions)
    assert r.d2h_bytes == r.h2d_bytes == moved


@settings(max_examples=100, deadline=None)
@given(traces_and_plans())
def test_keep_all_equals_ideal_when_it_fits(case):
    tr, _, hw, _ = case
    r = simulate(tr, [], hw, tr.peak_bytes_no_swap)
    assert not r.oom and r.iteration_s == pytest.approx(tr.ideal_s) and r.d2h_bytes == r.h2d_bytes == 0
    assert r.peak_bytes == tr.peak_bytes_no_swap
    assert simulate(tr, [], hw, tr.peak_bytes_no_swap - 1).oom


def test_swap_all_on_the_largest_corpus_trace_completes():
    from swapsched.env.corpus import load_corpus
    from swapsched.hardware import load_hardware

    tr = max(load_corpus(), key=lambda t: t.n_events)
    hw = load_hardware("h100-pcie5")
    evs = [Eviction(k, int(tr.last_forward_pack[k]), int(tr.first_unpack[k])) for k in range(tr.n_tensors)]
    r = simulate(tr, evs, hw, tr.peak_bytes_no_swap)
    assert not r.oom and np.isfinite(r.iteration_s)


# ---------------------------------------------------------------------------- R4, guard


def test_the_guard_evicts_what_the_plan_left_and_brings_it_back_on_demand(two_tensors, hw):
    # Budget 150, nothing planned: T1's 100 B at e1 has no room with T0 resident and no swap-out in
    # flight. Without the guard that is OOM. With it, T0 (released after gap 0, first unpack at e3,
    # the farthest) goes out at t=1 (1 s at 100 B/s), compute waits for it: stall 1, t=2. Gap 1
    # (t=3), e1; gap 2 (t=5), e2 frees T1; gap 3 (t=6), e3 needs T0: on demand, 1 s: 7.
    assert simulate(two_tensors, [], hw, 150).oom
    r = simulate(two_tensors, [], hw, 150, guard=True)
    assert (r.iteration_s, r.stall_s, r.guard_evictions, r.d2h_bytes, r.h2d_bytes) == (7.0, 2.0, 1, 100, 100)
    assert r.peak_bytes <= 150 and not r.oom


def test_a_planned_swap_out_the_guard_made_already_is_skipped_and_its_prefetch_stands(two_tensors, hw):
    # T0 planned out after e1 (too late for e1's allocation) and prefetched after e2. The guard
    # evicts T0 before gap 1 (out 1-2, t=2, gap 1 to t=3); e1's planned swap-out finds it gone. At
    # e2 (t=5) T1 is freed and the prefetch starts at once: in 5-6, done as e3 needs it (t=6): 6.
    plan = SwapPlan.of(two_tensors, "late", [Eviction(0, 1, 2)])
    assert simulate(two_tensors, plan, hw, 150).oom
    r = simulate(two_tensors, plan, hw, 150, guard=True)
    assert (r.iteration_s, r.guard_evictions, r.d2h_bytes, r.h2d_bytes) == (6.0, 1, 100, 100)


def test_a_tensor_the_program_still_holds_frees_nothing_when_the_guard_copies_it(two_tensors, hw):
    # T0 held by the program through gap 1 (released_at 1): the guard copies it out (as the
    # runtime's does), but its bytes stay until the program lets go, after e1's allocation, and
    # nothing else is on the device: over budget there, OOM (the runtime reports the overshoot).
    held = replace(two_tensors, tensors=(replace(two_tensors.tensors[0], released_at=1), two_tensors.tensors[1]))
    r = simulate(held, [], hw, 150, guard=True)
    assert r.oom and r.oom_event == 1 and r.guard_evictions == 1


def test_the_guard_takes_back_a_prefetch_made_too_early(hw):
    # T0, T1, T2 of 100 B, 1 s gaps: e0 pack0, e1 pack1, e2 pack2, e3 unpack2, e4 unpack1, e5
    # unpack0 (ideal 6). The plan: T0 out after e0 (in gap 1, 1-2 s) and prefetched after e1
    # (t=2: T0's bytes went with its copy, 100 + 100 <= 250; in 2-3). Budget 250: T2 at e2 (t=2)
    # has no room (T1, and T0's buffer): the guard takes the farthest, T0 (first unpack e5), back:
    # it waits for the copy to land (stall to t=3), then the buffer goes. Gaps 2-4 (t=6), gap 5
    # (t=7), e5 needs T0: on demand, 1 s: 8.
    tr = make_trace([100, 100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 1.0), ("unpack", 2, 1.0),
                                      ("unpack", 1, 1.0), ("unpack", 0, 1.0)])
    plan = SwapPlan.of(tr, "early", [Eviction(0, 0, 1)])
    assert simulate(tr, plan, hw, 250).oom
    r = simulate(tr, plan, hw, 250, guard=True)
    assert (r.iteration_s, r.stall_s, r.guard_evictions, r.d2h_bytes, r.h2d_bytes) == (8.0, 2.0, 1, 100, 200)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces_and_plans())
def test_the_guard_changes_nothing_where_the_plan_fits_and_keeps_the_budget_where_it_does_not(case):
    tr, plan, hw, budget = case
    plain, guarded = simulate(tr, plan, hw, budget), simulate(tr, plan, hw, budget, guard=True)
    if not plain.oom:
        assert guarded == plain and guarded.guard_evictions == 0
    elif not guarded.oom:
        assert guarded.guard_evictions > 0 and guarded.peak_bytes <= budget
        assert guarded.iteration_s >= analytic_floor(tr, budget, hw) - 1e-9


def test_the_guard_leaves_later_planned_swap_outs_to_the_plan(hw):
    # T0-T3 of 100 B, 1 s gaps: four packs, then unpacks of T3, T2, T1, T0 (ideal 8). The plan: T1
    # out after e2, back after e5. Budget 200. T2 at e2 has no room and nothing is in flight: the
    # guard takes T0 (first unpack e7, the farthest): out 2-3, stall 1 s. Gap 2 (t=4), e2: the
    # planned swap-out of T1, 4-5. T3 at e3 waits for it: stall 1 s (t=5), gap 3 (t=6). e4-e5 (t=8)
    # free T3, T2; T1's prefetch 8-9, in time for e6 (t=9); e7 (t=10) brings T0 on demand: 11. One
    # guard eviction: the plan's own swap-out was not skipped because the guard had acted once.
    tr = make_trace([100] * 4, [*(("pack", k, 1.0) for k in range(4)), *(("unpack", k, 1.0) for k in (3, 2, 1, 0))])
    r = simulate(tr, SwapPlan.of(tr, "one", [Eviction(1, 2, 5)]), hw, 200, guard=True)
    assert (r.iteration_s, r.stall_s, r.guard_evictions, r.d2h_bytes) == (11.0, 3.0, 1, 200)


def test_the_guard_never_evicts_what_a_recompute_is_rebuilding(hw):
    # blk.0 = anchor T0 and members T1, T2 (rebuilt at e5, T2's unpack); T3 outside; 100 B each,
    # 1 s gaps. Recomputing the block at budget 250: at e5 the anchor (kept for the recompute) and
    # the 200 B it rebuilds do not fit, and nothing else is on the device: OOM, with or without the
    # guard, which must not take T1 (first unpack e6) from the very rebuild that makes room for it.
    tr = make_trace([100] * 4, [*(("pack", k, 1.0) for k in range(4)), *(("unpack", k, 1.0) for k in (3, 2, 1, 0))],
                    modules=["blk.0.a", "blk.0.b", "blk.0.c", "head"])
    assert [(sg.anchor, sg.members, sg.at) for sg in tr.segments] == [(0, (1, 2), 5)]
    plan = SwapPlan.of(tr, "whole", [], recompute=["blk.0"])
    assert simulate(tr, plan, hw, 300).iteration_s == 11.0  # it fits at 300: ideal 8 + the block's forward, 3 s
    r = simulate(tr, plan, hw, 250, guard=True)
    assert r.oom and r.oom_event == 5 and r.guard_evictions == 0


def test_one_transfer_stream_runs_both_directions_in_issue_order(two_tensors, hw):
    # R10: at e1 (t=2) the plan swaps T1 out and prefetches T0 and T1 (T0 went out at e0: 1 -> 2).
    # Two streams: T1 out 2 -> 3 on d2h; h2d runs T0 2 -> 3, then T1 3 -> 4 (after its swap-out);
    # e2 (t=4) finds T1 back: step 5. One stream: T1 out 2 -> 3, T0 in 3 -> 4, T1 in 4 -> 5, so e2
    # waits 1 s for T1: step 6.
    plan = [Eviction(0, 0, 1), Eviction(1, 1, 1)]
    two = simulate(two_tensors, plan, hw, 300, record=True)
    assert two.timeline.h2d == ((2.0, 3.0, 0), (3.0, 4.0, 1)) and two.iteration_s == 5.0
    one = simulate(two_tensors, plan, replace(hw, copy_streams=1), 300, record=True)
    assert one.timeline.d2h == ((1.0, 2.0, 0), (2.0, 3.0, 1))
    assert one.timeline.h2d == ((3.0, 4.0, 0), (4.0, 5.0, 1))
    assert one.iteration_s == 6.0 and one.stall_bwd_s == 1.0


def test_the_compiled_executor_pays_no_host_cost(two_tensors, hw):
    # R10: hooks cost 0.5 s a call on the hook runtime (T0 out at e0 and back from e2, a fast
    # link: 4 events, +2 s); compiled, nothing
    costly = replace(hw, hook_cost_s=0.5, d2h_bytes_per_s=1e15, h2d_bytes_per_s=1e15)
    assert simulate(two_tensors, [Eviction(0, 0, 2)], costly, 300).iteration_s == pytest.approx(7.0)
    assert simulate(two_tensors, [Eviction(0, 0, 2)], costly.for_executor("compiled"), 300).iteration_s == pytest.approx(5.0)
    assert costly.for_executor("hooks") is costly
    with pytest.raises(Exception, match="unknown executor"):
        costly.for_executor("jit")


def test_the_host_peak_is_every_swapped_byte_held_to_the_steps_end(two_tensors, hw):
    # R11: T0 and T1 (100 B each) both swapped: the host holds 200 B at once (the pool keeps a
    # swapped tensor's buffer until the step ends), however early T0 came back
    r = simulate(two_tensors, [Eviction(0, 0, 1), Eviction(1, 1, 2)], hw, 300)
    assert r.host_peak_bytes == 200 and r.host_skipped == 0


def test_a_swap_out_the_host_budget_cannot_hold_stays_on_the_device(two_tensors, hw):
    # R11: host budget 150 B: T0's swap-out (100 B) fits, T1's does not; T1 stays resident, no
    # copy, no stall for it. At a device budget of 300 B that is fine (step 5 s, ideal); at 100 B
    # T1 cannot be made room for: OOM at e1, the plan cannot meet both budgets
    small_host = replace(hw, host_budget_bytes=150)
    plan = [Eviction(0, 0, 2), Eviction(1, 1, 2)]
    r = simulate(two_tensors, plan, small_host, 300)
    assert r.host_peak_bytes == 100 and r.host_skipped == 1 and r.d2h_bytes == 100 and r.iteration_s == 5.0
    assert simulate(two_tensors, plan, hw.with_host(host_budget_bytes=10**6), 100).oom is False
    r = simulate(two_tensors, [Eviction(0, 0, 2)], replace(hw, host_budget_bytes=50), 100)
    assert r.oom and r.oom_event == 1 and r.host_skipped == 1


def test_ranks_sharing_the_host_share_its_bandwidth(two_tensors, hw):
    # R11: the host's memory moves 200 B/s, shared by every rank's two copy streams. One rank:
    # the link's own 100 B/s: T0 out 1 -> 2. Two ranks: 200 / (2 x 2) = 50 B/s each, so 1 -> 3: the
    # copy time doubles, and the on-demand copy back at e3 (t=5) takes 2 s: step 7 s against 6 s
    host = replace(hw, host_memory_bytes_per_s=200.0)
    one = simulate(two_tensors, [Eviction(0, 0, 3)], host, 300, record=True)
    two = simulate(two_tensors, [Eviction(0, 0, 3)], host.with_host(ranks_per_host=2), 300, record=True)
    assert one.timeline.d2h == ((1.0, 2.0, 0),) and two.timeline.d2h == ((1.0, 3.0, 0),)
    assert one.iteration_s == 6.0 and two.iteration_s == 7.0
    assert host.with_host(ranks_per_host=2).name == "hand@2ranks"
    # one rank: the link's figure, even where the host's memory is slower (it was measured so)
    slow = replace(hw, host_memory_bytes_per_s=10.0)
    assert simulate(two_tensors, [Eviction(0, 0, 3)], slow, 300).iteration_s == 6.0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(share=st.floats(0.05, 1.0), which=st.sampled_from(["swap-all", "min", "capuchin", "vdnn-all", "checkpoint-offload"]))
def test_no_policys_plan_holds_more_on_the_host_than_the_host_budget(share, which):
    # R11, a property: whatever a policy plans, what the step holds on the host stays within the
    # host budget (a swap-out without room stays on the device), guard or not
    from swapsched.agents.registry import get_policy
    from swapsched.env.corpus import load_corpus
    from swapsched.hardware import load_hardware

    trace = load_corpus("test")[0]
    hw = load_hardware("h100-pcie5")
    budget = trace.static_bytes + (trace.peak_bytes_no_swap - trace.static_bytes) // 2
    plan = get_policy(which).plan(trace, budget, hw)
    everything = sum(trace.tensors[e.tensor].bytes for e in plan.evictions)
    limit = max(1, int(share * everything))
    for guard in (False, True):
        r = simulate(trace, plan, hw.with_host(host_budget_bytes=limit), budget, guard=guard)
        assert r.host_peak_bytes <= limit
        if limit < everything and not guard:
            assert r.host_skipped > 0 or r.oom  # it did not all fit: some swap-outs stayed (unless it stopped first)


def test_a_tensor_unpacked_twice_lives_until_its_last_unpack(hw):
    """R1/R3: T0 (100 B) is read at e2 and again at e4; T1 (50 B) at e3, where 200 B of other
    memory are live. During e3's gap T0, T1 and the other bytes are all resident: 350 B. Freeing T0
    at its first unpack would give 250 B, and a 300 B budget would wrongly fit."""
    tr = make_trace([100, 50], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 0, 1.0), ("unpack", 1, 1.0),
                                ("unpack", 0, 1.0)], other=[0, 0, 0, 200, 0])
    r = simulate(tr, [], hw, 10**6)
    assert r.peak_bytes == 350 and not r.oom
    assert simulate(tr, [], hw, 300).oom
    # swapped out and prefetched before e2, T0's buffer also stays through e4
    r = simulate(tr, [Eviction(0, 0, 1)], hw, 10**6)
    assert r.peak_bytes == 350


def test_a_host_budget_of_exactly_a_tensors_bytes_holds_it(two_tensors, hw):
    # R11 at the boundary: a host budget of exactly T0's 100 B takes T0's swap-out, planned
    # (nothing skipped) or the guard's (budget 150, nothing planned: the guard's case above)
    exact = replace(hw, host_budget_bytes=100)
    r = simulate(two_tensors, [Eviction(0, 0, 2)], exact, 200)
    assert r.host_skipped == 0 and r.d2h_bytes == 100 and r.host_peak_bytes == 100
    r = simulate(two_tensors, [], exact, 150, guard=True)
    assert not r.oom and r.guard_evictions == 1 and r.iteration_s == 7.0


def test_a_list_of_evictions_with_blocks_is_checked_as_the_plan_it_stands_for(one_block, hw):
    # simulate(evictions, recompute=, selective=) builds the SwapPlan whose R7/R9 check it runs:
    # blk.0's member T1 cannot be swapped while the block is recomputed (it is rebuilt), and the
    # block recomputed whole is that plan exactly (blk.0 has no cheap member: it could not be
    # checkpointed selectively, so a mix-up of the two lists fails)
    with pytest.raises(PlanError, match="blk.0"):
        simulate(one_block, [Eviction(1, 1, 4)], hw, 300, recompute=[0])
    whole = SwapPlan.of(one_block, "hand", [Eviction(0, 0, 4)], recompute=["blk.0"])
    assert simulate(one_block, [Eviction(0, 0, 4)], hw, 300, recompute=[0]) == simulate(one_block, whole, hw, 300)


def test_a_recompute_holds_again_what_its_forward_does_not_save(hw):
    # R9 with R3: one_block's shape, its forward holding 50 B it does not save in gap 1 (T1's
    # producer's input, say) and backward a 30 B gradient made in gap 4 that the block's backward
    # reads in gap 5. The recompute at e4 holds T0, the rebuilt T1 and those 50 B again for a
    # moment, beside the 30: 280 B, more than the forward's fullest gap (T0, T1 and 50 B: 250).
    events = [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 1.0), ("unpack", 2, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)]
    trace = make_trace([100, 100, 100], events, modules=["blk.0.ln", "blk.0.fc", "head"], other=[0, 50, 0, 0, 30, 30])
    assert [(sg.name, sg.transient_bytes) for sg in trace.segments] == [("blk.0", 50)]
    plan = SwapPlan.of(trace, "hand", [], recompute=["blk.0"])
    assert simulate(trace, plan, hw, 260).oom_event == 4
    r = simulate(trace, plan, hw, 280)
    assert not r.oom and r.peak_bytes == 280
    # gap 4's 30 B die within it (a workspace): the recompute, between gaps 4 and 5, holds none of
    # them: T0, T1 and the 50 B, 250 B
    trace = make_trace([100, 100, 100], events, modules=["blk.0.ln", "blk.0.fc", "head"], other=[0, 50, 0, 0, 30, 0])
    r = simulate(trace, SwapPlan.of(trace, "hand", [], recompute=["blk.0"]), hw, 250)
    assert not r.oom and r.peak_bytes == 250


def test_a_recomputes_transient_counts_only_the_members_made_by_then():
    # R3 for R9: block blk.0 of anchor T0 and members T1 (packed at e1) and T2 (e2), 100 B each.
    # Gap 1 holds 80 B it does not save, while only T1 is made: 180 B above the forward's least,
    # below its members' 200, so nothing beyond them; with 150 B there: 250, 50 beyond them.
    events = [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 1.0), ("pack", 3, 1.0),
              ("unpack", 3, 1.0), ("unpack", 2, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)]
    modules = ["blk.0.ln", "blk.0.fc", "blk.0.act", "head"]
    for gap_1, beyond in ((80, 0), (150, 50)):
        trace = make_trace([100] * 4, events, modules=modules, other=[0, gap_1, 0, 0, 0, 0, 0, 0])
        assert [(sg.name, sg.members, sg.transient_bytes) for sg in trace.segments] == [("blk.0", (1, 2), beyond)]
