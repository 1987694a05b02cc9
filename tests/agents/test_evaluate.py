"""agents/evaluate.py: one record per policy and case, and the summary's counts, on a hand-made trace."""

from __future__ import annotations

import math

import pytest

from swapsched.agents.evaluate import CaseResult, compare, feasible_cases, step_ratio, summarize
from tests.conftest import make_hw, make_trace

POLICIES = ["no-swap", "swap-all", "min"]


@pytest.fixture
def results() -> list[CaseResult]:
    # T0, T1 of 100 B, gaps 1,1,2,1 s (ideal 5 s), a 100 B/s link: each copy takes 1 s.
    tr = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)])
    return compare([tr], ["100%", "50%", "1%"], [make_hw()], POLICIES, progress=False)


def test_one_record_per_case_and_policy_in_order(results):
    assert [(r.budget, r.policy) for r in results] == [(b, p) for b in ["100%", "50%", "1%"] for p in POLICIES]


def test_solved_oom_and_skipped_records(results):
    by = {(r.budget, r.policy): r for r in results}
    # swap-all at 100%: both tensors come back on demand, 1 s each: 7 s over an ideal 5 s
    assert by[("100%", "swap-all")].overhead == pytest.approx(0.4)
    assert by[("100%", "no-swap")].overhead == 0.0 and by[("100%", "no-swap")].solved
    # 50% = 100 B: keeping both is an OOM, which has no overhead and is not "solved"
    oom = by[("50%", "no-swap")]
    assert oom.oom and oom.overhead is None and not oom.solved
    # 1% = 2 B is below the smallest feasible budget (100 B): every policy is skipped, with the reason
    skipped = by[("1%", "min")]
    assert skipped.result is None and "smallest feasible budget is 100 B" in skipped.skipped
    assert skipped.to_dict() == {"trace": "hand", "budget": "1%", "hardware": "hand", "policy": "min",
                                 "skipped": skipped.skipped, "oom": None, "overhead": None}
    row = by[("50%", "min")].to_dict()
    assert row["floor_s"] == 5.0 and row["floor_overhead"] == pytest.approx(5.0 / 5.0 - 1.0) and row["plan_s"] >= 0


def test_summary_counts(results):
    s = {x.policy: x for x in summarize(results, POLICIES)}
    assert (s["no-swap"].won, s["no-swap"].oom, s["no-swap"].skipped, s["no-swap"].cases) == (1, 1, 1, 3)
    assert s["no-swap"].mean_overhead == 0.0  # the OOM is not averaged in
    assert s["swap-all"].won == 0 and s["swap-all"].mean_overhead == pytest.approx((0.4 + 0.6) / 2)
    assert s["min"].won == 2  # ties no-swap at 100%, alone at 50%
    empty = summarize([r for r in results if r.budget == "1%"], ["min"])[0]
    assert math.isnan(empty.mean_overhead) and empty.won == 0


def test_step_ratio_over_one_reference_and_over_the_best_of_several(results):
    # swap-all 7 s against no-swap's 5 s at 100%; at 50% no-swap runs out of memory, so that case
    # is not compared; at 1% every policy was skipped
    r = step_ratio(results, "swap-all", ["no-swap"])
    assert (r.geomean, r.worst, r.worst_case, r.cases, r.oom) == (pytest.approx(1.4), pytest.approx(1.4),
                                                                 ("hand", "100%", "hand"), 1, 0)
    # the other way round the 50% case is an OOM where the reference fits
    back = step_ratio(results, "no-swap", ["swap-all"])
    assert back.geomean == pytest.approx(5 / 7) and back.cases == 1 and back.oom == 1
    # over the best of no-swap and min on each case: 5 s at 100% (both), min's alone at 50%
    min_50 = next(x.result.iteration_s for x in results if x.policy == "min" and x.budget == "50%")
    best = step_ratio(results, "swap-all", ["no-swap", "min"])
    assert best.reference == "best of no-swap, min" and best.cases == 2
    assert best.geomean == pytest.approx(math.sqrt(1.4 * 8.0 / min_50))
    assert best.worst == pytest.approx(max(1.4, 8.0 / min_50))
    assert best.to_dict()["worst_case"] == list(best.worst_case)
    # the best, not any: at 100% min's 5 s, not swap-all's 7 s
    assert step_ratio(results, "no-swap", ["swap-all", "min"]).geomean == pytest.approx(1.0)
    with pytest.raises(ValueError):
        step_ratio(results, "min", [])


def test_feasible_cases_leave_out_the_budgets_no_plan_meets_in_trace_budget_hardware_order():
    tr = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)])
    a, b = make_hw(), make_hw(d2h=50.0)
    got = [(t.name, spec, budget, hw.d2h_bytes_per_s) for t, spec, budget, hw in feasible_cases([tr], ["100%", "1%", "50%"], [a, b])]
    # 1% is 2 B, below the 100 B any plan needs; 100% is the 200 B peak, 50% 100 B
    assert got == [("hand", "100%", 200, 100.0), ("hand", "100%", 200, 50.0), ("hand", "50%", 100, 100.0), ("hand", "50%", 100, 50.0)]
