"""Local search over exact plans, scored on the simulator: the bar every learned planner must clear.

Start from the best of a set of plans (by default the single-pass heuristics' own plans, exact,
not rounded to lead classes), then hill-climb with small moves, each scored by simulating the whole
step (R1-R8, so every accepted plan is one the simulator, and hence the runtime, can execute):

- move one prefetch earlier or later by 1-16 events (within R7's window ``[swap-out, first unpack]``);
- issue one swap-out later by 1-8 events (it still frees the tensor, R7, and may stop it crowding
  the link while something more urgent copies);
- drop one eviction; add one (out at its last forward pack, prefetch one of the lead classes ahead);
- replace one eviction by one of a kept tensor of the nearest size;
- with ``recompute=True``, also put a block in another of its states: kept, recomputed whole, or
  selectively (its members' evictions go, R9).

Moves are drawn at random, half of them aimed at the tensors whose unpack stalled in the current
best plan (read from the simulator's recorded timeline). A move is kept when it lowers the step
time (or, while the plan is an OOM, moves the OOM later); the search stops at its time limit.
Deterministic for a seed and a number of evaluations; the time limit makes it depend on the
machine's speed, and the plan's ``meta`` says how many plans it scored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from swapsched.agents.heuristics import heuristic_plans
from swapsched.agents.scoring import best_plan, improves, plan_score, reaches
from swapsched.env.simulator import simulate
from swapsched.hardware import Hardware
from swapsched.plan import LEADS, BlockState, Eviction, SwapPlan, lead_prefetch
from swapsched.trace import Trace

__all__ = ["improve", "improve_best_heuristic", "MOVE_CLASSES", "UNIFORM", "UNIFORM_SHARES", "RECOMPUTE_SHARE", "Move"]

_PREFETCH_SHIFTS = (-16, -8, -4, -2, -1, 1, 2, 4, 8, 16)
_OUT_SHIFTS = (1, 2, 4, 8)


#: Classes of moves the proposal draws from: (kind, shift in events, aimed at a tensor whose unpack
#: stalled). A learned prior (``agents/guide.py``) weights them; without one they are drawn as
#: ``_UNIFORM`` weights them.
MOVE_CLASSES: tuple[tuple[str, int, bool], ...] = (
    *(("prefetch", d, st) for d in _PREFETCH_SHIFTS for st in (False, True)),
    *(("later-out", d, False) for d in _OUT_SHIFTS),
    ("drop", 0, False), ("drop", 0, True), ("add", 0, False), ("replace", 0, False),
)


@dataclass(frozen=True)
class Move:
    """One change to a plan: ``kind`` (the first field of ``MOVE_CLASSES``, or ``recompute``), the
    tensor it acts on (a block for ``recompute``), its new placement (``None`` for a drop), the
    tensor it replaces (``replace`` only) and the block's new state (``recompute`` only: ``keep``,
    ``whole`` or ``selective``)."""

    kind: str
    tensor: int
    placement: tuple[int, int] | None
    removed: int = -1
    state: str = ""


class _SearchState:
    """The current plan, its simulated score and the evicted tensors whose unpack stalled in it."""

    def __init__(self, trace: Trace, budget: int, hardware: Hardware, plan: dict[int, tuple[int, int]],
                 recompute: frozenset[int] = frozenset(), joint: bool = False, selective: frozenset[int] = frozenset()):
        self.trace, self.budget, self.hw = trace, budget, hardware
        self.joint = joint and bool(trace.segments)
        self.fu, self.lfp, self.b = trace.first_unpack, trace.last_forward_pack, trace.tensor_bytes
        self.by_size = np.argsort(self.b, kind="stable")
        self.rank = np.empty(trace.n_tensors, dtype=np.int64)
        self.rank[self.by_size] = np.arange(trace.n_tensors)
        self.adopt(plan, recompute, selective)

    def adopt(self, plan: dict[int, tuple[int, int]], recompute: frozenset[int] = frozenset(),
              selective: frozenset[int] = frozenset()) -> None:
        self.plan, self.recompute, self.selective = plan, recompute, selective
        # members of recomputed blocks are rebuilt (or, selectively, held), never evicted (R9)
        self.rebuilt = {k for s in recompute | selective for k in self.trace.segments[s].members}
        evs = [Eviction(k, o, p) for k, (o, p) in plan.items()]
        self.result = simulate(self.trace, evs, self.hw, self.budget, record=True, validate=False, recompute=sorted(recompute),
                               selective=sorted(selective))
        self.score = plan_score(self.result, self.trace)
        stalled = {int(ev) for _, _, ev in (self.result.timeline.stalls if self.result.timeline else ())}
        self.hot = [k for k in plan if int(self.fu[k]) in stalled]  # evicted tensors whose unpack stalled

    def propose(self, rng: np.random.Generator, weights: np.ndarray) -> tuple[int, Move | None]:
        """A move of a class drawn by ``weights`` (over ``MOVE_CLASSES``), or None where the class
        has no move here; the class index either way. In a joint search a share of the moves
        toggles a block's recompute instead (class -1: outside the classes a prior weights)."""
        if self.joint and rng.random() < RECOMPUTE_SHARE:
            s = int(rng.integers(0, len(self.trace.segments)))
            now = BlockState.WHOLE if s in self.recompute else BlockState.SELECTIVE if s in self.selective else BlockState.KEPT
            others = [x for x in BlockState if x != now and (x != BlockState.SELECTIVE or self.trace.segments[s].cheap)]
            return -1, Move("recompute", s, None, state=others[int(rng.integers(0, len(others)))])
        c = int(rng.choice(len(MOVE_CLASSES), p=weights))
        kind, d, aimed = MOVE_CLASSES[c]
        cur, fu = self.plan, self.fu
        evicted = list(cur)
        pool = self.hot if aimed else evicted
        if kind in ("prefetch", "later-out", "drop") and not pool:
            return c, None
        if kind == "prefetch":
            k = int(rng.choice(pool))
            o, p = cur[k]
            p2 = int(np.clip(p + d, o, fu[k]))
            return c, (Move("prefetch", k, (o, p2)) if p2 != p else None)
        if kind == "later-out":
            k = int(rng.choice(pool))
            o, p = cur[k]
            o2 = min(o + d, p, int(fu[k]) - 1)
            return c, (Move("later-out", k, (o2, p)) if o2 > o else None)
        if kind == "drop":
            return c, Move("drop", int(rng.choice(pool)), None)
        return c, self._propose_new(rng, kind)

    def _propose_new(self, rng: np.random.Generator, kind: str) -> Move | None:
        n, cur = self.trace.n_tensors, self.plan
        evicted = list(cur)
        if kind == "add" and len(cur) < n:
            kept = [k for k in range(n) if k not in cur and k not in self.rebuilt]
            if not kept:
                return None
            k = int(rng.choice(kept))
            return Move("add", k, self._fresh(k, int(rng.integers(0, len(LEADS)))))
        if kind == "replace" and evicted and len(cur) < n:
            k = int(rng.choice(evicted))
            rk = int(self.rank[k])
            near = [int(self.by_size[j]) for j in range(max(rk - 3, 0), min(rk + 4, n))
                    if int(self.by_size[j]) not in cur and int(self.by_size[j]) not in self.rebuilt]
            if not near:
                return None
            j = near[int(rng.integers(0, len(near)))]
            return Move("replace", j, self._fresh(j, int(rng.integers(0, len(LEADS)))), removed=k)
        return None

    def _fresh(self, k: int, lead_index: int) -> tuple[int, int]:
        so = int(self.lfp[k])
        return so, lead_prefetch(self.trace, k, lead_index, self.hw, so)

    def apply(self, m: Move) -> tuple[dict[int, tuple[int, int]], frozenset[int], frozenset[int]]:
        """The plan and the blocks recomputed whole and selectively after ``m``."""
        cand = dict(self.plan)
        if m.kind == "recompute":
            s = m.tensor
            if m.state != BlockState.KEPT:
                for k in self.trace.segments[s].members:  # rebuilt or held, so no longer swapped
                    cand.pop(k, None)
            return (cand, self.recompute - {s} | ({s} if m.state == BlockState.WHOLE else set()),
                    self.selective - {s} | ({s} if m.state == BlockState.SELECTIVE else set()))
        if m.kind == "drop":
            del cand[m.tensor]
        else:
            if m.removed >= 0:
                del cand[m.removed]
            assert m.placement is not None
            cand[m.tensor] = m.placement
        return cand, self.recompute, self.selective


