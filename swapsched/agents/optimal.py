"""The exact best plan for small traces: the yardstick for "how far from optimal".

The plan space is R7's with the swap-out at each tensor's last forward pack (the earliest point at
which evicting it frees memory, where every other policy here issues it too): for every tensor,
keep it, or evict it with a prefetch at any event from its swap-out to its first unpack. Every plan
in that space is simulated (R1-R8) and the fastest feasible one is returned, so on a trace it
accepts, ``optimal`` is never worse than any policy whose plans lie in that space — all the
heuristics, the genetic search and the learned policy do.

Exhaustive search is exact but exponential: ``max_plans`` bounds the size of the space, and a
larger trace is refused with :class:`TooLargeError` rather than answered approximately.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from swapsched.env.simulator import Simulation
from swapsched.errors import UserError
from swapsched.hardware import Hardware
from swapsched.plan import Eviction, SwapPlan, swap_out_event
from swapsched.trace import Trace

__all__ = ["Optimal", "TooLargeError", "plan_space_size"]


class TooLargeError(UserError):
    """The trace's plan space is too large to enumerate exactly."""


def _options(trace: Trace) -> list[list[Eviction | None]]:
    out = []
    for k in range(trace.n_tensors):
        so, fu = swap_out_event(trace, k), int(trace.first_unpack[k])
        out.append([None] + [Eviction(k, so, pf) for pf in range(so, fu + 1)])
    return out


def plan_space_size(trace: Trace) -> int:
    return math.prod(len(o) for o in _options(trace))


@dataclass(frozen=True)
class Optimal:
    """Exhaustive search of the plan space (see the module docstring)."""

    max_plans: int = 200_000
    name: str = "optimal"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        options = _options(trace)
        size = math.prod(len(o) for o in options)
        if size > self.max_plans:
            raise TooLargeError(
                f"optimal: trace {trace.name!r} has {size:,} plans (> {self.max_plans:,}); "
                "it is exact only for small traces; use swapadvisor or capuchin"
            )
        best_key: tuple[float, int] | None = None
        best: tuple[Eviction, ...] = ()
        for combo in itertools.product(*options):
            evs = tuple(e for e in combo if e is not None)
            sim = Simulation(trace, hardware, budget)
            for e in evs:
                sim.schedule(e.tensor, e.swap_out_at, e.prefetch_at)
            r = sim.finish()
            if r.oom:
                continue
            # ties: fewer bytes moved, then the first in enumeration order
            key = (r.iteration_s, r.d2h_bytes)
            if best_key is None or key < best_key:
                best_key, best = key, evs
        if best_key is None:  # no plan fits: say so the way every policy does, with an OOM in simulation
            return SwapPlan.of(trace, self.name, [], plans_searched=size, feasible=False)
        return SwapPlan.of(trace, self.name, best, plans_searched=size, feasible=True)
