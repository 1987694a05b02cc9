"""Local search over exact plans, scored on the simulator: the bar every learned planner must clear.

Start from the best of a set of plans (by default the single-pass heuristics' own plans, exact,
not rounded to lead classes), then hill-climb with small moves, each scored by simulating the whole
step (R1-R8, so every accepted plan is one the simulator, and hence the runtime, can execute):

- move one prefetch earlier or later by 1-16 events (within R7's window ``[swap-out, first unpack]``);
- issue one swap-out later by 1-8 events (it still frees the tensor, R7, and may stop it crowding
  the link while something more urgent copies);
- drop one eviction; add one (out at its last forward pack, prefetch one of the lead classes ahead);
- replace one eviction by one of a kept tensor of the nearest size.

Moves are drawn at random, half of them aimed at the tensors whose unpack stalled in the current
best plan (read from the simulator's recorded timeline). A move is kept when it lowers the step
time (or, while the plan is an OOM, moves the OOM later); the search stops at its time limit.
Deterministic for a seed and a number of evaluations; the time limit makes it depend on the
machine's speed, and the plan's ``meta`` says how many plans it scored.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from swapsched.env.simulator import SimResult, simulate
from swapsched.hardware import Hardware
from swapsched.plan import LEADS, Eviction, SwapPlan, prefetch_event
from swapsched.trace import Trace

__all__ = ["LocalSearch", "improve", "plan_score", "heuristic_plans", "best_plan"]

_PREFETCH_SHIFTS = (-16, -8, -4, -2, -1, 1, 2, 4, 8, 16)
_OUT_SHIFTS = (1, 2, 4, 8)


def plan_score(result: SimResult, trace: Trace) -> float:
    """Lower is better: the step time; an OOM is worse than any feasible plan, and a later OOM
    less bad than an earlier one."""
    if result.oom:
        return 1e6 * result.ideal_s * (2.0 - (result.oom_event or 0) / max(trace.n_events, 1)) + 1e6
    return result.iteration_s


def heuristic_plans(trace: Trace, budget: int, hardware: Hardware) -> list[SwapPlan]:
    """The single-pass heuristics' exact plans (no-swap, swap-all, vDNN both ways, min, capuchin)."""
    from swapsched.agents.heuristics import VDNN, Belady, Capuchin, NoSwap, SwapAll

    return [h.plan(trace, budget, hardware) for h in (NoSwap(), SwapAll(), VDNN(), VDNN(conv_only=True), Belady(), Capuchin())]


def best_plan(trace: Trace, budget: int, hardware: Hardware, plans: Sequence[SwapPlan]) -> tuple[SwapPlan, float]:
    """The plan of ``plans`` with the lowest ``plan_score``, and its score (first wins ties)."""
    scored = [(plan_score(simulate(trace, p, hardware, budget, validate=False), trace), i) for i, p in enumerate(plans)]
    s, i = min(scored)
    return plans[i], s