#: The unlearned proposal, each kind's share of the moves (spread evenly over its classes): prefetch
#: shifts most (half of them aimed at stalled tensors: a stall is what a step loses), then adds,
#: drops, replacements and later swap-outs. Set by hand when the search was built; the learned
#: prior (agents/guide.py) replaces it in ``default``
UNIFORM_SHARES = {"prefetch": 0.55, "later-out": 0.10, "drop": 0.10, "add": 0.15, "replace": 0.10}


def _uniform_weights() -> np.ndarray:
    count = {kind: sum(1 for k, _, _ in MOVE_CLASSES if k == kind) for kind in UNIFORM_SHARES}
    w = np.array([UNIFORM_SHARES[kind] / count[kind] for kind, _, _ in MOVE_CLASSES])
    return w / w.sum()


UNIFORM = _uniform_weights()
#: In a joint search, the share of moves that toggle a block's recompute (R9).
RECOMPUTE_SHARE = 0.15


def improve(trace: Trace, budget: int, hardware: Hardware, start: SwapPlan, *, seconds: float,
            seed: int = 0, max_evals: int | None = None, target: float = 0.0, prior: Any = None,
            log: list | None = None, recompute: bool = False) -> tuple[SwapPlan, float, int]:
    """Hill-climb from ``start`` for ``seconds`` (or ``max_evals`` scored plans, or until the step
    time reaches ``target``, a proven lower bound); returns the best plan (named as ``start``), its
    score and the number of plans scored.

    Each step draws a move class from ``prior.weights`` (a learned proposal,
    :class:`~swapsched.agents.guide.MovePrior`) or from ``UNIFORM``, a concrete move of that class at
    random, simulates it and keeps it if the step gets faster. ``log`` collects
    ``(class index, improved)`` for every simulated move: a prior's training data. ``recompute``:
    search keep / swap / recompute jointly (start's recomputed blocks are kept as its start)."""
    rng = np.random.default_rng(seed)
    weights = UNIFORM if prior is None else prior.weights
    deadline = time.perf_counter() + seconds
    state = _SearchState(trace, budget, hardware, {e.tensor: (e.swap_out_at, e.prefetch_at) for e in start.evictions},
                         frozenset(start.recomputed(trace)), joint=recompute,
                         selective=frozenset(start.recomputed_selectively(trace)))
    evals = 1
    eval_s, sims = 0.0, 0  # mean seconds per simulation: the search stops when the next would overrun
    while (time.perf_counter() + eval_s < deadline and (max_evals is None or evals < max_evals)
           and not reaches(state.score, target)):
        c, m = state.propose(rng, weights)
        if m is None:
            continue
        cand, cand_rc, cand_sel = state.apply(m)
        t_sim = time.perf_counter()
        r2 = simulate(trace, [Eviction(k, o, p) for k, (o, p) in cand.items()], hardware, budget, validate=False,
                      recompute=sorted(cand_rc), selective=sorted(cand_sel))
        sims += 1
        eval_s += (time.perf_counter() - t_sim - eval_s) / sims
        evals += 1
        s = plan_score(r2, trace)
        better = improves(s, state.score)
        if log is not None and c >= 0:
            log.append((c, better))
        if better:
            state.adopt(cand, cand_rc, cand_sel)
    plan = SwapPlan.of(trace, start.policy, [Eviction(k, o, p) for k, (o, p) in state.plan.items()],
                       recompute=[trace.segments[s].name for s in state.recompute],
                       selective=[trace.segments[s].name for s in state.selective], **{**start.meta, "search_evals": evals})
    return plan, state.score, evals


def improve_best_heuristic(trace: Trace, budget: int, hardware: Hardware, *, seconds: float, seed: int,
                           **options: Any) -> tuple[SwapPlan, SwapPlan]:
    """The best single-pass heuristic's plan and what :func:`improve` made of it in ``seconds``
    (``options`` go to it): one teaching case of the move prior and the plan editor."""
    start, _ = best_plan(trace, budget, hardware, heuristic_plans(trace, budget, hardware))
    better, _, _ = improve(trace, budget, hardware, start, seconds=seconds, seed=seed, **options)
    return start, better
