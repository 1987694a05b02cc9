"""agents/bound.py: the relaxation is a bound (never above any plan's simulated step), never below
the R8 floor, and tighter than the floor where copies have latency."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swapsched.agents import get_policy
from swapsched.agents.bound import _spread, lower_bound
from swapsched.agents.optimal import Optimal
from swapsched.env.corpus import load_corpus
from swapsched.env.floors import analytic_floor, joint_floor
from swapsched.env.simulator import simulate
from swapsched.hardware import load_hardware
from swapsched.plan import Eviction, SwapPlan
from tests.agents.test_policies import small_cases
from tests.conftest import make_hw, make_trace
from tests.env.test_simulator import joint_cases

POLICIES = ["no-swap", "swap-all", "vdnn-all", "min", "capuchin", "local-search"]
ULP = 1 + 1e-12  # the floor and the simulator sum the same gaps in different orders


def _random_plan(tr, draw_int):
    evs = []
    for k in range(tr.n_tensors):
        fp, fu = int(tr.first_pack[k]), int(tr.first_unpack[k])
        if draw_int(0, 1):
            so = draw_int(fp, fu - 1)
            evs.append(Eviction(k, so, draw_int(so, fu)))
    return evs


# 30 cases a run (was 60: 40 s of the default run on 2 cores); each run draws new ones
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_cases(), st.data())
def test_bound_is_below_every_plan_and_above_the_floor(case, data):
    tr, hw, budget = case
    bound = lower_bound(tr, budget, hw)
    assert bound.bound_s >= analytic_floor(tr, budget, hw)
    best = simulate(tr, Optimal().plan(tr, budget, hw), hw, budget)
    assert bound.bound_s <= best.iteration_s * ULP  # the exhaustive optimum over lfp swap-outs
    for name in POLICIES:
        r = simulate(tr, get_policy(name, search_seconds=0.05).plan(tr, budget, hw), hw, budget)
        if not r.oom:
            assert bound.bound_s <= r.iteration_s * ULP, name
    for _ in range(5):  # random plans, swap-outs anywhere R7 allows
        r = simulate(tr, _random_plan(tr, lambda a, b: data.draw(st.integers(a, b))), hw, budget)
        if not r.oom:
            assert bound.bound_s <= r.iteration_s * ULP


# bert-base (30 s of the solver on 2 cores) is slow; unet keeps a corpus trace in the default run
@pytest.mark.parametrize("name", [pytest.param("bert-base-b16-h100-pcie5", marks=pytest.mark.slow), "unet-medium-b64-h100-pcie5"])
def test_bound_is_below_the_plans_on_corpus_traces(name):
    tr = load_corpus(names=[name])[0]
    hw = load_hardware("h100-pcie5")
    for frac in (3, 7):
        budget = tr.static_bytes + (tr.peak_bytes_no_swap - tr.static_bytes) * frac // 10
        bound = lower_bound(tr, budget, hw, time_limit_s=20)
        assert bound.status in ("milp", "milp-time-limit", "lp", "floor")
        for pol in ["min", "capuchin", "local-search"]:
            r = simulate(tr, get_policy(pol, search_seconds=0.3).plan(tr, budget, hw), hw, budget)
            assert bound.bound_s <= r.iteration_s, pol


def test_latency_makes_the_bound_tighter_than_the_floor():
    # T0, T1 of 100 B; 100 B/s links with 0.5 s latency per copy. Budget 100 B: when T1 is made
    # (gap 1) T0 must be away. The floor charges 1 s each way without latency: 5 s. The relaxation:
    # T0's copy out (1.5 s) starts after event 0 and ends before gap 1 starts, so S_1 >= 1.5, and
    # stalls are never undone: 5 + 1.5 = 6.5, the same from its swap-out row alone (no copy-engine
    # windows), and from the LP relaxation (T0 away is forced either way).
    tr = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)])
    hw = make_hw(latency=0.5)
    assert analytic_floor(tr, 100, hw) == 5.0
    best = simulate(tr, Optimal().plan(tr, 100, hw), hw, 100)
    assert best.iteration_s == 7.0
    bound = lower_bound(tr, 100, hw)
    assert bound.bound_s == pytest.approx(6.5, rel=1e-6) and bound.status == "milp" and bound.bound_s <= best.iteration_s
    assert lower_bound(tr, 100, hw, windows=0).bound_s == pytest.approx(6.5, rel=1e-6)
    lp = lower_bound(tr, 100, hw, integer=False)
    assert lp.bound_s == pytest.approx(6.5, rel=1e-6) and lp.status == "lp"


def test_a_swap_in_must_fit_between_its_gap_and_its_first_unpack():
    # T0 100 B, T1 50 B; 0.5 s latency, so each copy of T0 takes 1.5 s. Gaps 1, 0.2, 0.2, 1 (ideal
    # 2.4). Budget 100: T0 is away when T1 is made (gap 1). Out: S_1 >= 1.5 as above. In: the copy
    # back starts after gap 1 starts and ends with event 2, T0's first unpack, 0.4 s of compute
    # later: S_3 - S_1 >= 1.5 - 0.4 = 1.1. Bound 2.4 + 1.5 + 1.1 = 5.0 (the floor: 2.4).
    tr = make_trace([100, 50], [("pack", 0, 1.0), ("pack", 1, 0.2), ("unpack", 0, 0.2), ("unpack", 1, 1.0)])
    hw = make_hw(latency=0.5)
    assert analytic_floor(tr, 100, hw) == pytest.approx(2.4)
    best = simulate(tr, Optimal().plan(tr, 100, hw), hw, 100)
    for windows in (0, 12):  # the per-tensor rows alone, and with the engines' windows
        bound = lower_bound(tr, 100, hw, windows=windows)
        assert bound.bound_s == pytest.approx(5.0, rel=1e-6) and bound.bound_s <= best.iteration_s


def test_two_swap_ins_share_the_host_to_device_engine_after_one_gap():
    # T0, T1 of 100 B, T2 of 200 B; 100 B/s, budget 200; gaps 1, 1, 0, 0, 0, 0.5 (ideal 2.5). T2's
    # gap (2, ideal start t=2) needs T0 and T1 away: T1's copy out after event 1 gives S_2 >= 1.
    # Backward reads T2, T1 (event 4), T0 (event 5) with 0 and 0.5 s of compute after gap 2 starts:
    # one h2d engine copies both (2 s) by event 5: S_6 - S_2 >= 2 - 0.5 = 1.5. Bound 2.5 + 1 + 1.5 =
    # 5, the optimum (T0 out 1 -> 2, T1 2 -> 3, back 3 -> 4 -> 5). Per tensor alone, T1 back by
    # event 4 gives only S_6 - S_2 >= 1: 4.5 without the windows.
    tr = make_trace([100, 100, 200], [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 0.0), ("unpack", 2, 0.0),
                                      ("unpack", 1, 0.0), ("unpack", 0, 0.5)])
    hw = make_hw()
    best = simulate(tr, Optimal().plan(tr, 200, hw), hw, 200)
    assert best.iteration_s == 5.0 and analytic_floor(tr, 200, hw) == 4.0
    bound = lower_bound(tr, 200, hw)
    assert bound.bound_s == pytest.approx(5.0, rel=1e-6) and bound.bound_s <= best.iteration_s
    assert lower_bound(tr, 200, hw, windows=0).bound_s == pytest.approx(4.5, rel=1e-6)


def test_two_swap_outs_share_the_device_to_host_engine_before_one_gap():
    # T0, T1 of 100 B, T2 of 200 B; 100 B/s links, no latency; budget 200. Gaps 1, 0, 0, 1, 1, 1
    # (ideal 4 s). T2's gap (e2, ideal start t=1) needs both T0 and T1 away. T0 can leave after
    # e0 (t=1), T1 after e1 (t=1); one d2h engine copies them one after the other, 1 -> 2 -> 3, so
    # gap 2 starts at 3: 2 s stall, and the backward copies fit in its 1 s gaps (T2 is freed at
    # e3, then T1 and T0 come back 4 -> 5 -> 6 for e4 at 5 and e5 at 6). Step 6 s, the optimum.
    # Each copy alone needs only 1 s before gap 2 and the R8 floor is max(1, 2) + max(3, 2) = 5:
    # only the engine's capacity over [end of gap 0, start of gap 2] proves 6.
    tr = make_trace([100, 100, 200], [("pack", 0, 1.0), ("pack", 1, 0.0), ("pack", 2, 0.0), ("unpack", 2, 1.0),
                                      ("unpack", 1, 1.0), ("unpack", 0, 1.0)])
    hw = make_hw()
    assert analytic_floor(tr, 200, hw) == 5.0
    best = simulate(tr, Optimal().plan(tr, 200, hw), hw, 200)
    assert best.iteration_s == 6.0
    bound = lower_bound(tr, 200, hw)
    assert bound.bound_s == pytest.approx(6.0, rel=1e-6) and bound.status == "milp" and bound.bound_s <= best.iteration_s


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(joint_cases())
def test_the_joint_bound_is_below_every_keep_swap_recompute_plan(case):
    """R9: the bound with recompute variables holds for plans that recompute, and for the joint
    planners' plans; the swap-only bound need not."""
    tr, plan, hw, budget = case
    bound = lower_bound(tr, budget, hw)
    assert bound.bound_s >= joint_floor(tr, budget, hw) * (1 - 1e-9)
    plans = [plan, *(get_policy(n, search_seconds=0.05).plan(tr, budget, hw) for n in ("checkpoint-all", "checkpoint-selective", "capuchin", "default"))]
    for p in plans:
        r = simulate(tr, p, hw, budget)
        if not r.oom:
            assert bound.bound_s <= r.iteration_s * ULP, p.policy


