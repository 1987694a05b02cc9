"""agents/recompute.py: checkpointing plans, Capuchin's MSPS order and hybrid step, on a hand trace."""

from __future__ import annotations

from swapsched.agents.heuristics import NoSwap
from swapsched.agents.recompute import (
    CheckpointAll,
    CheckpointOffload,
    CheckpointSelective,
    by_msps,
    hybridize,
    with_all_recomputed,
)
from swapsched.env.simulator import simulate
from swapsched.plan import BlockState, Eviction, SwapPlan
from tests.conftest import make_hw


def test_the_hand_trace_has_the_blocks_the_comment_says(blocks3):
    segs = blocks3.segments
    assert [(s.name, s.anchor, s.members, s.bytes, s.forward_s) for s in segs] == [
        ("blocks.0", 0, (1, 2), 300, 4.0), ("blocks.1", 3, (4, 5), 500, 3.0), ("blocks.2", 6, (7, 8), 550, 10.0)]
    assert [(s.cheap, s.cheap_bytes, s.cheap_forward_s) for s in segs] == [((1,), 100, 1.0), ((4,), 400, 1.0), ((7,), 500, 1.0)]


def test_msps_orders_whole_and_selective_blocks(blocks3):
    assert [s.index for s in by_msps(blocks3.segments)] == [1, 0, 2]  # 167, 75, 55
    assert [s.index for s in by_msps(blocks3.segments, BlockState.SELECTIVE)] == [2, 1, 0]  # 500, 400, 100


def test_checkpointing_plans(blocks3):
    hw = make_hw()
    assert CheckpointAll().plan(blocks3, 10**6, hw).recompute == ("blocks.0", "blocks.1", "blocks.2")
    sel = CheckpointSelective().plan(blocks3, 10**6, hw)
    assert sel.selective == ("blocks.0", "blocks.1", "blocks.2") and sel.recompute == ()
    off = CheckpointOffload().plan(blocks3, 10**6, hw)
    assert off.recompute == ("blocks.0", "blocks.1", "blocks.2")
    assert sorted(e.tensor for e in off.evictions) == [0, 3, 6]  # each block's input, offloaded


def test_recomputing_a_block_drops_its_members_evictions_only(blocks3):
    plan = SwapPlan.of(blocks3, "hand", [Eviction(1, 1, 12), Eviction(3, 3, 13)])
    whole = with_all_recomputed(blocks3, plan, "w")
    assert [e.tensor for e in whole.evictions] == [3]  # the member (1) is rebuilt; the anchor (3) stays swapped
    sel = with_all_recomputed(blocks3, plan, "s", selective=True)
    assert [e.tensor for e in sel.evictions] == [3] and sel.selective == ("blocks.0", "blocks.1", "blocks.2")


def test_hybridize_recomputes_the_block_with_the_most_bytes_per_second(blocks3):
    """No swap holds 1,380 B at backward start. At 1,000 B recomputing block 1 (500 B freed, the
    best MSPS) fits: forward peaks at 880 B, its recompute at 310 + 10 + 500 = 820 B. Anything
    more recomputes for nothing."""
    hw = make_hw()
    assert simulate(blocks3, NoSwap().plan(blocks3, 1000, hw), hw, 1000).oom
    plan = hybridize(blocks3, 1000, hw, NoSwap().plan(blocks3, 1000, hw))
    assert plan.recompute == ("blocks.1",) and plan.selective == ()
    r = simulate(blocks3, plan, hw, 1000)
    assert not r.oom and r.recompute_s == 3.0  # block 1's forward, once more


def test_hybridize_keeps_the_plans_selective_blocks(blocks3):
    """Block 0 checkpointed selectively drops its 100 B relu output: backward starts at 1,280 B,
    within 1,300 (no swap: 1,380, an OOM), and rebuilds it for 1 s. The hybrid step keeps it so and
    adds nothing; dropping it (as it once did) would recompute block 1 whole for 3 s instead."""
    hw = make_hw()
    assert simulate(blocks3, NoSwap().plan(blocks3, 1300, hw), hw, 1300).oom
    start = SwapPlan.of(blocks3, "hand", [], selective=["blocks.0"])
    r = simulate(blocks3, start, hw, 1300)
    assert not r.oom and r.recompute_s == 1.0
    plan = hybridize(blocks3, 1300, hw, start)
    assert plan.selective == ("blocks.0",) and plan.recompute == ()
