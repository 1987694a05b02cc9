"""agents/heuristics.py: each heuristic does what its paper says, on hand-made traces."""

from __future__ import annotations

from swapsched.agents.heuristics import VDNN, Belady, Capuchin, NoSwap, SwapAll, planned_demand
from swapsched.env.simulator import simulate
from swapsched.plan import Eviction
from tests.conftest import make_hw, make_trace


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