def test_recompute_tightens_nothing_it_cannot_prove(one_block):
    # one_block at 200 B on a 10 B/s link: swapping T1 costs 10 s each way, recomputing its block
    # 2 s. The swap-only bound is above the recompute plan's 8 s step; the joint bound is not.
    hw = make_hw(d2h=10, h2d=10)
    plan = simulate(one_block, get_policy("checkpoint-all").plan(one_block, 200, hw), hw, 200)
    assert plan.iteration_s == 8.0
    assert lower_bound(one_block, 200, hw, recompute=False).bound_s > 8.0
    # Joint: T1 away at gap 2 costs 10 s out (S_2 - S_1 >= 10), T0 away 9 s out and 6 s back; the
    # block recomputed frees T1 for its 2 s forward at event 4 (S_5 - S_4 >= 2): 6 + 2 = 8, above
    # the joint floor's fractional mix (7.6), in the MILP and in its LP relaxation alike.
    joint = lower_bound(one_block, 200, hw)
    assert joint.bound_s == pytest.approx(8.0, rel=1e-6) and joint.status == "milp" and joint.floor_s == pytest.approx(7.6)
    assert lower_bound(one_block, 200, hw, integer=False).bound_s == pytest.approx(8.0, rel=1e-6)


def test_hooks_tail_static_and_workspace_enter_the_bound():
    # test_latency_makes_the_bound_tighter_than_the_floor's case with 0.25 s per hook and a 0.5 s
    # tail: the gaps are 1.25 1.25 2.25 1.25 (6 s), 6.5 with the tail; S_1 >= 1.5 as
    # there: 8.0. With 30 B static and 10 B of workspace in gap 1 instead, budget 225: 240 B there,
    # so T0 must be away (S_1 >= 1.5): 5 + 1.5 = 6.5, where the workspace counted negatively would
    # leave nothing over budget.
    two = [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)]
    hw = make_hw(latency=0.5)
    hooked = type(hw)(**{**hw.to_dict(), "hook_cost_s": 0.25})
    b = lower_bound(make_trace([100, 100], two, tail=0.5), 100, hooked)
    assert b.bound_s == pytest.approx(8.0, rel=1e-6) and b.status == "milp" and 0 <= b.solve_s < 60
    b = lower_bound(make_trace([100, 100], two, static=30, other=[0, 10, 0, 0]), 225, hw)
    assert b.bound_s == pytest.approx(6.5, rel=1e-6) and b.gaps == 1


