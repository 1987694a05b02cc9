"""agents/joint.py: which search runs from which candidate, and never worse than the best candidate."""

from __future__ import annotations

import pytest

from swapsched.agents import joint
from swapsched.agents.heuristics import heuristic_plans
from swapsched.agents.learned import LearnedPolicy
from swapsched.agents.local_search import improve
from swapsched.agents.recompute import CheckpointAll
from swapsched.agents.scoring import plan_score
from swapsched.budget import parse_budget
from swapsched.env.corpus import load_corpus
from swapsched.env.floors import analytic_floor, joint_floor
from swapsched.env.simulator import simulate
from swapsched.hardware import load_hardware

# mlp-medium (16 tensors) on h100-pcie5: at 50% recompute lowers R8's floor 3.2x, at 90% 1.02x
TRACE = load_corpus(names=["mlp-medium-b16384-a100-pcie4"])[0]
HW = load_hardware("h100-pcie5")


@pytest.fixture
def searches(monkeypatch):
    """Each improve() call's start plan, whether it searched blocks and whether it drew its moves
    from a prior, in order."""
    calls: list[tuple[str, bool, bool]] = []

    def recording(trace, budget, hardware, start, *, recompute=False, **kw):
        calls.append((start.policy, recompute, kw.get("prior") is not None))
        return improve(trace, budget, hardware, start, recompute=recompute, **{**kw, "seconds": 0.05})

    monkeypatch.setattr(joint, "improve", recording)
    return calls


def test_a_recompute_candidate_far_ahead_goes_straight_to_the_joint_search(searches):
    # 60%: below it checkpoint-all does not fit, its recomputes' transients counted (R3, R9)
    budget = parse_budget("60%", TRACE)
    assert joint_floor(TRACE, budget, HW) < analytic_floor(TRACE, budget, HW) / 2
    ckpt = CheckpointAll().plan(TRACE, budget, HW)
    plan, _ = joint.joint_search(TRACE, budget, HW, seconds=0.5, proposals=lambda m: [ckpt])
    assert [rc for _, rc, _ in searches] == [True]  # no swap search: the swaps are 2.5x behind
    assert simulate(TRACE, plan, HW, budget).iteration_s <= simulate(TRACE, ckpt, HW, budget).iteration_s


def test_where_the_best_candidate_swaps_the_swap_search_runs_first(searches):
    """The floors differ, but the best candidate is a swap plan (no recompute proposal): the swap
    search starts from it, then the joint search goes on."""
    budget = parse_budget("90%", TRACE)
    assert joint_floor(TRACE, budget, HW) < analytic_floor(TRACE, budget, HW)
    prior = LearnedPolicy("default", mode="search")._move_prior()
    plan, _ = joint.joint_search(TRACE, budget, HW, seconds=0.5, prior=prior)
    heur = heuristic_plans(TRACE, budget, HW)
    best = min(heur, key=lambda p: plan_score(simulate(TRACE, p, HW, budget, validate=False), TRACE))
    # the swap search draws from the prior (learned on swap searches), the joint search uniformly
    assert searches[0] == (best.policy, False, True) and searches[-1][1:] == (True, False)
    assert simulate(TRACE, plan, HW, budget).iteration_s <= simulate(TRACE, best, HW, budget).iteration_s


def test_where_the_floors_agree_every_search_draws_from_the_prior(searches):
    """On gh200-c2c recompute cannot lower R8's floor for mlp-medium at 50%: the swaps decide, and
    the searches, swap-only then joint, both draw from the prior learned on swap searches."""
    hw = load_hardware("gh200-c2c")
    budget = parse_budget("50%", TRACE)
    assert joint_floor(TRACE, budget, hw) == pytest.approx(analytic_floor(TRACE, budget, hw))
    joint.joint_search(TRACE, budget, hw, seconds=0.5, prior=LearnedPolicy("default", mode="search")._move_prior())
    assert searches[0][1:] == (False, True) and searches[-1][1:] == (True, True)
