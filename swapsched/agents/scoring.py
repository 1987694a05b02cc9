"""How planners score and compare plans, and draw training cases: the helpers every search shares.

A plan's score is its simulated step time (R1-R8; lower is better), with an OOM worse than any
feasible plan (:func:`plan_score`). Scores are sums of float gaps, so two plans whose steps differ
by less than :data:`IMPROVEMENT_TOL` of a step are the same plan for a search (:func:`improves`),
and a step within :data:`BOUND_TOL` of a proven bound has reached it (:func:`reaches`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from swapsched.env.result import SimResult
from swapsched.env.simulator import simulate
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.trace import Trace

__all__ = ["plan_score", "best_plan", "draw_case", "training_cases", "improves", "reaches", "IMPROVEMENT_TOL", "BOUND_TOL", "TINY_S"]

#: A score improves on another only by more than this share of it (of 1 s, below 1 s): simulated
#: steps are sums of a few thousand float64 gaps, exact to ~1e-13 of a step, so a smaller
#: difference is rounding, and accepting it would let a search cycle between equal plans
IMPROVEMENT_TOL = 1e-12
#: A step within this share of a bound (R8's floor, a proven lower bound) has reached it: the bound
#: and the step are summed in different orders, and agree to ~1e-12 of a step where they are equal
BOUND_TOL = 1e-9
#: A time below any real gap (a picosecond), the floor of a divisor where a block's or a trace's
#: compute may be 0 (a hand-made trace)
TINY_S = 1e-12


def improves(score: float, best: float) -> bool:
    """Whether ``score`` is better than ``best`` by more than rounding (:data:`IMPROVEMENT_TOL`)."""
    return score < best - IMPROVEMENT_TOL * max(best, 1.0)


def reaches(step_s: float, bound_s: float) -> bool:
    """Whether ``step_s`` is at ``bound_s`` (nothing can beat a proven bound; :data:`BOUND_TOL`)."""
    return step_s <= bound_s * (1 + BOUND_TOL)


def plan_score(result: SimResult, trace: Trace) -> float:
    """Lower is better: the step time; an OOM is worse than any feasible plan, and a later OOM
    less bad than an earlier one."""
    if result.oom:
        return 1e6 * result.ideal_s * (2.0 - (result.oom_event or 0) / max(trace.n_events, 1)) + 1e6
    return result.iteration_s


def best_plan(trace: Trace, budget: int, hardware: Hardware, plans: Sequence[SwapPlan]) -> tuple[SwapPlan, float]:
    """The plan of ``plans`` with the lowest ``plan_score``, and its score (first wins ties)."""
    scored = [(plan_score(simulate(trace, p, hardware, budget, validate=False), trace), i) for i, p in enumerate(plans)]
    s, i = min(scored)
    return plans[i], s


def draw_case(trace: Trace, hardware: Sequence[Hardware], rng: np.random.Generator,
              budget_range: tuple[float, float]) -> tuple[Hardware, int]:
    """A random training case on ``trace``: one of ``hardware``, and a budget at a uniform fraction
    of the activation range above static bytes, never below the smallest feasible budget. The
    searches that teach the move prior, the plan editor and the block chooser draw their cases here."""
    hw = hardware[int(rng.integers(0, len(hardware)))]
    frac = float(rng.uniform(*budget_range))
    budget = max(int(trace.static_bytes + frac * (trace.peak_bytes_no_swap - trace.static_bytes)), trace.min_feasible_bytes)
    return hw, budget


def training_cases(traces: Sequence[Trace], hardware: Sequence[Hardware], rng: np.random.Generator, *,
                   cases_per_trace: int, budget_range: tuple[float, float], progress: bool = False,
                   desc: str = "cases") -> Iterator[tuple[Trace, Hardware, int]]:
    """Each trace ``cases_per_trace`` times in turn, with a random case each (:func:`draw_case`),
    under a progress bar: the loop that collects every learned part's training data."""
    jobs = [tr for tr in traces for _ in range(cases_per_trace)]
    for tr in tqdm(jobs, disable=not progress, desc=desc, unit="case", leave=False):
        hw, budget = draw_case(tr, hardware, rng, budget_range)
        yield tr, hw, budget
