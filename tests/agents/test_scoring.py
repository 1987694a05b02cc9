"""agents/scoring.py: how plans are scored and compared, and how training cases are drawn."""

from __future__ import annotations

import numpy as np

from swapsched.agents.scoring import (
    BOUND_TOL,
    IMPROVEMENT_TOL,
    best_plan,
    draw_case,
    improves,
    plan_score,
    reaches,
    training_cases,
)
from swapsched.env.simulator import simulate
from swapsched.plan import Eviction, SwapPlan
from tests.conftest import make_hw


def test_an_oom_is_worse_than_any_step_and_a_later_one_less_bad(two_tensors, hw):
    ok = plan_score(simulate(two_tensors, [], hw, 200), two_tensors)
    assert ok == 5.0
    early = plan_score(simulate(two_tensors, [], hw, 50), two_tensors)  # OOM at e0
    late = plan_score(simulate(two_tensors, [], hw, 150), two_tensors)  # OOM at e1
    assert ok < late < early


def test_best_plan_takes_the_lowest_score_first_on_ties(two_tensors, hw):
    keep = SwapPlan.of(two_tensors, "keep", [])
    same = SwapPlan.of(two_tensors, "same", [])
    swap = SwapPlan.of(two_tensors, "swap", [Eviction(0, 0, 3)])  # on demand: 1 s stall
    assert best_plan(two_tensors, 200, hw, [swap, keep, same]) == (keep, 5.0)


def test_tolerances_are_shares_of_the_score():
    assert improves(1.0 - 2 * IMPROVEMENT_TOL, 1.0) and not improves(1.0 - IMPROVEMENT_TOL / 2, 1.0)
    assert improves(99.0, 100.0) and not improves(100.0 - 50 * IMPROVEMENT_TOL, 100.0)
    assert reaches(1.0 + BOUND_TOL / 2, 1.0) and not reaches(1.0 + 2 * BOUND_TOL, 1.0)


def test_cases_are_drawn_inside_the_range_and_never_below_feasible(two_tensors):
    rng = np.random.default_rng(0)
    hws = [make_hw(), make_hw(d2h=10.0)]
    seen = set()
    for _ in range(50):
        hw, budget = draw_case(two_tensors, hws, rng, (0.2, 0.6))
        seen.add(hw.d2h_bytes_per_s)
        # peak 200, static 0: 20-60% is 40-120 B, raised to the smallest feasible (100 B)
        assert max(40, two_tensors.min_feasible_bytes) <= budget <= 120
    assert seen == {100.0, 10.0}


def test_training_cases_visit_each_trace_in_turn(two_tensors):
    rng = np.random.default_rng(0)
    cases = list(training_cases([two_tensors], [make_hw()], rng, cases_per_trace=3, budget_range=(0.3, 0.9)))
    assert len(cases) == 3 and all(tr is two_tensors for tr, _, _ in cases)
    again = [draw_case(two_tensors, [make_hw()], r, (0.3, 0.9))[1] for r in [np.random.default_rng(0)] for _ in range(3)]
    assert [b for _, _, b in cases] == again
