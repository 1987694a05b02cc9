"""agents/blocks.py: the choices and features on a hand-made trace, every choice's simulated cost
by hand, the guard, a network that learns a separable rule, and the shipped chooser at work."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from swapsched._paths import checkpoint_dir
from swapsched.agents.blocks import (
    CHOICES,
    N_CASE_FEATURES,
    N_FEATURES,
    OOM_COST,
    BlockChooser,
    choice_costs,
    choice_features,
    features,
    fit,
    joint_plan,
    last_block,
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


class FixedRanking(BlockChooser):
    """A chooser that ranks ``order`` first, in this order, on every case (the rest after)."""

    def __init__(self, order: list[int]) -> None:
        z = np.zeros
        super().__init__((z((N_FEATURES, 1)), z(1), z((1, 1)), z(1), z((1, 1)), z(1)), z(N_FEATURES), np.ones(N_FEATURES))
        object.__setattr__(self, "order", order)

    def ranked(self, trace, budget, hardware):
        return [*self.order, *(c for c in range(len(CHOICES)) if c not in self.order)]


def chooser_always(choice: int) -> BlockChooser:
    return FixedRanking([choice])


C = {ch[:2]: i for i, ch in enumerate(CHOICES) if ch[2]}  # (way, eighths) -> the choice that may hold the last block
C_BUT_LAST = {ch[:2]: i for i, ch in enumerate(CHOICES) if not ch[2]}


def test_choices_recompute_a_prefix_of_the_ranking_in_one_way():
    """Both blocks free 100 B for 2 s whole (a tie: forward order); selectively only blk.0 frees
    anything. Eighths of 2 blocks round up, so the first eighth recomputes one block. The second
    set of choices leaves blk.1, the block forward runs last, out."""
    assert CHOICES[0] == ("none", 0, True) and len(CHOICES) == 49 and len(set(CHOICES)) == 49
    assert states_of(TRACE, 0) == [0, 0] and last_block(TRACE) == 1
    assert states_of(TRACE, C["whole", 1]) == [1, 0] and states_of(TRACE, C["whole", 5]) == [1, 1]
    assert states_of(TRACE, C["selective", 8]) == [2, 0]  # blk.1 has nothing cheap: kept
    assert states_of(TRACE, C["mixed", 8]) == [2, 1]  # ... or recomputed whole
    assert states_of(TRACE, C["mixed", 4]) == [2, 0]
    assert states_of(TRACE, C_BUT_LAST["whole", 8]) == [1, 0] and states_of(TRACE, C_BUT_LAST["mixed", 8]) == [2, 0]
    assert states_of(TRACE, C_BUT_LAST["whole", 1]) == [1, 0]  # blk.1 was not among them anyway


def test_features_by_hand():
    """At 300 B: the no-swap peak is 500 B, so 200 B over; link 100 B/s; backward 5 s."""
    x = features(TRACE, 300, make_hw())
    assert x.shape == (N_CASE_FEATURES,) and np.isfinite(x).all()
    assert x[0] == pytest.approx((300 - 100) / (500 - 100))  # the budget's position
    assert x[1] == pytest.approx(np.log10(2.0 / 10.0) / 3)  # 2 s to move the overshoot, against a 10 s step
    assert x[2] == pytest.approx(100 * 5 / 200 / 4)  # the link moves 500 B during backward
    assert x[3] == pytest.approx(200 / 200 / 4) and x[4] == pytest.approx(100 / 200 / 4)
    assert x[11] == pytest.approx(1.0)  # both ranked blocks, whole, to cover 200 B
    assert x[12] == pytest.approx(1.25)  # selectively it cannot be covered


def test_choice_features_by_hand():
    """At 300 B, 200 B over at the peak (e4, 500 B). Rebuilt members are absent from their release
    to their block's recompute: T1 (blk.0) through gaps e2-e7, T3 (blk.1) through e4-e5. Every
    tensor's round trip (2 s at 100 B/s) fits its window but T4's (released at the peak)."""
    x = choice_features(TRACE, 300, make_hw())
    assert x.shape == (len(CHOICES), N_FEATURES) and np.isfinite(x).all()
    assert np.allclose(x[:, :N_CASE_FEATURES], features(TRACE, 300, make_hw()))  # the case's row on every choice
    own = x[:, N_CASE_FEATURES:]
    # nothing rebuilt: all 200 B left, carried by T0 and T1 (largest first, ties in order): 2 s of
    # copy back against 5 s of backward
    assert own[0].tolist() == pytest.approx([0, 0, 0, 0, 0, 0, 0, 0, 1.0, np.log10(2 / 5) / 3, 0, 0, 1])
    # blk.0 whole: T1 frees 100 B (a quarter of the 4x cap), 2 s of a 10 s step; the new peak is
    # 400 B (e4, e5), so 100 B left, which T0 carries in 1 s
    assert own[C["whole", 1]].tolist() == pytest.approx([1, 0, 0, 1 / 8, 0, 0, 100 / 200 / 4, 0.2, 0.5, np.log10(1 / 5) / 3, 0, 0, 1])
    # both blocks: the peak drops to 300 B, nothing is left to swap (the copy time floors at -1)
    assert own[C["whole", 8]].tolist() == pytest.approx([1, 0, 0, 1, 0, 1, 200 / 200 / 4, 0.4, 0, -1, 0, 0, 0])
    # without the last block: blk.0 alone again, flagged
    assert own[C_BUT_LAST["whole", 8]].tolist() == pytest.approx([1, 0, 0, 1, 1, 0, *own[C["whole", 1]][6:]])
    # a 1 s copy latency: the round trip (4 s) no longer fits T3's window (3 s) and T0 and T1
    # carry the overshoot with two copies: 2 x 2 x 1 s over the 10 s step; 4 s of copy back
    slow = choice_features(TRACE, 300, make_hw(latency=1.0))[0, N_CASE_FEATURES:]
    assert slow[9] == pytest.approx(np.log10(4 / 5) / 3) and slow[10] == pytest.approx(0.4 / 4) and slow[11] == 0
    # a budget no window carries: a 3 s latency leaves only T0 (window 9 s >= 8 s): 100 B short
    short = choice_features(TRACE, 300, make_hw(latency=3.0))[0, N_CASE_FEATURES:]
    assert short[11] == pytest.approx(100 / 200)


def test_choice_costs_by_hand():
    """Within budget (500 B) nothing needs recomputing: 'none' is best; each choice costs its
    recompute time, log((10 + s) / 10): 2 s per whole block, 1 s for blk.0 selectively."""
    costs = choice_costs(TRACE, 500, make_hw())
    c = C
    assert costs[c["whole", 1]] == pytest.approx(np.log(1.2)) and costs[c["whole", 8]] == pytest.approx(np.log(1.4))
    assert costs[c["selective", 8]] == pytest.approx(np.log(1.1)) and costs[c["mixed", 8]] == pytest.approx(np.log(1.3))


def test_the_chosen_blocks_are_recomputed_and_min_swaps_the_rest():
    hw = make_hw()
    whole_all = C["whole", 8]
    # its first four choices tie (every eighth from 5/8 recomputes both blocks): the most likely
    plan = FixedRanking([whole_all, C["whole", 5], C["whole", 6], C["whole", 7]]).plan(TRACE, 300, hw, "g")
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
    out = chooser_always(C["whole", 8]).plan(tr, 150, hw, "min")
    assert out == Belady().plan(tr, 150, hw) and not simulate(tr, out, hw, 150).oom


def test_the_chooser_takes_the_fastest_of_its_first_choices_that_fit():
    """mlp-large in bf16 (20 tensors) at 36% on h100-pcie5: recomputing 3/8 of the blocks or more
    runs out of memory (the recomputes' transients, R3; at 38% and above every choice fits under
    R9's count of what a recompute holds), 1/8 fits and beats MIN. A chooser ranking
    (whole, 8), (whole, 1), none takes the second; one ranking
    (selective, 1), which fits and saves nothing over MIN, before (whole, 1) takes the faster,
    second; one ranking four choices that all run out takes MIN alone."""
    from swapsched.budget import parse_budget
    from swapsched.env.corpus import load_corpus
    from swapsched.hardware import load_hardware

    tr, hw = load_corpus(names=["mlp-large-b8192-h100-pcie5-bf16"])[0], load_hardware("h100-pcie5")
    budget = parse_budget("36%", tr)
    c = C
    costs = choice_costs(tr, budget, hw)
    assert costs[c["whole", 8]] == costs[c["whole", 7]] == costs[c["whole", 6]] == OOM_COST and costs[c["whole", 1]] < costs[0]
    out = FixedRanking([c["whole", 8], c["whole", 1], 0]).plan(tr, budget, hw, "g")
    assert out == joint_plan(tr, budget, hw, states_of(tr, c["whole", 1]), "g") and out.recompute
    assert costs[c["selective", 1]] == costs[0] > costs[c["whole", 1]]
    out = FixedRanking([c["selective", 1], c["whole", 1]]).plan(tr, budget, hw, "g")
    assert out == joint_plan(tr, budget, hw, states_of(tr, c["whole", 1]), "g")
    out = FixedRanking([c["whole", 8], c["whole", 7], c["whole", 6], c["whole", 5], c["whole", 1]]).plan(tr, budget, hw, "min")
    assert out == Belady().plan(tr, budget, hw)  # GUARD_TRIES is 4: the fifth choice is not tried


def test_fit_learns_a_rule_over_the_choices_rows_and_round_trips(tmp_path):
    """The best choice of a case is the one whose row has the smallest 'recompute time' minus
    'copy time' (two columns); every other choice costs more, in proportion. One scorer for all
    rows learns it, whichever index the best choice has."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, len(CHOICES), N_FEATURES))
    trade = x[:, :, 7] - x[:, :, 9]
    costs = trade - trade.min(axis=1, keepdims=True)
    ch = fit(x, costs, steps=600, members=2)
    assert ch.weights[0].shape == (2, N_FEATURES, 64)  # two members, stacked
    pick = np.array([np.argmax(ch.scores(case)) for case in x])
    assert (pick == trade.argmin(axis=1)).mean() > 0.9
    assert len(set(pick.tolist())) > 20  # not one class learned by heart
    # the ensemble's score is its members' mean log-probability
    one = [BlockChooser(tuple(w[k : k + 1] for w in ch.weights), ch.mean, ch.std).scores(x[0]) for k in range(2)]
    assert np.allclose(ch.scores(x[0]), (one[0] + one[1]) / 2) and np.allclose(np.exp(one[0]).sum(), 1.0)
    back = BlockChooser.load(ch.save(tmp_path / "c.blocks.npz"))
    assert np.allclose(back.scores(x[0]), ch.scores(x[0]))
    bad = tmp_path / "bad.npz"
    np.savez(bad, *ch.weights, mean=ch.mean, std=ch.std, version=np.array(99))
    with pytest.raises(UserError, match="feature version 99"):
        BlockChooser.load(bad)
    with pytest.raises(UserError, match="no block-chooser training data"):
        fit(np.zeros((0, len(CHOICES), N_FEATURES)), np.zeros((0, len(CHOICES))))


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