def test_nothing_over_budget_no_events_or_a_floor_above_the_relaxation_return_the_floor():
    two = [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)]
    hw = make_hw()
    fits = lower_bound(make_trace([100, 100], two), 200, hw)
    assert (fits.bound_s, fits.floor_s, fits.status, fits.gaps, fits.variables) == (5.0, 5.0, "floor", 0, 0)
    assert 0 <= fits.solve_s < 60
    empty = lower_bound(make_trace([], [], tail=0.5), 0, hw)
    assert (empty.bound_s, empty.status, empty.gaps, empty.variables) == (0.5, "floor", 0, 0)
    # 150 B of workspace in gap 2 (an unpack's gap, which the relaxation does not check), budget 150,
    # 25 B/s: the floor there is max(2, 200/25) + max(3, 8) = 16; the relaxation, from gap 1 alone
    # (T0 away: 4 s out), says 5 + 4 = 9. The bound is the floor's 16.
    slow = make_hw(d2h=25, h2d=25)
    tr = make_trace([100, 100], two, other=[0, 0, 150, 0])
    b = lower_bound(tr, 150, slow)
    assert analytic_floor(tr, 150, slow) == 16.0 and b.bound_s == 16.0 and b.status == "floor" and b.variables > 0


def test_two_blocks_each_with_its_own_recompute_variable():
    # Blocks a.0 (anchor T0, members T1 T2: 200 B, 3 s forward, recomputed at e9) and a.1 (anchor
    # T3, member T4: 100 B, 2 s, at e7); T5 outside; 100 B each, 1 s gaps (ideal 12 s), 10 B/s, so
    # a swap costs 10 s each way. Budget 400: 200 B must be away in gap 5 and 100 in gap 4; a.0's
    # members are absent there from their releases: recompute a.0, 3 s: 15. Budget 300: gap 5
    # needs 300 B, a.0 frees 200 and a.1 (T4, absent from gap 5) 100: both, 3 + 2 s: 17.
    tr = make_trace([100] * 6, [*(("pack", k, 1.0) for k in range(6)), *(("unpack", k, 1.0) for k in reversed(range(6)))],
                    modules=["a.0.x", "a.0.y", "a.0.z", "a.1.x", "a.1.y", "head"])
    assert [(sg.name, sg.members, sg.at, sg.forward_s) for sg in tr.segments] == [("a.0", (1, 2), 9, 3.0), ("a.1", (4,), 7, 2.0)]
    slow = make_hw(d2h=10, h2d=10)
    assert lower_bound(tr, 400, slow).bound_s == pytest.approx(15.0, rel=1e-6)
    assert lower_bound(tr, 300, slow).bound_s == pytest.approx(17.0, rel=1e-6)


