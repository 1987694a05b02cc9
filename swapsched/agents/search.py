"""SwapAdvisor-style genetic search over swap plans, scored by the simulator.

Huang et al., "SwapAdvisor: Pushing Deep Learning Beyond the GPU Memory Limit via Smart Swapping",
ASPLOS 2020. A genome holds one gene per saved tensor: keep it, or evict it with an exact swap-out
and prefetch event (R7's window). The first population holds the heuristics' exact plans (not
rounded to lead classes), and the two best genomes survive every generation, so the search is never
worse than the best heuristic. Crossover takes each tensor's gene from either parent; mutation keeps
a tensor, evicts it at its last forward pack with a prefetch one of the lead classes
(``swapsched.plan.LEADS``) ahead, or moves its prefetch by a few events. Fitness is the simulated
step time; an OOM scores worse than any feasible plan, the earlier the worse. Departures: SwapAdvisor
also searches operator order and memory-pool layout, which a saved-tensor trace does not expose.

Deterministic for a seed and a generation count; ``search_seconds`` stops it early at a generation
boundary (then the result depends on the machine's speed, and the plan says how far it got).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from swapsched.agents.heuristics import heuristic_plans
from swapsched.agents.scoring import plan_score
from swapsched.env.simulator import simulate
from swapsched.hardware import Hardware
from swapsched.plan import LEADS, Eviction, SwapPlan, lead_prefetch
from swapsched.trace import Trace

__all__ = ["SwapAdvisor", "genome_of_plan", "plan_of_genome"]

_SHIFTS = np.array([-8, -4, -2, -1, 1, 2, 4, 8])


def genome_of_plan(trace: Trace, plan: SwapPlan) -> tuple[np.ndarray, np.ndarray]:
    """Per tensor: swap-out event (-1 = kept) and prefetch event, exactly as the plan has them."""
    out = np.full(trace.n_tensors, -1, dtype=np.int64)
    pre = np.zeros(trace.n_tensors, dtype=np.int64)
    for e in plan.evictions:
        out[e.tensor], pre[e.tensor] = e.swap_out_at, e.prefetch_at
    return out, pre


def plan_of_genome(trace: Trace, out: np.ndarray, pre: np.ndarray, name: str) -> SwapPlan:
    return SwapPlan.of(trace, name, [Eviction(int(k), int(out[k]), int(pre[k])) for k in np.flatnonzero(out >= 0)])


@dataclass(frozen=True)
class SwapAdvisor:
    """Genetic search; see the module docstring."""

    seed: int = 0
    population: int = 24
    generations: int = 40
    search_seconds: float = 10.0
    mutation: float | None = None  # per-gene rate; default 1 / tensors
    name: str = "swapadvisor"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        rng = np.random.default_rng(self.seed)
        n = trace.n_tensors
        deadline = time.perf_counter() + self.search_seconds
        lfp, fu = trace.last_forward_pack, trace.first_unpack

        def fitness(g: tuple[np.ndarray, np.ndarray]) -> float:
            out, pre = g
            evs = [Eviction(int(k), int(out[k]), int(pre[k])) for k in np.flatnonzero(out >= 0)]
            return plan_score(simulate(trace, evs, hardware, budget, validate=False), trace)

        def mutate(g: tuple[np.ndarray, np.ndarray], rate: float) -> tuple[np.ndarray, np.ndarray]:
            out, pre = g[0].copy(), g[1].copy()
            for k in np.flatnonzero(rng.random(n) < rate):
                r = rng.random()
                if out[k] >= 0 and r < 0.5:  # move the prefetch a few events
                    pre[k] = int(np.clip(pre[k] + int(rng.choice(_SHIFTS)), out[k], fu[k]))
                elif r < 0.7:
                    out[k] = -1
                else:
                    out[k] = lfp[k]
                    pre[k] = lead_prefetch(trace, int(k), int(rng.integers(0, len(LEADS))), hardware, int(lfp[k]))
            return out, pre

        seeds = [genome_of_plan(trace, p) for p in heuristic_plans(trace, budget, hardware)]
        rate = self.mutation if self.mutation is not None else 1.0 / max(n, 1)
        pop = seeds + [mutate(seeds[int(rng.integers(0, len(seeds)))], max(4 * rate, 0.05))
                       for _ in range(max(self.population - len(seeds), 0))]
        scores = [fitness(g) for g in pop]
        gen = 0
        while gen < self.generations and time.perf_counter() < deadline:
            order = np.argsort(scores, kind="stable")
            elite = [pop[i] for i in order[:2]]
            children: list[tuple[np.ndarray, np.ndarray]] = []
            while len(children) < self.population - len(elite):
                a, b = (pop[min(rng.integers(0, len(pop), 2), key=lambda i: scores[i])] for _ in range(2))
                take = rng.random(n) < 0.5
                child = (np.where(take, a[0], b[0]), np.where(take, a[1], b[1]))
                children.append(mutate(child, rate))
            pop = elite + children
            scores = [scores[i] for i in order[:2]] + [fitness(c) for c in children]
            gen += 1
        out, pre = pop[int(np.argmin(scores))]
        best = plan_of_genome(trace, out, pre, self.name)
        return SwapPlan.of(trace, self.name, best.evictions, generations=gen, seed=self.seed)
