"""agents/heuristics.py: each heuristic does what its paper says, on hand-made traces."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from swapsched.agents.heuristics import (
    VDNN,
    Belady,
    Capuchin,
    NoSwap,
    SwapAll,
    min_around_blocks,
    needed_at,
    planned_demand,
    rebuilt_at,
)
from swapsched.env.simulator import simulate
from swapsched.plan import Eviction
from tests.conftest import make_hw, make_trace
from tests.env.test_simulator import joint_cases


def _chain(ops):
    """A forward chain: tensor k packed at event k, unpacked in reverse; 1 s gaps, 100 B each."""
    n = len(ops)
    events = [("pack", k, 1.0) for k in range(n)] + [("unpack", k, 1.0) for k in reversed(range(n))]
    return make_trace([100] * n, events, ops=ops)


def test_no_swap_and_swap_all(two_tensors, hw):
    assert NoSwap().plan(two_tensors, 200, hw).evictions == ()
    plan = SwapAll().plan(two_tensors, 200, hw)
    # save_on_cpu: out when packed, back on demand at the first unpack
    assert plan.evictions == (Eviction(0, 0, 3), Eviction(1, 1, 2))


def test_vdnn_conv_picks_convolution_inputs():
    tr = _chain(["convolution", "relu", "convolution", "native_layer_norm"])
    plan = VDNN(conv_only=True).plan(tr, 10**6, make_hw())
    assert sorted(plan.evicted) == [0, 2]
    assert sorted(VDNN().plan(tr, 10**6, make_hw()).evicted) == [0, 1, 2, 3]


def test_vdnn_prefetches_one_layer_ahead():
    # backward visits layers 3, 2, 1, 0 at events 4, 5, 6, 7; layer k is prefetched when layer k+1 starts
    tr = _chain(["convolution"] * 4)
    plan = VDNN().plan(tr, 10**6, make_hw())
    pf = {e.tensor: e.prefetch_at for e in plan.evictions}
    assert pf == {3: 4, 2: 4, 1: 5, 0: 6}


def test_min_evicts_the_farthest_next_use():
    # Three 100 B tensors alive together under a 250 B budget: one must go. Tensor 0 is used last
    # in backward (farthest next use), so MIN evicts it and only it.
    tr = _chain(["relu"] * 3)
    plan = Belady().plan(tr, 250, make_hw(d2h=1e6, h2d=1e6))
    assert plan.evicted == {0}
    assert not simulate(tr, plan, make_hw(d2h=1e6, h2d=1e6), 250).oom


def test_capuchin_prefetch_lands_before_use_on_a_free_link():
    # Same shape; the link is fast (1 ms per copy) and idle: the prefetch finishes before the reuse.
    tr = _chain(["relu"] * 3)
    hw = make_hw(d2h=1e5, h2d=1e5)
    plan = Capuchin().plan(tr, 250, hw)
    assert len(plan.evictions) == 1
    ev = plan.evictions[0]
    assert ev.prefetch_at < tr.first_unpack[ev.tensor]
    r = simulate(tr, plan, hw, 250)
    assert not r.oom and r.stall_s == 0.0


def test_capuchin_ranks_by_free_time():
    # Tensor 0 has the longest time between its forward use and its reuse: Capuchin evicts it first.
    tr = _chain(["relu"] * 3)
    plan = Capuchin().plan(tr, 250, make_hw(d2h=1e5, h2d=1e5))
    assert plan.evicted == {0}


def test_planned_demand_by_hand(two_tensors, hw):
    assert planned_demand(two_tensors, [], hw).tolist() == [100, 200, 200, 100]
    # T0 out at e0 (t=1), done at t=2 = start of gap 2 -> off from gap 2; prefetched at e3 -> back from gap 3
    assert planned_demand(two_tensors, [Eviction(0, 0, 3)], hw).tolist() == [100, 200, 100, 100]


def test_planned_demand_with_a_recomputed_block_by_hand(one_block, hw):
    """one_block: T1 (the member) is released after e1 and rebuilt at e4 (R9), so it is off the
    device in gaps 2 and 3; selectively, only a cheap member is rebuilt (here none is)."""
    assert list(planned_demand(one_block, [], hw)) == [100, 200, 300, 300, 200, 100]
    assert rebuilt_at(one_block, [0]) == {1: 4} and rebuilt_at(one_block, [], [0]) == {}
    assert list(planned_demand(one_block, [], hw, rebuilt_at(one_block, [0]))) == [100, 200, 200, 200, 200, 100]
    assert list(needed_at(one_block, [0])) == [4, 4, 3] and list(needed_at(one_block)) == [5, 4, 3]


def test_min_around_blocks_swaps_what_the_recompute_leaves(one_block, hw):
    """At 200 B the recompute alone fits (6 s + the block's 2 s forward again); with no block MIN
    evicts T0. At 150 B it cannot: the recompute at e4 needs the anchor T0 and the rebuilt T1
    together, and the anchor is brought back for the recompute (by e4), not its own unpack."""
    plan = min_around_blocks(one_block, 200, hw, recompute=[0])
    assert plan.evictions == () and plan.recompute == ("blk.0",)
    assert simulate(one_block, plan, hw, 200).iteration_s == 8.0
    assert min_around_blocks(one_block, 200, hw).evictions == (Eviction(0, 0, 4),)
    tight = min_around_blocks(one_block, 150, hw, recompute=[0])
    assert [e.tensor for e in tight.evictions] == [0] and tight.evictions[0].prefetch_at <= 4


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(joint_cases())
def test_min_around_any_blocks_is_a_valid_joint_plan(case):
    """Whatever blocks are chosen, the plan never evicts a checkpointed block's member (R9: only
    its anchor may be swapped), keeps the blocks as given, and passes the simulator's checks; with
    no block it is MIN's plan."""
    tr, plan, hw, budget = case
    whole, sel = plan.recomputed(tr), plan.recomputed_selectively(tr)
    out = min_around_blocks(tr, budget, hw, recompute=whole, selective=sel)
    assert out.recomputed(tr) == whole and out.recomputed_selectively(tr) == sel
    members = {k for s in [*whole, *sel] for k in tr.segments[s].members}
    assert not members & out.evicted
    simulate(tr, out, hw, budget)  # validates R7 and R9's exclusions
    assert min_around_blocks(tr, budget, hw) == Belady().plan(tr, budget, hw)
