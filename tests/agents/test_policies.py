"""Properties over every policy: R7, feasibility against the exact optimum, optimality, determinism."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swapsched.agents import get_policy
from swapsched.agents.optimal import Optimal
from swapsched.agents.search import SwapAdvisor
from swapsched.env.corpus import load_corpus
from swapsched.env.simulator import simulate
from swapsched.hardware import load_hardware
from tests.conftest import make_hw, make_trace
from tests.env.test_simulator import joint_cases

BUDGET_AWARE = ["swap-all", "min", "capuchin", "swapadvisor", "local-search"]
ALL_HEURISTICS = ["no-swap", "swap-all", "vdnn-all", "vdnn-conv", "min", "capuchin", "swapadvisor"]


@st.composite
def small_cases(draw):
    n = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(10, 300), min_size=n, max_size=n))
    gap = st.floats(0.1, 2.0)
    fwd = [("pack", k, draw(gap)) for k in range(n)]
    bwd = [("unpack", k, draw(gap)) for k in draw(st.permutations(list(range(n))))]
    ops = [draw(st.sampled_from(["convolution", "relu", "addmm"])) for _ in range(n)]
    tr = make_trace(sizes, fwd + bwd, tail=draw(gap), ops=ops)
    hw = make_hw(d2h=draw(st.floats(50, 500)), h2d=draw(st.floats(50, 500)), latency=draw(st.floats(0, 0.2)))
    budget = draw(st.integers(tr.min_feasible_bytes, tr.peak_bytes_no_swap))
    return tr, hw, budget


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_cases())
def test_optimal_is_never_worse_and_budget_aware_policies_are_feasible(case):
    tr, hw, budget = case
    best = Optimal().plan(tr, budget, hw)
    opt = simulate(tr, best, hw, budget)
    assert best.meta["feasible"] and not opt.oom  # a budget >= the smallest feasible is feasible
    for name in ALL_HEURISTICS:
        plan = get_policy(name, search_seconds=5.0).plan(tr, budget, hw)
        plan.validate(tr)  # R7
        r = simulate(tr, plan, hw, budget)
        if name in BUDGET_AWARE:
            assert not r.oom, name
        if not r.oom:
            assert opt.iteration_s <= r.iteration_s + 1e-9, name


def test_optimal_on_a_large_trace_gives_a_plan_a_bound_and_a_status():
    tr = load_corpus(names=["gpt-small-cpu"])[0]
    hw = load_hardware("h100-pcie5")
    budget = tr.static_bytes + (tr.peak_bytes_no_swap - tr.static_bytes) // 2
    plan = Optimal(time_limit_s=3.0).plan(tr, budget, hw)
    r = simulate(tr, plan, hw, budget)
    assert plan.meta["status"] in ("optimal", "time-limit") and not r.oom
    assert plan.meta["bound_s"] <= r.iteration_s
    assert plan.meta["gap"] == pytest.approx((r.iteration_s - plan.meta["bound_s"]) / r.iteration_s)
    ref = simulate(tr, get_policy("min").plan(tr, budget, hw), hw, budget)
    assert r.iteration_s <= ref.iteration_s


def test_genetic_search_is_reproducible_for_a_seed():
    tr = load_corpus(names=["resnet-tiny-cpu"])[0]
    hw = load_hardware("cpu-emulated")
    budget = tr.static_bytes + (tr.peak_bytes_no_swap - tr.static_bytes) // 2
    a = SwapAdvisor(seed=3, generations=5, search_seconds=1e9).plan(tr, budget, hw)
    b = SwapAdvisor(seed=3, generations=5, search_seconds=1e9).plan(tr, budget, hw)
    c = SwapAdvisor(seed=4, generations=5, search_seconds=1e9).plan(tr, budget, hw)
    assert a == b and a.meta["generations"] == 5
    assert simulate(tr, a, hw, budget).iteration_s <= simulate(tr, get_policy("capuchin").plan(tr, budget, hw), hw, budget).iteration_s
    assert c.meta["seed"] == 4


@pytest.mark.parametrize("name", BUDGET_AWARE)
def test_budget_aware_policies_fit_corpus_cases(name):
    hw = load_hardware("h100-pcie5")
    for tr in load_corpus(names=["gpt-small-cpu", "resnet-tiny-cpu", "unet-large-b16-a100-pcie4"]):
        budget = tr.static_bytes + (tr.peak_bytes_no_swap - tr.static_bytes) * 3 // 10
        budget = max(budget, tr.min_feasible_bytes)
        plan = get_policy(name, search_seconds=1.0).plan(tr, budget, hw)
        plan.validate(tr)
        r = simulate(tr, plan, hw, budget)
        assert not r.oom and r.peak_bytes <= budget, (name, tr.name)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_cases(), st.integers(0, 3))
def test_searching_planners_are_never_worse_than_min(case, seed):
    """default (network + search), local-search and swapadvisor start from the heuristics' exact
    plans and keep the best: never worse than min on the simulator."""
    from swapsched.agents.joint import LocalSearch
    from swapsched.agents.learned import LearnedPolicy

    tr, hw, budget = case
    ref = simulate(tr, get_policy("min").plan(tr, budget, hw), hw, budget)
    planners = [LearnedPolicy("default", mode="search", search_seconds=0.05, seed=seed),
                LocalSearch(search_seconds=0.05, seed=seed), SwapAdvisor(seed=seed, generations=3, search_seconds=1e9)]
    for pol in planners:
        plan = pol.plan(tr, budget, hw)
        plan.validate(tr)
        r = simulate(tr, plan, hw, budget)
        if not ref.oom:
            assert not r.oom and r.iteration_s <= ref.iteration_s + 1e-12, pol.name


def test_local_search_improves_min_where_min_leaves_room():
    """On unet-medium at 60% (h100-pcie5) min stalls on prefetches it placed too late; a few hundred
    simulator-scored moves find a faster plan (4% faster; 1.8% at 70% since the trace counts its
    transients, R3), deterministically for a number of evaluations."""
    from swapsched.agents.heuristics import heuristic_plans
    from swapsched.agents.local_search import improve
    from swapsched.agents.scoring import best_plan

    tr = load_corpus(names=["unet-medium-b64-h100-pcie5"])[0]
    hw = load_hardware("h100-pcie5")
    budget = tr.static_bytes + (tr.peak_bytes_no_swap - tr.static_bytes) * 6 // 10
    start, s0 = best_plan(tr, budget, hw, heuristic_plans(tr, budget, hw))
    a, sa, _ = improve(tr, budget, hw, start, seconds=1e9, seed=1, max_evals=300)
    b, sb, _ = improve(tr, budget, hw, start, seconds=1e9, seed=1, max_evals=300)
    assert a == b and sa == sb
    assert sa < 0.98 * s0
    assert simulate(tr, a, hw, budget).iteration_s == sa


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(joint_cases())
def test_the_joint_planners_on_blocks(case):
    """R9: optimal enumerates keep / swap / recompute and is never beaten; default is never worse
    than any of the techniques it competes with (the best swap heuristic, checkpoint-all and
    -selective, capuchin's hybrid); checkpoint-all recomputes every block and swaps nothing,
    checkpoint-selective every block with cheap members, selectively."""
    tr, _, hw, budget = case
    if len(tr.first_pack) > 4:
        return
    runs = {n: simulate(tr, get_policy(n, search_seconds=0.05).plan(tr, budget, hw), hw, budget)
            for n in ("min", "capuchin-swap", "capuchin", "checkpoint-all", "checkpoint-selective", "default")}
    ck = get_policy("checkpoint-all").plan(tr, budget, hw)
    assert not ck.evictions and len(ck.recompute) == len(tr.segments)
    sel = get_policy("checkpoint-selective").plan(tr, budget, hw)
    assert not sel.evictions and not sel.recompute and sel.selective == tuple(s.name for s in tr.segments if s.cheap)
    opt = simulate(tr, Optimal().plan(tr, budget, hw), hw, budget)
    best_other = min((r.iteration_s for n, r in runs.items() if n != "default" and not r.oom), default=None)
    if best_other is not None:
        assert not runs["default"].oom and runs["default"].iteration_s <= best_other * (1 + 1e-9)
        assert not opt.oom and opt.iteration_s <= runs["default"].iteration_s * (1 + 1e-9)


def test_checkpoint_offload_recomputes_every_block_and_offloads_its_input(one_block, hw):
    from swapsched.agents.recompute import CheckpointOffload
    from swapsched.plan import lead_eviction

    # one_block: blk.0 = anchor T0 + member T1; T2 ("head") in no block
    plan = CheckpointOffload().plan(one_block, 300, hw)
    assert plan.recompute == ("blk.0",) and plan.evictions == (lead_eviction(one_block, 0, 1, hw),)
    # R9's second stage in the runtime: the block already runs under checkpoint (no segments
    # left); what it saves inside the block (its input) is offloaded, the rest stays
    checkpointed = one_block.with_segments(lambda sg: False)
    plan = CheckpointOffload().plan(checkpointed, 300, hw)
    assert plan.recompute == () and {e.tensor for e in plan.evictions} == {0, 1}


@pytest.mark.parametrize("name", ["gpt-tiny-cpu", "resnet-small-cpu"])
def test_the_guarded_greedy_plan_is_the_best_of_its_candidates_and_never_worse_than_greedy(name):
    from swapsched.agents.learned import LearnedPolicy
    from swapsched.agents.recompute import CheckpointAll, CheckpointSelective
    from swapsched.agents.scoring import plan_score
    from swapsched.budget import parse_budget

    tr = load_corpus(names=[name])[0]
    hw = load_hardware("h100-pcie5")
    greedy, guarded = LearnedPolicy("default", mode="greedy"), get_policy("default-greedy-guarded")
    assert guarded.name == "default-greedy-guarded"
    for b in ("30%", "60%"):
        budget = parse_budget(b, tr)
        g, p = greedy.plan(tr, budget, hw), guarded.plan(tr, budget, hw)
        p.validate(tr)
        score = plan_score(simulate(tr, p, hw, budget), tr)
        assert score <= plan_score(simulate(tr, g, hw, budget), tr)
        for other in (CheckpointAll(), CheckpointSelective()):
            assert score <= plan_score(simulate(tr, other.plan(tr, budget, hw), hw, budget), tr)
        assert p.meta["guard"] in ("none", "checkpoint-all", "checkpoint-selective", "min", "default-greedy-guarded")
