"""env/floors.py: R8's floor and the joint floor, hand-computed (the arithmetic is in each test)
and against a brute-force grid over every split of swapped and recomputed bytes."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings

from swapsched.env.floors import analytic_floor, joint_floor
from tests.conftest import make_hw, make_trace
from tests.env.test_simulator import _with, joint_cases


def test_the_joint_floor_prices_a_whole_recompute_as_its_cheap_part_plus_the_rest():
    # Two blocks as tests/agents/test_bound.py's selective pair: blk.0's cheap member T2 costs 1 s,
    # its other member T1 the remaining 2 s; blk.1's T5 0.5 s, T4 2 s. At 1 B/s with budget 400,
    # 300 B must be away in gap 6 (5.5 s of compute before it, 8 s from it on): 5.5 B swapped in
    # those 5.5 s, and of the other 294.5 B the knapsack takes T5 (0.005 s/B), T2 (0.01 s/B), then
    # 94.5 B at 0.02 s/B: 0.5 + 1 + 1.89 = 3.39 s. Floor 5.5 + 8 + 3.39 = 16.89.
    gaps = [1, 1, 1, 1, 1, 0.5, 1]
    tr = make_trace([100] * 7, [*(("pack", k, gaps[k]) for k in range(7)), *(("unpack", k, 1.0) for k in reversed(range(7)))],
                    ops=["native_layer_norm", "addmm", "gelu"] * 2 + ["addmm"],
                    modules=["blk.0.ln", "blk.0.fc", "blk.0.act", "blk.1.ln", "blk.1.fc", "blk.1.act", "head"])
    assert joint_floor(tr, 400, make_hw(d2h=1, h2d=1)) == pytest.approx(16.89)


def test_joint_floor_hand_computed(one_block, hw):
    # Budget 200: gap 2 must be 100 B lighter. Swap alone (100 B/s): max(2, 1) + max(4, 1) = 6, the
    # ideal. Recompute frees T1 there for 2 s of compute after the gap: max(2, 0) + max(4 + 2, 0) = 8.
    # The cheapest mix is all swap: the floor is 6 (it may not exceed what swapping alone allows).
    assert joint_floor(one_block, 200, hw) == 6.0 == analytic_floor(one_block, 200, hw)
    slow = make_hw(d2h=10, h2d=10)  # swapping 100 B takes 10 s each way: max(2, 10) + max(4, 10) = 20
    assert analytic_floor(one_block, 200, slow) == 20.0
    # mixing: x bytes swapped, 100 - x recomputed at 0.02 s/B: max(2, x/10) + max(4 + 0.02 (100 - x), x/10);
    # x = 20 gives max(2, 2) + max(5.6, 2) = 7.6, x = 0 gives 2 + 6 = 8; the minimum is at x = 20
    assert joint_floor(one_block, 200, slow) == pytest.approx(7.6)


def test_joint_floor_with_three_blocks_hand_computed():
    # Three blocks, anchor + one 100 B member each: blk.0 = T0 T1 (forward 2 + 2 = 4 s), blk.1 = T2 T3
    # (1 + 1 = 2 s), blk.2 = T4 T5 (0.5 + 0.5 = 1 s): 0.04, 0.02 and 0.01 s per byte freed, cheapest
    # last in trace order. Backward unpacks T5 .. T0, 1 s each: step 7 + 6 = 13 s. Budget 300.
    # Gap 5 (before 6.5, after 6.5) holds 600 B: must 300. Absent if recomputed: T1 (gaps 2..10) and
    # T3 (4..8), not T5 (from 6), so at least 100 B are swapped, and R(y) is 0.02 s/B for T3's 100 B,
    # then 0.04 for T1's.
    g = [2.0, 2.0, 1.0, 1.0, 0.5, 0.5]
    tr = make_trace([100] * 6, [("pack", k, g[k]) for k in range(6)] + [("unpack", k, 1.0) for k in (5, 4, 3, 2, 1, 0)],
                    modules=["blk.0.a", "blk.0.b", "blk.1.a", "blk.1.b", "blk.2.a", "blk.2.b"])
    # 20 B/s each way: max(6.5, x/20) + max(6.5 + R(300 - x), x/20). Up to x = 130 the swap-out hides in
    # the 6.5 s before the gap and each swapped byte saves 0.04 s of recompute; past it the swap-out
    # costs 0.05 s/B: the minimum is at x = 130, 6.5 + 6.5 + 2 + 0.04 * 70 = 17.8. The other gaps ask
    # less (gap 6, all three blocks absent: at x = 140, 7 + 6 + 1 + 0.02 * 60 = 15.2, less than 17.8).
    assert joint_floor(tr, 300, make_hw(d2h=20, h2d=20)) == pytest.approx(17.8)
    # d2h 1000 B/s, h2d 20 B/s: the swap-out always hides, 6.5 + max(6.5 + R(300 - x), x/20); the two
    # terms cross in R's second piece (y = 300 - x between 100 and 200): 6.5 + 2 + 0.04 (200 - x) = x/20,
    # x = 16.5 / 0.09 = 183.3, floor 6.5 + 9.1667 = 15.667 (gap 6's crossing, 7 + 11/0.07/20 = 14.86,
    # and gap 7's, 8 + 9/0.07/20 = 14.43, are lower). Swapping alone binds at gap 6: 7 + 300/20 = 22.
    fast_out = make_hw(d2h=1000, h2d=20)
    assert joint_floor(tr, 300, fast_out) == pytest.approx(6.5 + 16.5 / 0.09 / 20)
    assert analytic_floor(tr, 300, fast_out) == pytest.approx(22.0)
    # h2d 40 B/s: the crossing moves into R's first piece (y below 100 B, T3 alone at 0.02 s/B):
    # 6.5 + 0.02 (300 - x) = x/40, x = 12.5 / 0.045 = 277.8, floor 6.5 + 6.944 = 13.444. Gap 6's
    # crossing, also in its first piece (T5 at 0.01): 6 + 0.01 (300 - x) = x/40, 7 + 9/0.035/40 = 13.43.
    assert joint_floor(tr, 300, make_hw(d2h=1000, h2d=40)) == pytest.approx(6.5 + 12.5 / 0.045 / 40)
    # Budget 400, 20 B/s out, 1000 B/s in: gap 5 must free 200 B. The minimum is at the swap-out's
    # knee, x = 6.5 * 20 = 130, inside R's first piece (y = 70 B of T3 at 0.02 s/B), where the
    # after-gap term binds: 6.5 + 6.5 + 0.02 * 70 = 14.4. (Gap 6's knee, x = 140, y = 60 in T5's
    # piece: 7 + 6 + 0.6 = 13.6; gaps 4 and 7, 100 B swapped in time: 13.)
    assert joint_floor(tr, 400, make_hw(d2h=20, h2d=1000)) == pytest.approx(14.4)


def test_joint_floor_where_no_block_is_absent_is_r8s_term():
    # T0 outside any block, blk.0 = T1 (anchor) and T2 (member, absent only in gap 3, where backward
    # rebuilds it); 100 B each, 1 s gaps, step 6. Budget 100, d2h 10 B/s, h2d 1000 B/s. Gap 2 holds
    # 300 B and no block member is absent there: swapping alone, max(2, 200/10) + max(4, 0.2) = 24,
    # the after-gap compute binding on the way back. Gap 3 mixes (x >= 100 swapped):
    # max(3, 10) + max(3 + 2, 0.1) = 15; gap 1: max(1, 10) + max(5, 0.1) = 15. Floor 24.
    tr = make_trace([100] * 3, [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 1.0), ("unpack", 2, 1.0),
                                ("unpack", 1, 1.0), ("unpack", 0, 1.0)], modules=["head", "blk.0.a", "blk.0.b"])
    assert [(sg.anchor, sg.members, sg.at) for sg in tr.segments] == [(1, (2,), 3)]
    assert joint_floor(tr, 100, make_hw(d2h=10, h2d=1000)) == pytest.approx(24.0)


def test_floor_counts_hooks_tail_static_and_workspace(hw):
    # two_tensors' events with 50 B static, 20 B workspace in gap 1, a 0.5 s tail, 0.25 s per hook,
    # budget 150, 25 B/s each way. Gaps with hooks 1.25 1.25 2.25 1.25, step 6.5 with the tail.
    # Demand 150 270 250 150 -> must 0 120 100 0. j=1: before 1.25, after 5.25, 120 B take 4.8 s:
    # max(1.25, 4.8) + max(5.25, 4.8) = 10.05; j=2: max(2.5, 4) + max(4, 4) = 8. Floor 10.05.
    tr = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)],
                    static=50, tail=0.5, other=[0, 20, 0, 0])
    slow = _with(make_hw(d2h=25, h2d=25), hook_cost_s=0.25)
    assert analytic_floor(tr, 150, slow) == pytest.approx(10.05)
    assert joint_floor(tr, 150, slow) == pytest.approx(10.05)  # no blocks: the same bound


def test_floor_hand_computed(two_tensors, hw):
    # Budget 100: demand is 200 in the gaps of e1 and e2, so 100 B must be off the device there.
    # j = 1: max(1, 100/100) + max(4, 100/100) = 5; j = 2: max(2, 1) + max(3, 1) = 5 -> floor 5.
    assert analytic_floor(two_tensors, 100, hw) == 5.0
    slow = make_hw(d2h=25, h2d=25)  # 4 s each way: j=1: max(1,4) + max(4,4) = 8
    assert analytic_floor(two_tensors, 100, slow) == 8.0


def _joint_floor_on_a_grid(tr, budget, hw, points=2001):
    """joint_floor's bound by brute force, written apart from it: per gap, the swapped bytes ``x``
    tried on a grid of ``points`` values in [0, must], the rest freed by the fractional knapsack
    of the blocks absent there (cheapest seconds per byte first). Returns (floor, the most it can
    lie above the true minimum: the function's steepest slope times the grid step)."""
    gaps = [g + hw.hook_cost_s for g in tr.gaps.tolist()]
    total = sum(gaps) + tr.tail_compute_s
    demand = (tr.static_bytes + tr.other_bytes + tr.resident_bytes_no_swap).tolist()
    rel, size = tr.release.tolist(), tr.tensor_bytes.tolist()
    floor, slack, before = total, 0.0, 0.0
    for j, g in enumerate(gaps):
        m = max(demand[j] - budget, 0)
        after = total - before
        if m > 0:
            items = []
            for sg in tr.segments:  # a selective recompute frees the cheap members, a whole one all
                rest = [k for k in sg.members if k not in sg.cheap]
                for ks, cost in ((sg.cheap, sg.cheap_forward_s), (rest, sg.forward_s - sg.cheap_forward_s)):
                    gone = sum(size[k] for k in ks if rel[k] < j <= sg.at)
                    if gone:
                        items.append((cost / gone, gone))
            items.sort()

            def recompute(y, items=items, m=m):
                cost = 0.0
                for rate, have in items:
                    take = min(have, y)
                    cost, y = cost + rate * take, y - take
                return cost if y <= 1e-9 * m else math.inf

            xs = [m * i / (points - 1) for i in range(points)]
            best = min(max(before, x / hw.d2h_bytes_per_s) + max(after + recompute(m - x), x / hw.h2d_bytes_per_s)
                       for x in xs)
            floor = max(floor, best)
            steepest = 1 / hw.d2h_bytes_per_s + 1 / hw.h2d_bytes_per_s + max((r for r, _ in items), default=0.0)
            slack = max(slack, steepest * m / (points - 1))
        before += g
    return floor, slack


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(joint_cases())
def test_the_joint_floor_is_the_minimum_over_every_mix_of_swap_and_recompute(case):
    """R9's floor: at every gap the least step time over every split of the bytes that must be
    away into swapped and recomputed ones (its breakpoints against a dense grid of splits)."""
    tr, _, hw, budget = case
    grid, slack = _joint_floor_on_a_grid(tr, budget, hw)
    got = joint_floor(tr, budget, hw)
    assert grid - slack - 1e-9 <= got <= grid + 1e-9 * max(grid, 1.0)
