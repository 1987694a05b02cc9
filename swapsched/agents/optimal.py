"""The reference every planner is judged against: the best plan found, with a proven lower bound.

Over the joint space of keep / swap / recompute (R9):

- **Small traces** (at most ``max_plans`` plans: each block kept, recomputed whole or selectively, times R7's space
  with the swap-out at each tensor's last forward pack for the tensors left): every plan is
  simulated (R1-R9) and the fastest feasible one is returned. It is exact over that space, the one
  every other policy here plans in, and ``status`` is ``optimal``.
- **Larger traces**: a proven lower bound on the step time of *any* plan (``agents/bound.py``: a
  mixed-integer relaxation of R1-R9 solved by HiGHS, documented there, never below the joint
  floor), and the best plan a simulator-scored search finds in the rest of the time limit: the
  candidates are the heuristics' exact plans, checkpoint-all and -selective, ``default``'s joint plan and a
  SwapAdvisor run (a sixth of the time), so it is never worse than any of them; the best is
  improved by ``local_search.improve`` over the joint space, which stops early at the bound. The plan is scored on the simulator like every other; ``status`` is ``optimal`` when it
  meets the bound, else ``time-limit`` with the relative ``gap`` between the plan and the bound.

``meta`` carries ``bound_s``, ``status``, ``gap`` and ``bound_status`` (which model proved the bound).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from swapsched.agents.bound import lower_bound
from swapsched.agents.heuristics import heuristic_plans
from swapsched.agents.learned import LearnedPolicy
from swapsched.agents.local_search import improve
from swapsched.agents.recompute import CheckpointAll, CheckpointSelective
from swapsched.agents.scoring import best_plan
from swapsched.agents.search import SwapAdvisor
from swapsched.env.simulator import simulate
from swapsched.hardware import Hardware
from swapsched.plan import BlockState, Eviction, SwapPlan, swap_out_event
from swapsched.trace import Trace

__all__ = ["Optimal"]


def _options(trace: Trace, rebuilt: frozenset[int] = frozenset()) -> list[list[Eviction | None]]:
    """Per tensor not ``rebuilt`` by a recompute: kept, or evicted at its last forward pack with
    each prefetch event R7 allows."""
    out = []
    for k in range(trace.n_tensors):
        if k in rebuilt:
            continue
        so, fu = swap_out_event(trace, k), int(trace.first_unpack[k])
        out.append([None] + [Eviction(k, so, pf) for pf in range(so, fu + 1)])
    return out


def _spaces(trace: Trace) -> list[tuple[tuple[int, ...], tuple[int, ...], list[list[Eviction | None]]]]:
    """Every assignment of the blocks to kept, recomputed whole or selectively (R9), with the
    eviction options of the tensors it leaves: (whole, selective, options)."""
    segs = trace.segments
    out = []
    for states in itertools.product(*(tuple(BlockState) if s.cheap else (BlockState.KEPT, BlockState.WHOLE) for s in segs)):
        whole = tuple(s.index for s, c in zip(segs, states, strict=True) if c == BlockState.WHOLE)
        selective = tuple(s.index for s, c in zip(segs, states, strict=True) if c == BlockState.SELECTIVE)
        rebuilt = frozenset(k for s in whole + selective for k in segs[s].members)
        out.append((whole, selective, _options(trace, rebuilt)))
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
        size = math.prod(len(o) for o in _options(trace))
        if len(trace.segments) <= 12:
            size = sum(math.prod(len(o) for o in opts) for _, _, opts in _spaces(trace))
            if size <= self.max_plans:
                return self._enumerate(trace, budget, hardware, _spaces(trace), size)
        bound = lower_bound(trace, budget, hardware, time_limit_s=self.time_limit_s / 3)

        cands = [*heuristic_plans(trace, budget, hardware), CheckpointAll().plan(trace, budget, hardware),
                 CheckpointSelective().plan(trace, budget, hardware),
                 LearnedPolicy("default", mode="search", seed=self.seed).plan(trace, budget, hardware),
                 SwapAdvisor(seed=self.seed, search_seconds=self.time_limit_s / 6).plan(trace, budget, hardware)]
        # the search and the bound move activations only: a candidate's state placement is left
        # out before it is compared, or a start that fits only by moving the state would not fit
        cands = [SwapPlan.of(trace, c.policy, c.evictions, recompute=c.recompute, selective=c.selective) for c in cands]
        start, _ = best_plan(trace, budget, hardware, cands)
        left = self.time_limit_s - (time.perf_counter() - t0)
        plan, score, evals = improve(trace, budget, hardware, start, seconds=max(left, 0.0), seed=self.seed,
                                     target=bound.bound_s, recompute=True)
        res = simulate(trace, plan, hardware, budget, validate=False)
        if res.oom:
            status, gap = "infeasible", None
        else:
            gap = max(res.iteration_s - bound.bound_s, 0.0) / res.iteration_s
            status = "optimal" if gap <= 1e-6 else "time-limit"
        return SwapPlan.of(trace, self.name, plan.evictions, recompute=plan.recompute, selective=plan.selective,
                           bound_s=bound.bound_s,
                           status=status, gap=gap, bound_status=bound.status, search_evals=evals, start=start.policy)

    def _enumerate(self, trace: Trace, budget: int, hardware: Hardware,
                   spaces: list[tuple[tuple[int, ...], tuple[int, ...], list[list[Eviction | None]]]], size: int) -> SwapPlan:
        best_key: tuple[float, float, int] | None = None
        best: tuple[tuple[Eviction, ...], tuple[int, ...], tuple[int, ...]] = ((), (), ())
        for blocks, selective, options in spaces:
            for combo in itertools.product(*options):
                evs = tuple(e for e in combo if e is not None)
                r = simulate(trace, evs, hardware, budget, validate=False, recompute=blocks, selective=selective)
                if r.oom:
                    continue
                # ties: less recompute, then fewer bytes moved, then the first in enumeration order
                key = (r.iteration_s, r.recompute_s, r.d2h_bytes)
                if best_key is None or key < best_key:
                    best_key, best = key, (evs, blocks, selective)
        if best_key is None:  # no plan fits: say so the way every policy does, with an OOM in simulation
            return SwapPlan.of(trace, self.name, [], plans_searched=size, feasible=False, status="infeasible")
        return SwapPlan.of(trace, self.name, best[0], recompute=[trace.segments[s].name for s in best[1]],
                           selective=[trace.segments[s].name for s in best[2]],
                           plans_searched=size, feasible=True, status="optimal", bound_s=best_key[0], gap=0.0,
                           bound_status="enumeration")
