"""agents/blocks.py: the block features on a hand-made trace, the labels a plan gives, the
selective mask, the guard, and a network that learns a separable rule."""

from __future__ import annotations

import numpy as np
import pytest

from swapsched.agents.blocks import N_FEATURES, STATES, BlockChooser, features, fit, joint_plan, state_labels
from swapsched.agents.heuristics import Belady
from swapsched.env.simulator import simulate
from swapsched.errors import UserError
from swapsched.plan import SwapPlan
from tests.conftest import make_hw, make_trace

# two blocks: blk.0 (anchor T0, member T1: a gelu, cheap) and blk.1 (anchor T2, member T3: an
# addmm, saved by selective checkpointing), then T4 outside; 100 B each, 1 s gaps, unpacked in reverse
TRACE = make_trace([100] * 5, [*(("pack", k, 1.0) for k in range(5)), *(("unpack", k, 1.0) for k in reversed(range(5)))],
                   modules=["blk.0.a", "blk.0.b", "blk.1.a", "blk.1.b", "head"], ops=["addmm", "gelu", "addmm", "addmm", "addmm"])


def chooser_always(state: int) -> BlockChooser:
    """A chooser whose output is ``state`` for every block (its last layer's bias alone)."""
    z = np.zeros
    b3 = np.full(len(STATES), -5.0)
    b3[state] = 5.0
    return BlockChooser((z((N_FEATURES, 4)), z(4), z((4, 4)), z(4), z((4, len(STATES))), b3), z(N_FEATURES), np.ones(N_FEATURES))


def test_features_by_hand():
    """At 300 B (the no-swap peak is 500 B: 200 B over), link 100 B/s, ideal 10 s."""
    hw = make_hw()
    assert [s.name for s in TRACE.segments] == ["blk.0", "blk.1"] and TRACE.segments[0].cheap == (1,)
    x = features(TRACE, 300, hw)
    assert x.shape == (2, N_FEATURES) and np.isfinite(x).all()
    assert x[0, 0] == pytest.approx(np.log2(100 / 200) / 10)  # the block covers half the overshoot
    assert list(x[:, 1]) == [1.0, 0.0]  # cheap share of the block's bytes
    assert x[0, 4] == pytest.approx(np.log10(2.0) / 3)  # its 2 s forward (e0, e1) against 1 s to move its 100 B
    assert list(x[:, 13]) == [1.0, 0.0]  # has cheap members (the selective mask)
    assert x[0, 10] == pytest.approx(1.0 / 4.0)  # both blocks' 200 B cover the overshoot once


def test_labels_and_the_selective_mask():
    plan = SwapPlan.of(TRACE, "p", [], recompute=["blk.1"], selective=["blk.0"])
    assert state_labels(TRACE, plan) == [2, 1]
    assert state_labels(TRACE, SwapPlan.of(TRACE, "p", [])) == [0, 0]
    # selective is never chosen for a block with nothing cheap to rebuild
    assert chooser_always(2).states(TRACE, 300, make_hw()) == [2, 0]
    assert chooser_always(1).states(TRACE, 300, make_hw()) == [1, 1]


def test_the_chosen_blocks_are_recomputed_and_min_swaps_the_rest():
    hw = make_hw()
    plan = chooser_always(1).plan(TRACE, 300, hw, "g")
    assert plan.recompute == ("blk.0", "blk.1") and not ({1, 3} & plan.evicted)
    assert plan == joint_plan(TRACE, 300, hw, [1, 1], "g")
    assert not simulate(TRACE, plan, hw, 300).oom


def test_the_guard_falls_back_to_min_where_the_chosen_blocks_run_out_of_memory():
    """At 150 B recomputing blk.0 at e4 needs its anchor and its rebuilt member at once (200 B);
    MIN alone evicts T0 and fits: the guard returns MIN's plan."""
    hw = make_hw()
    tr = make_trace([100, 100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 1.0), ("unpack", 2, 1.0),
                                      ("unpack", 1, 1.0), ("unpack", 0, 1.0)], modules=["blk.0.a", "blk.0.b", "head"])
    assert simulate(tr, joint_plan(tr, 150, hw, [1], "g"), hw, 150).oom
    out = chooser_always(1).plan(tr, 150, hw, "min")
    assert out == Belady().plan(tr, 150, hw) and not simulate(tr, out, hw, 150).oom


def test_fit_learns_a_separable_rule_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, N_FEATURES))
    x[:, 13] = rng.integers(0, 2, 600)
    # recompute whole where rebuilding costs less than moving; selective where it could and is cheap
    y = np.where(x[:, 4] < 0, np.where((x[:, 13] > 0.5) & (x[:, 1] > 0), 2, 1), 0)
    ch = fit(x, y, steps=600)
    assert (np.argmax(ch.logits(x.copy()), axis=1) == y).mean() > 0.95
    back = BlockChooser.load(ch.save(tmp_path / "c.blocks.npz"))
    assert np.allclose(back.logits(x.copy()), ch.logits(x.copy()))
    bad = tmp_path / "bad.npz"
    np.savez(bad, *ch.weights, mean=ch.mean, std=ch.std, version=np.array(99))
    with pytest.raises(UserError, match="feature version 99"):
        BlockChooser.load(bad)
    with pytest.raises(UserError, match="no block-chooser training data"):
        fit(np.zeros((0, N_FEATURES)), np.zeros(0, dtype=np.int64))
