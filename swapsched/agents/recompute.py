"""Recompute as a policy decision (R9): activation checkpointing of every block, and the hybrid step
that turns a swap plan into a keep / swap / recompute plan.

- :class:`CheckpointAll` (``checkpoint-all``) is what users pick on PCIe GPUs today:
  ``torch.utils.checkpoint`` around every block, nothing swapped.
- :class:`CheckpointSelective` (``checkpoint-selective``) is PyTorch's selective activation
  checkpointing with the usual policy (torchtitan's, Megatron's in spirit; Korthikanti et al.,
  MLSys 2023): every block checkpointed, the outputs of matmuls, convolutions and attention saved
  (:data:`~swapsched.trace.SELECTIVE_SAVE_OPS`), the cheap pointwise and normalization ops
  recomputed.
- :func:`hybridize` is Capuchin's hybrid choice (Peng et al., ASPLOS 2020, section 4.3): rank the
  recomputable blocks by memory saved per second of recompute (its MSPS), and recompute each in
  turn instead of keeping or swapping its tensors where that makes the (simulated) step faster. Capuchin
  measures the candidate on the next real iteration; here the simulator stands in for it, as it
  does for Capuchin's swap feedback (``agents/heuristics.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from swapsched.agents.scoring import TINY_S, improves, plan_score
from swapsched.env.simulator import simulate
from swapsched.hardware import Hardware
from swapsched.plan import BlockState, SwapPlan, lead_eviction
from swapsched.segments import Segment, segment_of
from swapsched.trace import Trace

__all__ = ["CheckpointAll", "CheckpointSelective", "CheckpointOffload", "hybridize", "with_all_recomputed", "by_msps"]


def by_msps(segments: Sequence[Segment], way: str = BlockState.WHOLE) -> list[Segment]:
    """The blocks by bytes freed per second of recompute, the most first (Capuchin's MSPS, Peng et
    al. 2020, section 4.3), ties in block order: for ``WHOLE`` of the whole block, otherwise of
    what the way rebuilds (the cheap members where there are any; for ``SELECTIVE`` a block without
    them frees nothing and comes last; ``"mixed"`` ranks such a block whole)."""
    def msps(s: Segment) -> float:
        if way == BlockState.WHOLE or not s.cheap:
            return (0.0 if way == BlockState.SELECTIVE else s.bytes) / max(s.forward_s, TINY_S)
        return s.cheap_bytes / max(s.cheap_forward_s, TINY_S)
    return sorted(segments, key=lambda s: (-msps(s), s.index))


@dataclass(frozen=True)
class CheckpointAll:
    """Recompute every block (:attr:`Trace.segments`), swap nothing: full activation checkpointing."""

    name: str = "checkpoint-all"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        return SwapPlan.of(trace, self.name, [], recompute=[s.name for s in trace.segments])


@dataclass(frozen=True)
class CheckpointSelective:
    """Checkpoint every block selectively (R9, selective), swap nothing. A block whose members are
    all saved ops has nothing to rebuild and is left as it is, as the policy leaves it in training."""

    name: str = "checkpoint-selective"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        return with_all_recomputed(trace, SwapPlan.of(trace, self.name, []), self.name, selective=True)


def with_all_recomputed(trace: Trace, plan: SwapPlan, name: str, *, selective: bool = False) -> SwapPlan:
    """``plan`` with every block recomputed (``selective``: every block with cheap members,
    selectively) and the evictions of their members dropped (what is left swapped: anchors and
    tensors outside those blocks)."""
    blocks = [s for s in trace.segments if s.cheap or not selective]
    rebuilt = {k for s in blocks for k in s.members}
    names = [s.name for s in blocks]
    return SwapPlan.of(trace, name, [e for e in plan.evictions if e.tensor not in rebuilt],
                       recompute=[] if selective else names, selective=names if selective else [])


def hybridize(trace: Trace, budget: int, hardware: Hardware, plan: SwapPlan, *, name: str | None = None,
              deadline: float | None = None) -> SwapPlan:
    """Capuchin's hybrid step over ``plan`` (see the module): blocks in decreasing MSPS, each kept
    recomputed where it lowers the plan's score; stops at ``deadline``. The plan's blocks already
    recomputed stay so, whole or selectively; a block recomputed selectively is not a candidate
    for whole recompute (the plan chose it: its saved matmuls are what make it cheap).

    First the best prefix of that order (how many of the top blocks to recompute: the quarters,
    then a ternary search around the best, so a 128-block model gets a good hybrid inside a
    planning time that one simulation per block would overrun), then one block at a time over
    the rest."""
    evictions = {e.tensor: e for e in plan.evictions}
    chosen = set(plan.recomputed(trace))
    selective = sorted(plan.recomputed_selectively(trace))
    order = [s for s in by_msps(trace.segments) if s.index not in chosen and s.index not in selective]
    scores: dict[int, float] = {}

    def with_prefix(k: int) -> tuple[dict, set[int]]:
        rebuilt = {m for sg in order[:k] for m in sg.members}
        return {t: e for t, e in evictions.items() if t not in rebuilt}, chosen | {sg.index for sg in order[:k]}

    def simulated(evs: dict, blocks: set[int]) -> float:
        return plan_score(simulate(trace, list(evs.values()), hardware, budget, validate=False, recompute=sorted(blocks),
                                   selective=selective), trace)

    def score(k: int) -> float:
        if k not in scores:
            scores[k] = simulated(*with_prefix(k))
        return scores[k]

    def late() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    n = len(order)
    # coarse first (quarters of the order, four simulations), then a ternary search between the
    # neighbours of the best quarter while time is left
    grid = sorted({0, *(round(n * f) for f in (0.25, 0.5, 0.75, 1.0))})
    for k in grid:
        if late() and scores:
            break
        score(k)
    at = min(scores, key=lambda k: scores[k])
    lo, hi = max(g for g in grid if g <= max(at - 1, 0)), min(g for g in grid if g >= min(at + 1, n))
    while hi - lo > 2 and not late():
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if score(m1) <= score(m2):
            hi = m2
        else:
            lo = m1
    best_k = min((k for k in range(lo, hi + 1) if k in scores or not late()), key=score, default=0)
    evictions, chosen = with_prefix(best_k)
    best = score(best_k)
    for sg in order[best_k:]:
        if late():
            break
        cand = {k: e for k, e in evictions.items() if k not in sg.members}
        s = simulated(cand, chosen | {sg.index})
        if improves(s, best):
            best, evictions = s, cand
            chosen = chosen | {sg.index}
    return SwapPlan.of(trace, name or plan.policy, evictions.values(), recompute=[trace.segments[s].name for s in chosen],
                       selective=[trace.segments[s].name for s in selective], **plan.meta)


@dataclass(frozen=True)
class CheckpointOffload:
    """Every block checkpointed with its input offloaded to the host: the long-context trainers'
    pattern (axolotl's offloaded ``hidden_states``, ALST). On a trace with blocks: every block
    recomputed (R9) and each block's anchor (its input, which the checkpoint keeps) evicted with
    a prefetch one transfer ahead. On a trace whose blocks already run under checkpoint (R9's
    second stage in the runtime, no segments left): every tensor saved inside a block (the
    checkpoints' inputs) evicted the same way."""

    name: str = "checkpoint-offload"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        if trace.segments:
            anchors = sorted({s.anchor for s in trace.segments})
            return SwapPlan.of(trace, self.name, [lead_eviction(trace, k, 1, hardware) for k in anchors],
                               recompute=[s.name for s in trace.segments])
        inside = [t.id for t in trace.tensors if segment_of(t.module) is not None]
        return SwapPlan.of(trace, self.name, [lead_eviction(trace, k, 1, hardware) for k in inside])