def test_a_recomputed_member_is_not_also_counted_away_by_a_swap():
    # blk.0 = anchor T0 (200 B), member T1 (100 B, forward 1 + 2 = 3 s, recomputed at e3); T2 200 B
    # outside. Gaps 1, 2, 0.5, 2, 1, 1 (ideal 7.5 s); d2h 200 B/s, h2d 25 B/s. Budget 375: only
    # gap 2 is over, by 125 B. T1's swap-in (4 s) would have to run between gap 2's start and the end
    # of e3 (2.5 s): 1.5 s of stall, which the recompute's own 3 s at e3 would cover. Swapping T1
    # (100 B) as well as recomputing it (100 B absent) counted its bytes twice and "fit" for
    # 3 + 0.5 s: 11. A member is never also evicted (R9), so 125 B away needs T0 out, whose 8 s
    # swap-in leaves 4.5 s of stall before e4 ends: 12. (The best plan, found by enumeration, is
    # 20.5 s.)
    tr = make_trace([200, 100, 200], [("pack", 0, 1.0), ("pack", 1, 2.0), ("pack", 2, 0.5), ("unpack", 1, 2.0),
                                      ("unpack", 0, 1.0), ("unpack", 2, 1.0)], modules=["blk.0.a", "blk.0.b", "head"])
    assert [(sg.anchor, sg.members, sg.at, sg.forward_s) for sg in tr.segments] == [(0, (1,), 3, 3.0)]
    b = lower_bound(tr, 375, make_hw(d2h=200, h2d=25))
    assert b.bound_s == pytest.approx(12.0, rel=1e-6) and b.status == "milp"


