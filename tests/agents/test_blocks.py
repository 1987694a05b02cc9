"""agents/blocks.py: the choices and features on a hand-made trace, every choice's simulated cost
by hand, the guard, a network that learns a separable rule, and the shipped chooser at work."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from swapsched._paths import checkpoint_dir
from swapsched.agents.blocks import (
    CHOICES,
    N_FEATURES,
    OOM_COST,
    BlockChooser,
    choice_costs,
    features,
    fit,
    joint_plan,
    states_of,
)
from swapsched.agents.heuristics import Belady
from swapsched.env.simulator import simulate
from swapsched.errors import UserError
from tests.conftest import make_hw, make_trace

# two blocks: blk.0 (anchor T0, member T1: a gelu, cheap) and blk.1 (anchor T2, member T3: an
# addmm, which selective checkpointing saves), then T4 outside; 100 B each, 1 s gaps, unpacked in
# reverse (ideal 10 s). Each block's forward is 2 s, blk.0's cheap forward 1 s.
TRACE = make_trace([100] * 5, [*(("pack", k, 1.0) for k in range(5)), *(("unpack", k, 1.0) for k in reversed(range(5)))],
                   modules=["blk.0.a", "blk.0.b", "blk.1.a", "blk.1.b", "head"], ops=["addmm", "gelu", "addmm", "addmm", "addmm"])


def chooser_always(choice: int) -> BlockChooser:
    """A chooser whose answer is ``choice`` on every case (its last layer's bias alone)."""
    z = np.zeros
    b3 = np.full(len(CHOICES), -5.0)
    b3[choice] = 5.0
    return BlockChooser((z((N_FEATURES, 4)), z(4), z((4, 4)), z(4), z((4, len(CHOICES))), b3), z(N_FEATURES), np.ones(N_FEATURES))


def test_choices_recompute_a_prefix_of_the_ranking_in_one_way():
    """Both blocks free 100 B for 2 s whole (a tie: forward order); selectively only blk.0 frees
    anything. Eighths of 2 blocks round up, so the first eighth recomputes one block."""
    c = {ch: i for i, ch in enumerate(CHOICES)}
    assert CHOICES[0] == ("none", 0) and len(CHOICES) == 25
    assert states_of(TRACE, 0) == [0, 0]
    assert states_of(TRACE, c["whole", 1]) == [1, 0] and states_of(TRACE, c["whole", 5]) == [1, 1]
    assert states_of(TRACE, c["selective", 8]) == [2, 0]  # blk.1 has nothing cheap: kept
    assert states_of(TRACE, c["mixed", 8]) == [2, 1]  # ... or recomputed whole
    assert states_of(TRACE, c["mixed", 4]) == [2, 0]


def test_features_by_hand():
    """At 300 B: the no-swap peak is 500 B, so 200 B over; link 100 B/s; backward 5 s."""
    x = features(TRACE, 300, make_hw())
    assert x.shape == (N_FEATURES,) and np.isfinite(x).all()
    assert x[0] == pytest.approx((300 - 100) / (500 - 100))  # the budget's position
    assert x[1] == pytest.approx(np.log10(2.0 / 10.0) / 3)  # 2 s to move the overshoot, against a 10 s step
    assert x[2] == pytest.approx(100 * 5 / 200 / 4)  # the link moves 500 B during backward
    assert x[3] == pytest.approx(200 / 200 / 4) and x[4] == pytest.approx(100 / 200 / 4)
    assert x[11] == pytest.approx(1.0)  # both ranked blocks, whole, to cover 200 B
    assert x[12] == pytest.approx(1.25)  # selectively it cannot be covered


def test_choice_costs_by_hand():
    """Within budget (500 B) nothing needs recomputing: 'none' is best; each choice costs its
    recompute time, log((10 + s) / 10): 2 s per whole block, 1 s for blk.0 selectively."""
    costs = choice_costs(TRACE, 500, make_hw())
    c = {ch: i for i, ch in enumerate(CHOICES)}
    assert costs[0] == 0.0
    assert costs[c["whole", 1]] == pytest.approx(np.log(1.2)) and costs[c["whole", 8]] == pytest.approx(np.log(1.4))
    assert costs[c["selective", 8]] == pytest.approx(np.log(1.1)) and costs[c["mixed", 8]] == pytest.approx(np.log(1.3))


def test_the_chosen_blocks_are_recomputed_and_min_swaps_the_rest():
    hw = make_hw()
    whole_all = CHOICES.index(("whole", 8))
    plan = chooser_always(whole_all).plan(TRACE, 300, hw, "g")
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
    out = chooser_always(CHOICES.index(("whole", 8))).plan(tr, 150, hw, "min")
    assert out == Belady().plan(tr, 150, hw) and not simulate(tr, out, hw, 150).oom


def chooser_ranking(choices: list[int]) -> BlockChooser:
    """A chooser that ranks ``choices`` first, in this order, on every case."""
    z = np.zeros
    b3 = np.full(len(CHOICES), -10.0)
    b3[choices] = np.arange(len(choices), 0, -1, dtype=float)
    return BlockChooser((z((N_FEATURES, 4)), z(4), z((4, 4)), z(4), z((4, len(CHOICES))), b3), z(N_FEATURES), np.ones(N_FEATURES))


def test_the_guard_walks_the_ranking_to_the_first_choice_that_fits():
    """mlp-medium (16 tensors) at 30% on h100-pcie5: recomputing 3/8 of the blocks or more runs
    out of memory, 1/8 fits and beats MIN. A chooser ranking (whole, 8), (whole, 1), none takes
    the second; one ranking three choices that all run out takes MIN alone."""
    from swapsched.budget import parse_budget
    from swapsched.env.corpus import load_corpus
    from swapsched.hardware import load_hardware

    tr, hw = load_corpus(names=["mlp-medium-b16384-a100-pcie4"])[0], load_hardware("h100-pcie5")
    budget = parse_budget("30%", tr)
    c = {ch: i for i, ch in enumerate(CHOICES)}
    costs = choice_costs(tr, budget, hw)
    assert costs[c["whole", 8]] == costs[c["whole", 7]] == costs[c["whole", 6]] == OOM_COST and costs[c["whole", 1]] < costs[0]
    out = chooser_ranking([c["whole", 8], c["whole", 1], 0]).plan(tr, budget, hw, "g")
    assert out == joint_plan(tr, budget, hw, states_of(tr, c["whole", 1]), "g") and out.recompute
    out = chooser_ranking([c["whole", 8], c["whole", 7], c["whole", 6], c["whole", 1]]).plan(tr, budget, hw, "min")
    assert out == Belady().plan(tr, budget, hw)  # GUARD_TRIES is 3: the fourth choice is not tried


def test_fit_learns_a_separable_rule_and_round_trips(tmp_path):
    """Costs that make 'none' best where the link moves the overshoot in time (feature 2 high)
    and 'whole, all' best elsewhere; every other choice costs more."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, N_FEATURES))
    costs = np.full((600, len(CHOICES)), 0.5)
    hidden = x[:, 2] > 0
    costs[:, 0] = np.where(hidden, 0.0, 1.0)
    costs[:, 8] = np.where(hidden, 0.3, 0.0)
    ch = fit(x, costs, steps=600)
    pick = np.argmax(ch.logits(x), axis=1)
    assert (pick == np.where(hidden, 0, 8)).mean() > 0.95
    back = BlockChooser.load(ch.save(tmp_path / "c.blocks.npz"))
    assert np.allclose(back.logits(x), ch.logits(x))
    bad = tmp_path / "bad.npz"
    np.savez(bad, *ch.weights, mean=ch.mean, std=ch.std, version=np.array(99))
    with pytest.raises(UserError, match="feature version 99"):
        BlockChooser.load(bad)
    with pytest.raises(UserError, match="no block-chooser training data"):
        fit(np.zeros((0, N_FEATURES)), np.zeros((0, len(CHOICES))))


def test_default_greedy_recomputes_where_swapping_is_link_bound(tmp_path):
    """bert-base at 50% on h100-pcie5 (held out): MIN's swap plan pays about 6x the ideal step, the
    link's floor; the shipped chooser recomputes blocks and default-greedy is far faster. A
    checkpoint with no chooser beside it plans swap only, as before."""
    from swapsched.agents import get_policy
    from swapsched.agents.learned import LearnedPolicy
    from swapsched.budget import parse_budget
    from swapsched.env.corpus import load_corpus
    from swapsched.hardware import load_hardware

    tr = load_corpus(names=["bert-base-b16-h100-pcie5"])[0]
    hw = load_hardware("h100-pcie5")
    budget = parse_budget("50%", tr)
    greedy = get_policy("default-greedy").plan(tr, budget, hw)
    assert greedy.recompute or greedy.selective
    step = simulate(tr, greedy, hw, budget)
    assert not step.oom and step.iteration_s < 0.5 * simulate(tr, Belady().plan(tr, budget, hw), hw, budget).iteration_s
    for suffix in (".zip", ".json", ".editor.npz", ".moves.npz"):
        shutil.copy(checkpoint_dir() / f"default{suffix}", tmp_path / f"old{suffix}")
    old = LearnedPolicy(tmp_path / "old.zip", mode="greedy").plan(tr, budget, hw)
    assert not old.recompute and not old.selective
