"""agents/local_search.py: the hill-climber's moves, its proposal and its stopping rules, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from swapsched.agents.heuristics import Belady, heuristic_plans
from swapsched.agents.joint import LocalSearch
from swapsched.agents.local_search import (
    MOVE_CLASSES,
    UNIFORM,
    UNIFORM_SHARES,
    Move,
    _SearchState,
    improve,
    improve_best_heuristic,
)
from swapsched.agents.scoring import best_plan, plan_score
from swapsched.env.simulator import simulate
from swapsched.plan import BlockState, Eviction, SwapPlan
from tests.conftest import make_hw, make_trace


@pytest.fixture
def four():
    """Four 100 B tensors, 1 s gaps, unpacked in reverse: every budget below 400 B needs swaps."""
    events = [("pack", k, 1.0) for k in range(4)] + [("unpack", k, 1.0) for k in reversed(range(4))]
    return make_trace([100] * 4, events)


def test_the_uniform_proposal_gives_each_kind_its_share():
    total = sum(UNIFORM_SHARES.values())
    for kind, share in UNIFORM_SHARES.items():
        got = sum(w for w, (k, _, _) in zip(UNIFORM, MOVE_CLASSES, strict=True) if k == kind)
        assert got == pytest.approx(share / total)
    assert UNIFORM.sum() == pytest.approx(1.0)


def test_moves_change_exactly_what_they_say(four, blocks3):
    hw = make_hw()
    state = _SearchState(four, 300, hw, {0: (0, 6), 1: (1, 5)})
    cand, rc, sel = state.apply(Move("drop", 0, None))
    assert cand == {1: (1, 5)} and rc == sel == frozenset()
    cand, _, _ = state.apply(Move("add", 2, (2, 4)))
    assert cand == {0: (0, 6), 1: (1, 5), 2: (2, 4)}
    cand, _, _ = state.apply(Move("replace", 3, (3, 3), removed=1))
    assert cand == {0: (0, 6), 3: (3, 3)}
    # a block put in a state: its members' evictions go (rebuilt or held), the anchor's stay
    state = _SearchState(blocks3, 10**6, hw, {0: (0, 17), 1: (1, 16)}, joint=True)
    cand, rc, sel = state.apply(Move("recompute", 0, None, state=BlockState.WHOLE))
    assert cand == {0: (0, 17)} and rc == {0} and sel == frozenset()
    cand, rc, sel = state.apply(Move("recompute", 0, None, state=BlockState.SELECTIVE))
    assert cand == {0: (0, 17)} and rc == frozenset() and sel == {0}
    cand, rc, sel = state.apply(Move("recompute", 0, None, state=BlockState.KEPT))
    assert cand == {0: (0, 17), 1: (1, 16)} and rc == sel == frozenset()


def test_improve_never_returns_a_worse_plan_and_its_score_is_its_simulation(four):
    hw = make_hw(d2h=50.0, h2d=50.0)  # a transfer takes 2 s, two gaps
    for budget in (200, 250, 300):
        start = Belady().plan(four, budget, hw)
        s0 = plan_score(simulate(four, start, hw, budget), four)
        plan, score, evals = improve(four, budget, hw, start, seconds=10.0, max_evals=200, seed=1)
        assert score <= s0 and evals == 200 and plan.policy == start.policy
        assert score == plan_score(simulate(four, plan, hw, budget), four)


def test_improve_stops_where_the_plan_reaches_its_target(four):
    hw = make_hw()
    start = Belady().plan(four, 300, hw)
    s0 = plan_score(simulate(four, start, hw, 300), four)
    _, _, evals = improve(four, 300, hw, start, seconds=10.0, target=s0)
    assert evals == 1  # the start is already at the bound: nothing is simulated


def test_improve_is_deterministic_for_a_seed_and_a_number_of_evaluations(four):
    hw = make_hw(d2h=50.0, h2d=50.0)
    start = SwapPlan.of(four, "hand", [Eviction(k, k, 7 - k) for k in range(3)])
    a = improve(four, 250, hw, start, seconds=10.0, max_evals=100, seed=3)
    b = improve(four, 250, hw, start, seconds=10.0, max_evals=100, seed=3)
    assert a[0].evictions == b[0].evictions and a[1] == b[1]


def test_improve_best_heuristic_starts_from_the_best_heuristic(four):
    hw = make_hw()
    start, better = improve_best_heuristic(four, 250, hw, seconds=10.0, seed=0, max_evals=50)
    assert start == best_plan(four, 250, hw, heuristic_plans(four, 250, hw))[0]
    assert plan_score(simulate(four, better, hw, 250), four) <= plan_score(simulate(four, start, hw, 250), four)


def test_local_search_is_the_swap_only_pipeline(four):
    hw = make_hw(d2h=50.0, h2d=50.0)
    plan = LocalSearch(search_seconds=0.3).plan(four, 250, hw)
    assert plan.policy == "local-search" and plan.recompute == plan.selective == ()
    assert plan.meta["start"] in {p.policy for p in heuristic_plans(four, 250, hw)}
    best_heuristic = min(plan_score(simulate(four, p, hw, 250), four) for p in heuristic_plans(four, 250, hw))
    assert plan_score(simulate(four, plan, hw, 250), four) <= best_heuristic
    assert np.isfinite(simulate(four, plan, hw, 250).iteration_s)