def test_a_member_of_a_later_block_is_not_also_counted_away_by_a_swap():
    # The case above as blk.1, after a blk.0 of two 1 B tensors (U3 anchor, U4 member) packed first;
    # ids: T0 200 B (blk.1's anchor), T1 100 B (its member, recomputed at e5 in 1 + 2 = 3 s), T2
    # 200 B outside, U3, U4. Gaps 1, 1, 1, 2, 0.5, 2, 1, 1, 1, 1: ideal 11.5 s. Budget 377: gap 4 is
    # 502 B, 125 over. Without T0, at most T1's 100 B and the U's 2 B can be away, so T0 goes out
    # (1 s, in gap 3) and its 8 s swap-in runs from gap 4's start to e6's end: 0.5 + 2 + 1 = 3.5 s
    # and the 3 s of any recompute at e5 in between, 4.5 s of stall either way: 16. Counting T1
    # swapped and recomputed at once would free 200 B for 3 s of recompute and 0.5 s of T1's copy
    # out (it is made in gap 3, needed away in gap 4): 15. Each block has its own exclusion rows.
    tr = make_trace([200, 100, 200, 1, 1], [("pack", 3, 1.0), ("pack", 4, 1.0), ("pack", 0, 1.0), ("pack", 1, 2.0),
                                            ("pack", 2, 0.5), ("unpack", 1, 2.0), ("unpack", 0, 1.0), ("unpack", 2, 1.0),
                                            ("unpack", 4, 1.0), ("unpack", 3, 1.0)],
                    modules=["blk.1.a", "blk.1.b", "head", "blk.0.a", "blk.0.b"])
    assert [(sg.index, sg.anchor, sg.members, sg.at) for sg in tr.segments] == [(0, 3, (4,), 8), (1, 0, (1,), 5)]
    b = lower_bound(tr, 377, make_hw(d2h=200, h2d=25))
    assert b.bound_s == pytest.approx(16.0, rel=1e-6) and b.status == "milp"


def test_a_selective_recompute_has_its_own_variable():
    # tests/env/test_simulator.py's selective case: blk.0 = anchor T0, members T1 (addmm, held by
    # selective checkpointing) and T2 (gelu, rebuilt in 1 s; the whole block in 3 s); 100 B each,
    # 1 s gaps (ideal 8 s), at 1 B/s a swap costs 100 s. Budget 300: 100 B away in gap 3. T2 rebuilt
    # selectively frees them for 1 s at e5: 9, the simulated selective plan, so the bound is tight
    # there. Without the selective variable the cheapest is the whole block, 3 s: 11.
    tr = make_trace([100, 100, 100, 100], [*(("pack", k, 1.0) for k in range(4)), *(("unpack", k, 1.0) for k in (3, 2, 1, 0))],
                    ops=["native_layer_norm", "addmm", "gelu", "addmm"], modules=["blk.0.ln", "blk.0.fc", "blk.0.act", "head"])
    slow = make_hw(d2h=1, h2d=1)
    b = lower_bound(tr, 300, slow)
    assert b.bound_s == pytest.approx(9.0, rel=1e-6) and b.status == "milp"
    assert simulate(tr, SwapPlan.of(tr, "hand", [], selective=["blk.0"]), slow, 300).iteration_s == 9.0
    whole_only = replace(tr.segments[0], cheap=(), cheap_forward_s=0.0, cheap_bytes=0)
    tr.__dict__["segments"] = (whole_only,)  # the cached property, as Trace.with_segments sets it
    assert lower_bound(tr, 300, slow).bound_s == pytest.approx(11.0, rel=1e-6)