def improve(trace: Trace, budget: int, hardware: Hardware, start: SwapPlan, *, seconds: float,
            seed: int = 0, max_evals: int | None = None, target: float = 0.0) -> tuple[SwapPlan, float, int]:
    """Hill-climb from ``start`` for ``seconds`` (or ``max_evals`` scored plans, or until the step
    time reaches ``target``, a proven lower bound); returns the best plan (named as ``start``), its
    score and the number of plans scored."""
    rng = np.random.default_rng(seed)
    deadline = time.perf_counter() + seconds
    n = trace.n_tensors
    fu = trace.first_unpack
    lfp = trace.last_forward_pack
    b = trace.tensor_bytes
    by_size = np.argsort(b, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[by_size] = np.arange(n)
    h2d = np.array([hardware.h2d_time(int(x)) for x in b])

    cur: dict[int, tuple[int, int]] = {e.tensor: (e.swap_out_at, e.prefetch_at) for e in start.evictions}

    def evaluate(plan: dict[int, tuple[int, int]], record: bool = False) -> SimResult:
        evs = [Eviction(k, o, p) for k, (o, p) in plan.items()]
        return simulate(trace, evs, hardware, budget, record=record, validate=False)

    def stalled(res: SimResult) -> list[int]:
        """Evicted tensors first unpacked at an event that stalled."""
        if res.timeline is None:
            return []
        at = {int(ev) for _, _, ev in res.timeline.stalls}
        return [k for k in cur if int(fu[k]) in at]

    res = evaluate(cur, record=True)
    best = plan_score(res, trace)
    hot = stalled(res)
    evals = 1
    while time.perf_counter() < deadline and (max_evals is None or evals < max_evals) and best > target * (1 + 1e-9):
        cand = dict(cur)
        move = rng.random()
        evicted = list(cur)
        if evicted and move < 0.55:  # shift one prefetch (aimed at a stalled tensor half the time)
            targets = [t for t in hot if t in cur]
            k = int(rng.choice(targets)) if targets and rng.random() < 0.5 else int(rng.choice(evicted))
            o, p = cand[k]
            p2 = int(np.clip(p + int(rng.choice(_PREFETCH_SHIFTS)), o, fu[k]))
            if p2 == p:
                continue
            cand[k] = (o, p2)
        elif evicted and move < 0.65:  # issue a swap-out later
            k = int(rng.choice(evicted))
            o, p = cand[k]
            o2 = min(o + int(rng.choice(_OUT_SHIFTS)), p, int(fu[k]) - 1)
            if o2 <= o:
                continue
            cand[k] = (o2, p)
        elif evicted and move < 0.75:  # drop one eviction
            del cand[int(rng.choice(evicted))]
        elif len(cur) < n and move < 0.9:  # add one eviction
            kept = [k for k in range(n) if k not in cur]
            k = int(rng.choice(kept))
            cand[k] = _fresh_eviction(trace, k, int(rng.integers(0, len(LEADS))), h2d, lfp)
        elif evicted and len(cur) < n:  # replace one eviction by a kept tensor of the nearest size
            k = int(rng.choice(evicted))
            r = int(rank[k])
            near = [int(by_size[j]) for j in range(max(r - 3, 0), min(r + 4, n)) if int(by_size[j]) not in cur]
            if not near:
                continue
            j = near[int(rng.integers(0, len(near)))]
            del cand[k]
            cand[j] = _fresh_eviction(trace, j, int(rng.integers(0, len(LEADS))), h2d, lfp)
        else:
            continue
        r2 = evaluate(cand)
        evals += 1
        s = plan_score(r2, trace)
        if s < best - 1e-12 * max(best, 1.0):
            cur, best = cand, s
            if evals % 8 == 0 or not hot:  # refresh the stall targets now and then (recording costs)
                hot = stalled(evaluate(cur, record=True))
                evals += 1
    plan = SwapPlan.of(trace, start.policy, [Eviction(k, o, p) for k, (o, p) in cur.items()],
                       **{**start.meta, "search_evals": evals})
    return plan, best, evals


def _fresh_eviction(trace: Trace, k: int, lead_index: int, h2d: np.ndarray, lfp: np.ndarray) -> tuple[int, int]:
    so = int(lfp[k])
    return so, prefetch_event(trace, k, LEADS[lead_index] * float(h2d[k]), so)


@dataclass(frozen=True)
class LocalSearch:
    """The best single-pass heuristic's plan, improved by :func:`improve` for ``search_seconds``."""

    search_seconds: float = 1.0
    seed: int = 0
    name: str = "local-search"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        start, _ = best_plan(trace, budget, hardware, heuristic_plans(trace, budget, hardware))
        plan, _, _ = improve(trace, budget, hardware, start, seconds=self.search_seconds, seed=self.seed)
        return SwapPlan.of(trace, self.name, plan.evictions, start=start.policy, search_evals=plan.meta["search_evals"],
                           seed=self.seed)
