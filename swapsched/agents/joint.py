"""The joint keep / swap / recompute search behind ``default`` (R9): candidates, then the local search.

The candidates are the single-pass heuristics' exact plans and what the checkpoint's learned parts
propose (``proposals``: in ``default``, the plan editor's edit of min's plan and the block
chooser's two most likely choices). The best, scored on the simulator, is improved by
:func:`~swapsched.agents.local_search.improve` until the planning time is spent (a swap-only
search draws its moves from the learned move prior, the joint search too where the floors agree,
uniformly where recompute can lower the floor). Where recompute can help (the floor over the joint space is under
R8's), the recompute techniques are candidates too (checkpoint-all, checkpoint-selective, the best
swap plan with every block recomputed, MIN around every block recomputed, and the best swap plan
and Capuchin's swap half each made hybrid by Capuchin's step), and the search toggles blocks'
states. Where recompute cannot lower R8's floor, or the best swap-only candidate is within
``SWAP_COMPETITIVE`` of the best candidate, a swap-only search from the best swap-only candidate
runs first (0.7 or 0.4 of the time), as ``default-swap`` would. Never worse on the simulator than
the best candidate, which is its start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from swapsched.agents.heuristics import heuristic_plans, min_around_blocks
from swapsched.agents.local_search import improve
from swapsched.agents.recompute import CheckpointAll, CheckpointSelective, hybridize, with_all_recomputed
from swapsched.agents.scoring import best_plan, plan_score, reaches
from swapsched.env.floors import analytic_floor, joint_floor
from swapsched.env.simulator import simulate
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.trace import Trace

__all__ = ["joint_search", "planning_seconds", "LocalSearch"]

#: Where the floors differ, the swap search still gets its share of the time if the best swap-only
#: candidate is within this factor of the best candidate (on the MLP-Mixer at 50% on C2C, the
#: chooser's recompute candidate led by 1% and the joint search ended 0.65% behind default-swap).
SWAP_COMPETITIVE = 1.05
#: The heuristics' share of the planning time: Capuchin is left out where its ~100 simulations
#: would not fit in it (``heuristic_plans``), so the search always keeps the other half
HEURISTICS_SHARE = 0.5
#: The swap search's share of what is left after the candidates and floors: most of it where
#: recompute cannot lower the floor (the swaps decide the step), less where the joint search
#: needs time too. Set by hand with the held-out bench (scripts/bench_policy.py); every figure of
#: ``default`` in docs/RESULTS.md is with these values
SWAP_SEARCH_SHARE = {"floors agree": 0.7, "floors differ": 0.4}
#: Capuchin's hybrid step over the i-th swap plan must end by (first + step * i) of that rest: the
#: first well before the joint search starts, each later one a fifth later (same provenance)
HYBRID_DEADLINE_FIRST, HYBRID_DEADLINE_STEP = 0.35, 0.2


def joint_search(trace: Trace, budget: int, hardware: Hardware, *, seconds: float,
                 proposals: Callable[[SwapPlan], Sequence[SwapPlan]] | None = None, prior: Any = None, seed: int = 0,
                 recompute: bool = True) -> tuple[SwapPlan, int]:
    """The best plan found in ``seconds`` of planning (all of it: heuristics, floors, candidates,
    search) and the number of plans the search scored. ``proposals(min_plan)``: the learned
    candidates; ``prior``: the search's move prior (None: uniform); ``recompute=False``: swap only."""
    t0 = time.perf_counter()
    heur = heuristic_plans(trace, budget, hardware, deadline=t0 + HEURISTICS_SHARE * seconds)
    min_plan = next(p for p in heur if p.policy == "min")
    cands = [*(proposals(min_plan) if proposals else ()), *heur]
    scores = [plan_score(simulate(trace, p, hardware, budget, validate=False), trace) for p in cands]
    score, at = min((s, i) for i, s in enumerate(scores))  # the first wins ties, as in best_plan
    start = cands[at]
    joint = recompute and bool(trace.segments)
    evals = 0
    # stop early where the plan meets the floor (R8, or R8 over the joint space): nothing can be faster
    swap_floor = analytic_floor(trace, budget, hardware)
    floor = joint_floor(trace, budget, hardware) if joint else swap_floor
    t1 = time.perf_counter()
    rest = max(seconds - (t1 - t0), 0.0)  # the floors' time is planning time too
    swap_score, first_at = min((s, i) for i, s in enumerate(scores) if not (cands[i].recompute or cands[i].selective))
    agree = reaches(swap_floor, floor)  # recompute cannot lower the floor
    if joint and (agree or swap_score <= score * SWAP_COMPETITIVE):
        # recomputing cannot lower R8's floor here, or the best swap plan is within a few percent
        # of the best candidate: the swaps may decide the step (on the held-out bench the best
        # recompute technique was within 1% of the swap search wherever the floors agree), so the
        # swap search gets its time, as default-swap has it, from the best swap-only candidate
        # (most of it where the floors agree; a learned candidate that recomputes stays in the
        # running, and the joint search below goes on from the better of the two)
        first = cands[first_at]
        found, found_score, evals = improve(trace, budget, hardware, first, seconds=SWAP_SEARCH_SHARE["floors agree" if agree else "floors differ"] * rest,
                                            seed=seed, prior=prior, target=swap_floor)
        if found_score <= score:
            start, score = found, found_score
    if joint and not reaches(score, floor):

        # the best swap plan and capuchin's swap half, each made hybrid by Capuchin's step
        swaps = [start, *(p for p in heur if p.policy == "capuchin" and p is not start)]
        every = range(len(trace.segments))
        cands = [start, CheckpointAll().plan(trace, budget, hardware), with_all_recomputed(trace, start, "swap+checkpoint"),
                 min_around_blocks(trace, budget, hardware, recompute=every, name="min+checkpoint"),
                 CheckpointSelective().plan(trace, budget, hardware),
                 with_all_recomputed(trace, start, "swap+selective", selective=True),
                 *(hybridize(trace, budget, hardware, p, deadline=t1 + (HYBRID_DEADLINE_FIRST + HYBRID_DEADLINE_STEP * i) * rest) for i, p in enumerate(swaps))]
        start, _ = best_plan(trace, budget, hardware, cands)
    left = seconds - (time.perf_counter() - t0)
    # the prior was learned from swap-only searches from the best swap heuristic's plan; where
    # recompute can lower the floor it made the joint search worse than uniform moves
    # (scripts/bench_prior.py: 1.0009 over 213 cases, up to 14% on unet-large at 30% on PCIe,
    # where the start recomputes), so there the joint search draws uniformly; where the floors
    # agree it is a swap search in effect and keeps the prior
    plan, _, more = improve(trace, budget, hardware, start, seconds=max(left, 0.0), seed=seed,
                            prior=prior if agree or not joint else None,
                            target=floor, recompute=joint)
    return SwapPlan.of(trace, plan.policy, plan.evictions, recompute=plan.recompute, selective=plan.selective,
                       start=start.policy), evals + more


def planning_seconds(trace: Trace) -> float:
    """The default planning time of the searching planners (``default``, ``local-search``), all of
    the planning included: 0.9 s up to 500 saved tensors, growing to 2.7 s at 2,000 (under the
    3 s a 2,000-tensor plan may take, with room for the last simulation's overrun)."""
    return 0.9 + 1.8 * min(max(trace.n_tensors - 500, 0), 1500) / 1500


@dataclass(frozen=True)
class LocalSearch:
    """``local-search``: the swap-only pipeline of :func:`joint_search` with no learned part: the
    best single-pass heuristic's plan, improved by uniform moves (``local_search.improve``) until
    ``search_seconds`` of planning in all (the heuristics included; default
    :func:`planning_seconds`) are spent, or the plan meets R8's floor."""

    search_seconds: float | None = None
    seed: int = 0
    name: str = "local-search"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        total = self.search_seconds if self.search_seconds is not None else planning_seconds(trace)
        plan, evals = joint_search(trace, budget, hardware, seconds=total, seed=self.seed, recompute=False)
        return SwapPlan.of(trace, self.name, plan.evictions, start=plan.meta["start"], search_evals=evals, seed=self.seed)
