"""The reference every planner is judged against: the best plan found, with a proven lower bound.

- **Small traces** (at most ``max_plans`` plans in R7's space with the swap-out at each tensor's
  last forward pack): every plan is simulated (R1-R8) and the fastest feasible one is returned. It
  is exact over that space, the one every other policy here plans in, and ``status`` is ``optimal``.
- **Larger traces**: a proven lower bound on the step time of *any* plan (``agents/bound.py``: a
  mixed-integer relaxation of R1-R8 solved by HiGHS, documented there, never below the R8 floor),
  and the best plan a simulator-scored search finds in the rest of the time limit (the heuristics'
  exact plans, improved by ``local_search.improve``; the search stops early when it reaches the
  bound). The plan is scored on the simulator like every other; ``status`` is ``optimal`` when it
  meets the bound, else ``time-limit`` with the relative ``gap`` between the plan and the bound.

``meta`` carries ``bound_s``, ``status``, ``gap`` and ``bound_status`` (which model proved the bound).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from swapsched.agents.bound import lower_bound
from swapsched.agents.local_search import best_plan, heuristic_plans, improve
from swapsched.env.simulator import simulate
from swapsched.hardware import Hardware
from swapsched.plan import Eviction, SwapPlan, swap_out_event
from swapsched.trace import Trace

__all__ = ["Optimal"]


def _options(trace: Trace) -> list[list[Eviction | None]]:
    out = []
    for k in range(trace.n_tensors):
        so, fu = swap_out_event(trace, k), int(trace.first_unpack[k])
        out.append([None] + [Eviction(k, so, pf) for pf in range(so, fu + 1)])
    return out


@dataclass(frozen=True)
class Optimal:
    """Exhaustive search where the plan space is small, else bound + search (module docstring)."""

    time_limit_s: float = 60.0
    max_plans: int = 200_000
    seed: int = 0
    name: str = "optimal"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        t0 = time.perf_counter()
        options = _options(trace)
        size = math.prod(len(o) for o in options)
        if size <= self.max_plans:
            return self._enumerate(trace, budget, hardware, options, size)
        bound = lower_bound(trace, budget, hardware, time_limit_s=self.time_limit_s / 3)
        start, _ = best_plan(trace, budget, hardware, heuristic_plans(trace, budget, hardware))
        left = self.time_limit_s - (time.perf_counter() - t0)
        plan, score, evals = improve(trace, budget, hardware, start, seconds=max(left, 0.0), seed=self.seed,
                                     target=bound.bound_s)
        res = simulate(trace, plan, hardware, budget, validate=False)
        if res.oom:
            status, gap = "infeasible", None
        else:
            gap = max(res.iteration_s - bound.bound_s, 0.0) / res.iteration_s
            status = "optimal" if gap <= 1e-6 else "time-limit"
        return SwapPlan.of(trace, self.name, plan.evictions, bound_s=bound.bound_s, status=status, gap=gap,
                           bound_status=bound.status, search_evals=evals, start=start.policy)

    def _enumerate(self, trace: Trace, budget: int, hardware: Hardware, options: list[list[Eviction | None]],
                   size: int) -> SwapPlan:
        best_key: tuple[float, int] | None = None
        best: tuple[Eviction, ...] = ()
        for combo in itertools.product(*options):
            evs = tuple(e for e in combo if e is not None)
            r = simulate(trace, evs, hardware, budget, validate=False)
            if r.oom:
                continue
            # ties: fewer bytes moved, then the first in enumeration order
            key = (r.iteration_s, r.d2h_bytes)
            if best_key is None or key < best_key:
                best_key, best = key, evs
        if best_key is None:  # no plan fits: say so the way every policy does, with an OOM in simulation
            return SwapPlan.of(trace, self.name, [], plans_searched=size, feasible=False, status="infeasible")
        return SwapPlan.of(trace, self.name, best, plans_searched=size, feasible=True, status="optimal",
                           bound_s=best_key[0], gap=0.0, bound_status="enumeration")
