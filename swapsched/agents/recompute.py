"""Recompute as a policy decision (R9): activation checkpointing of every block, and the hybrid step
that turns a swap plan into a keep / swap / recompute plan.

- :class:`CheckpointAll` (``checkpoint-all``) is what users pick on PCIe GPUs today:
  ``torch.utils.checkpoint`` around every block, nothing swapped.
- :func:`hybridize` is Capuchin's hybrid choice (Peng et al., ASPLOS 2020, section 4.3): rank the
  recomputable blocks by memory saved per second of recompute (its MSPS), and recompute each in
  turn instead of keeping or swapping its tensors where that makes the (simulated) step faster. Capuchin
  measures the candidate on the next real iteration; here the simulator stands in for it, as it
  does for Capuchin's swap feedback (``agents/heuristics.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from swapsched.agents.local_search import plan_score
from swapsched.env.simulator import simulate
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.trace import Trace

__all__ = ["CheckpointAll", "hybridize", "with_all_recomputed"]


@dataclass(frozen=True)
class CheckpointAll:
    """Recompute every block (:attr:`Trace.segments`), swap nothing: full activation checkpointing."""

    name: str = "checkpoint-all"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        return SwapPlan.of(trace, self.name, [], recompute=[s.name for s in trace.segments])


def with_all_recomputed(trace: Trace, plan: SwapPlan, name: str) -> SwapPlan:
    """``plan`` with every block recomputed and the evictions of their members dropped (what is
    left swapped: anchors and tensors outside any block)."""
    rebuilt = {k for s in trace.segments for k in s.members}
    return SwapPlan.of(trace, name, [e for e in plan.evictions if e.tensor not in rebuilt],
                       recompute=[s.name for s in trace.segments])


def hybridize(trace: Trace, budget: int, hardware: Hardware, plan: SwapPlan, *, name: str | None = None,
              deadline: float | None = None) -> SwapPlan:
    """Capuchin's hybrid step over ``plan`` (see the module): one simulation per block, in
    decreasing MSPS, each kept where it lowers the plan's score; stops at ``deadline``."""
    blocks = sorted(trace.segments, key=lambda s: -s.bytes / max(s.forward_s, 1e-12))
    evictions = {e.tensor: e for e in plan.evictions}
    chosen = set(plan.recomputed(trace))
    best = plan_score(simulate(trace, plan, hardware, budget, validate=False), trace)
    for sg in blocks:
        if sg.index in chosen:
            continue
        if deadline is not None and time.perf_counter() > deadline:
            break
        cand = {k: e for k, e in evictions.items() if k not in sg.members}
        score = plan_score(simulate(trace, list(cand.values()), hardware, budget, validate=False,
                                    recompute=sorted(chosen | {sg.index})), trace)
        if score < best - 1e-12 * max(best, 1.0):
            best, evictions = score, cand
            chosen.add(sg.index)
    return SwapPlan.of(trace, name or plan.policy, evictions.values(), recompute=[trace.segments[s].name for s in chosen],
                       **plan.meta)