def test_two_selective_blocks_each_with_their_own_variables():
    # blk.0 = anchor T0, members T1 (addmm, held), T2 (gelu, cheap: 1 s); blk.1 likewise with T3,
    # T4, T5 (cheap: 0.5 s; the whole block 2.5 s); T6 outside. 100 B each, ideal 13.5 s; at 1 B/s
    # swapping costs 100 s a tensor. Gap 6 holds all 700 B. Budget 600: 100 B away, blk.1's cheap
    # member for 0.5 s: 14. 500: both blocks selectively, 1.5 s: 15. 400: 300 B, blk.1 whole
    # (200 B, 2.5 s) and blk.0 selectively (1 s): 17.
    gaps = [1, 1, 1, 1, 1, 0.5, 1]
    tr = make_trace([100] * 7, [*(("pack", k, gaps[k]) for k in range(7)), *(("unpack", k, 1.0) for k in reversed(range(7)))],
                    ops=["native_layer_norm", "addmm", "gelu"] * 2 + ["addmm"],
                    modules=["blk.0.ln", "blk.0.fc", "blk.0.act", "blk.1.ln", "blk.1.fc", "blk.1.act", "head"])
    assert [(sg.cheap, sg.forward_s, sg.cheap_forward_s) for sg in tr.segments] == [((2,), 3.0, 1.0), ((5,), 2.5, 0.5)]
    slow = make_hw(d2h=1, h2d=1)
    for budget, want in ((600, 14.0), (500, 15.0), (400, 17.0)):
        assert lower_bound(tr, budget, slow).bound_s == pytest.approx(want, rel=1e-6), budget


def test_a_block_is_not_recomputed_whole_and_selectively_at_once():
    # The selective case's trace with T0 (the anchor) held through gap 3, where T3 is made: only
    # blk.0's members can be away there, 200 B of the 250 B that budget 150 needs. No plan fits, so
    # the relaxation is infeasible and the bound is the floor (8 s: the floor lets any 250 B be
    # swapped in the 3 s before gap 3). Recomputing the block whole and selectively at once would
    # "free" 300 B for 3 + 1 s: 12, above the floor, from a combination no plan has. (The rows
    # that keep a member from being both evicted and recomputed forbid it: e + r + q <= 1.)
    tr = make_trace([100, 100, 100, 100], [*(("pack", k, 1.0) for k in range(4)), *(("unpack", k, 1.0) for k in (3, 2, 1, 0))],
                    ops=["native_layer_norm", "addmm", "gelu", "addmm"], modules=["blk.0.ln", "blk.0.fc", "blk.0.act", "head"])
    tr = replace(tr, tensors=(replace(tr.tensors[0], released_at=3), *tr.tensors[1:]))
    b = lower_bound(tr, 150, make_hw())
    assert b.status == "floor" and b.bound_s == b.floor_s == pytest.approx(8.0)


def test_one_byte_over_budget_puts_a_whole_tensor_away():
    # test_latency_makes_the_bound_tighter_than_the_floor's case at budget 199: gap 1 is 1 B over, and
    # a tensor is away whole or not at all (e is binary), so T0's 1.5 s copy out still precedes gap
    # 1: 6.5. The floor lets 1 B go in 0.01 s: 5.
    tr = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)])
    hw = make_hw(latency=0.5)
    b = lower_bound(tr, 199, hw)
    assert b.bound_s == pytest.approx(6.5, rel=1e-6) and b.floor_s == 5.0 and b.status == "milp"


def test_a_tensor_the_program_still_holds_cannot_be_away():
    # R2: T0 released_at 1 (the program holds it through gap 1, where T1 is made). Budget 150: gap 1
    # is 50 B over and nothing may be away there (T1 is being made, T0 is held): no variable, the
    # floor is the answer (no plan fits: the smallest feasible budget is 200).
    tr = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)])
    held = replace(tr, tensors=(replace(tr.tensors[0], released_at=1), tr.tensors[1]))
    b = lower_bound(held, 150, make_hw(latency=0.5))
    assert (b.bound_s, b.floor_s, b.status, b.gaps, b.variables) == (5.0, 5.0, "floor", 1, 0)
    assert 0 <= b.solve_s < 60 and held.min_feasible_bytes == 200


