"""SwapAdvisor-style genetic search over swap plans, scored by the simulator.

Huang et al., "SwapAdvisor: Pushing Deep Learning Beyond the GPU Memory Limit via Smart Swapping",
ASPLOS 2020. A genome holds one gene per saved tensor: 0 keeps it, ``1 + l`` evicts it at its last
forward pack with prefetch lead class ``l`` (``swapsched.plan.LEADS``, the same choices the learned
policy has). Fitness is the simulated step time; an OOM scores worse than any feasible plan, the
earlier the worse. The first population is seeded with the heuristics' plans. Departures: SwapAdvisor
also searches operator order and memory-pool layout, which a saved-tensor trace does not expose.

Deterministic for a seed and a generation count; ``search_seconds`` stops it early at a generation
boundary (then the result depends on the machine's speed, and the plan says how far it got).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from swapsched.env.simulator import Simulation
from swapsched.hardware import Hardware
from swapsched.plan import LEADS, SwapPlan, lead_eviction
from swapsched.trace import Trace

__all__ = ["SwapAdvisor", "genes_of_plan", "plan_of_genes"]


def plan_of_genes(trace: Trace, genes: np.ndarray, hardware: Hardware, name: str) -> SwapPlan:
    evs = [lead_eviction(trace, k, int(g) - 1, hardware) for k, g in enumerate(genes) if g > 0]
    return SwapPlan.of(trace, name, evs)


def genes_of_plan(trace: Trace, plan: SwapPlan, hardware: Hardware) -> np.ndarray:
    """The nearest genome to a plan: each eviction's lead rounded to the closest class."""
    genes = np.zeros(trace.n_tensors, dtype=np.int64)
    times = trace.event_times
    for e in plan.evictions:
        fu = int(trace.first_unpack[e.tensor])
        if e.prefetch_at >= fu:
            genes[e.tensor] = 1
            continue
        lead = (times[fu] - times[e.prefetch_at]) / hardware.h2d_time(int(trace.tensor_bytes[e.tensor]))
        finite = [abs(math.log2(max(lead, 1e-9)) - math.log2(c)) if c > 0 else math.inf for c in LEADS[:-1]]
        genes[e.tensor] = 1 + int(np.argmin(finite))
    return genes


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
        from swapsched.agents.heuristics import VDNN, Belady, Capuchin, NoSwap, SwapAll

        rng = np.random.default_rng(self.seed)
        n, n_genes = trace.n_tensors, 1 + len(LEADS)
        deadline = time.perf_counter() + self.search_seconds
        ideal = trace.ideal_s

        def fitness(genes: np.ndarray) -> float:
            sim = Simulation(trace, hardware, budget)
            for k, g in enumerate(genes):
                if g > 0:
                    e = lead_eviction(trace, k, int(g) - 1, hardware)
                    sim.schedule(e.tensor, e.swap_out_at, e.prefetch_at)
            r = sim.finish()
            if r.oom:  # worse than any feasible plan; an OOM later in the step is less bad
                return 1e6 * ideal * (2.0 - (r.oom_event or 0) / max(trace.n_events, 1))
            return r.iteration_s

        seeds = [genes_of_plan(trace, h.plan(trace, budget, hardware), hardware)
                 for h in (NoSwap(), SwapAll(), VDNN(), VDNN(conv_only=True), Belady(), Capuchin())]
        pop = seeds + [rng.integers(0, n_genes, n) for _ in range(max(self.population - len(seeds), 0))]
        scores = [fitness(g) for g in pop]
        rate = self.mutation if self.mutation is not None else 1.0 / max(n, 1)
        gen = 0
        while gen < self.generations and time.perf_counter() < deadline:
            order = np.argsort(scores, kind="stable")
            elite = [pop[i] for i in order[:2]]
            children = []
            while len(children) < self.population - len(elite):
                a, b = (pop[min(rng.integers(0, len(pop), 2), key=lambda i: scores[i])] for _ in range(2))
                child = np.where(rng.random(n) < 0.5, a, b)
                flip = rng.random(n) < rate
                child[flip] = rng.integers(0, n_genes, int(flip.sum()))
                children.append(child)
            pop = elite + children
            scores = [scores[i] for i in order[:2]] + [fitness(c) for c in children]
            gen += 1
        best = plan_of_genes(trace, pop[int(np.argmin(scores))], hardware, self.name)
        return SwapPlan.of(trace, self.name, best.evictions, generations=gen, seed=self.seed)