def test_max_gaps_checks_the_most_over_gaps_first():
    # Four 100 B tensors, 1 s gaps (ideal 8), 100 B of workspace in gap 2; 100 B/s, 0.5 s latency;
    # budget 250. Demand 100 200 400 400 at the forward gaps: gaps 2 and 3 are 150 B over. Gap 2
    # alone: T0 and T1 both away (100 B each, whole), one d2h engine, 1.5 s each, in [end of gap 0,
    # start of gap 2] = 1 s + S_2: S_2 >= 2, bound 10; gap 3 adds nothing here. max_gaps 1 or 2 checks
    # gap 2 only (the most over half first, ties in event order, then an even spread of the rest).
    four = [*(("pack", k, 1.0) for k in range(4)), *(("unpack", k, 1.0) for k in (3, 2, 1, 0))]
    tr = make_trace([100] * 4, four, other=[0, 0, 100, 0, 0, 0, 0, 0])
    hw = make_hw(latency=0.5)
    assert lower_bound(tr, 250, hw).gaps == 2
    for most in (1, 2):
        b = lower_bound(tr, 250, hw, max_gaps=most)
        assert b.gaps == 1 and b.bound_s == pytest.approx(10.0, rel=1e-6)


def test_spread_picks_evenly_and_keeps_short_lists():
    assert _spread(np.arange(10), 4).tolist() == [0, 3, 6, 9]
    assert _spread(np.array([2, 5, 7]), 2).tolist() == [2, 7]
    assert _spread(np.array([2, 5]), 3).tolist() == [2, 5]


def test_a_block_member_the_program_still_holds_is_not_freed_by_recomputing(one_block):
    # test_recompute_tightens_nothing_it_cannot_prove's case (10 B/s: a swap costs 10 s each way),
    # with T1 held by the program through gap 2 (released_at 2), where T2 is made and 100 B must go.
    # Recomputing the block frees T1 only from gap 3, so T0 must be swapped: out after e0, done before
    # gap 2 (S_2 >= 10 - 1 = 9), back by its unpack at e5 (S_6 - S_2 >= 10 - 4 = 6): 6 + 15 = 21, where
    # recompute alone gave 8. The floor: max(2, 10) + max(4, 10) = 20.
    held = replace(one_block, tensors=(one_block.tensors[0], replace(one_block.tensors[1], released_at=2),
                                       one_block.tensors[2]))
    b = lower_bound(held, 200, make_hw(d2h=10, h2d=10))
    assert b.bound_s == pytest.approx(21.0, rel=1e-6) and b.floor_s == pytest.approx(20.0)


def test_where_the_solver_proves_nothing_the_bound_is_the_floor(monkeypatch):
    # HiGHS stopped without a dual bound (None) or with an infinite or undefined one: only the floor
    # is proven. test_latency_makes_the_bound_tighter_than_the_floor's case, whose floor is 5.
    import swapsched.agents.bound as bound_module

    tr = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)])
    for proven in (None, float("nan"), float("-inf")):
        result = type("Result", (), {"status": 1, "mip_dual_bound": proven, "fun": None})()
        monkeypatch.setattr(bound_module, "milp", lambda *a, result=result, **k: result)
        b = lower_bound(tr, 100, make_hw(latency=0.5))
        assert (b.bound_s, b.floor_s, b.status, b.gaps) == (5.0, 5.0, "floor", 1) and b.variables > 0


def test_the_solver_gets_what_is_left_of_the_time_limit_and_at_least_half_a_second(monkeypatch):
    """HiGHS is given the time limit less what building the model took, never under 0.5 s."""
    import swapsched.agents.bound as bound_module

    real = bound_module.milp
    given: list[float] = []

    def spy(*args, options, **kwargs):
        given.append(options["time_limit"])
        return real(*args, options=options, **kwargs)

    monkeypatch.setattr(bound_module, "milp", spy)
    tr = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)])
    lower_bound(tr, 100, make_hw(latency=0.5), time_limit_s=30.0)
    assert 29.0 < given[-1] <= 30.0  # building a two-tensor model takes well under a second
    lower_bound(tr, 100, make_hw(latency=0.5), time_limit_s=0.0)
    assert given[-1] == 0.5
