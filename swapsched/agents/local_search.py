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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from swapsched.env.simulator import SimResult, analytic_floor, simulate
from swapsched.hardware import Hardware
from swapsched.plan import LEADS, Eviction, SwapPlan, prefetch_event
from swapsched.trace import Trace

__all__ = ["LocalSearch", "improve", "plan_score", "heuristic_plans", "best_plan", "planning_seconds", "draw_case"]

_PREFETCH_SHIFTS = (-16, -8, -4, -2, -1, 1, 2, 4, 8, 16)
_OUT_SHIFTS = (1, 2, 4, 8)


def draw_case(trace: Trace, hardware: Sequence[Hardware], rng: np.random.Generator,
              budget_range: tuple[float, float]) -> tuple[Hardware, int]:
    """A random training case on ``trace``: one of ``hardware``, and a budget at a uniform fraction
    of the activation range above static bytes, never below the smallest feasible budget. The
    searches that teach the move prior and the plan editor draw their cases here."""
    hw = hardware[int(rng.integers(0, len(hardware)))]
    frac = float(rng.uniform(*budget_range))
    budget = max(int(trace.static_bytes + frac * (trace.peak_bytes_no_swap - trace.static_bytes)), trace.min_feasible_bytes)
    return hw, budget


def plan_score(result: SimResult, trace: Trace) -> float:
    """Lower is better: the step time; an OOM is worse than any feasible plan, and a later OOM
    less bad than an earlier one."""
    if result.oom:
        return 1e6 * result.ideal_s * (2.0 - (result.oom_event or 0) / max(trace.n_events, 1)) + 1e6
    return result.iteration_s


def heuristic_plans(trace: Trace, budget: int, hardware: Hardware, deadline: float | None = None) -> list[SwapPlan]:
    """The single-pass heuristics' exact swap plans (no-swap, swap-all, vDNN both ways, min, capuchin's
    swap half).

    With a ``deadline`` (a ``time.perf_counter()`` value), capuchin is left out when it would not
    fit before it: its feedback loop and repair cost about 100 simulations of the step (3.8 s on a
    2,055-tensor GPT, where one simulation takes 30-50 ms), longer than the whole planning time."""
    from swapsched.agents.heuristics import VDNN, Belady, Capuchin, NoSwap, SwapAll

    plans = [h.plan(trace, budget, hardware) for h in (NoSwap(), SwapAll(), VDNN(), VDNN(conv_only=True), Belady())]
    if deadline is not None:
        t0 = time.perf_counter()
        simulate(trace, plans[-1], hardware, budget, validate=False)
        if t0 + 100 * (time.perf_counter() - t0) > deadline:
            return plans
    return [*plans, Capuchin(recompute=False).plan(trace, budget, hardware)]


def best_plan(trace: Trace, budget: int, hardware: Hardware, plans: Sequence[SwapPlan]) -> tuple[SwapPlan, float]:
    """The plan of ``plans`` with the lowest ``plan_score``, and its score (first wins ties)."""
    scored = [(plan_score(simulate(trace, p, hardware, budget, validate=False), trace), i) for i, p in enumerate(plans)]
    s, i = min(scored)
    return plans[i], s


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
        self.h2d = np.array([hardware.h2d_time(int(x)) for x in self.b])
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
            now = "whole" if s in self.recompute else "selective" if s in self.selective else "keep"
            others = [x for x in ("keep", "whole", "selective") if x != now and (x != "selective" or self.trace.segments[s].cheap)]
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
        return so, prefetch_event(self.trace, k, LEADS[lead_index] * float(self.h2d[k]), so)

    def apply(self, m: Move) -> tuple[dict[int, tuple[int, int]], frozenset[int], frozenset[int]]:
        """The plan and the blocks recomputed whole and selectively after ``m``."""
        cand = dict(self.plan)
        if m.kind == "recompute":
            s = m.tensor
            if m.state != "keep":
                for k in self.trace.segments[s].members:  # rebuilt or held, so no longer swapped
                    cand.pop(k, None)
            return (cand, self.recompute - {s} | ({s} if m.state == "whole" else set()),
                    self.selective - {s} | ({s} if m.state == "selective" else set()))
        if m.kind == "drop":
            del cand[m.tensor]
        else:
            if m.removed >= 0:
                del cand[m.removed]
            assert m.placement is not None
            cand[m.tensor] = m.placement
        return cand, self.recompute, self.selective


def _uniform_weights() -> np.ndarray:
    """The unlearned proposal: prefetch shifts 55% (half aimed at stalled tensors), later swap-outs
    10%, drops 10%, adds 15%, replacements 10%."""
    w = np.zeros(len(MOVE_CLASSES))
    n_pre = len(_PREFETCH_SHIFTS)
    for i, (kind, _, _) in enumerate(MOVE_CLASSES):
        w[i] = {"prefetch": 0.55 / (2 * n_pre), "later-out": 0.10 / len(_OUT_SHIFTS), "drop": 0.05,
                "add": 0.15, "replace": 0.10}[kind]
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
           and state.score > target * (1 + 1e-9)):
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
        better = s < state.score - 1e-12 * max(state.score, 1.0)
        if log is not None and c >= 0:
            log.append((c, better))
        if better:
            state.adopt(cand, cand_rc, cand_sel)
    plan = SwapPlan.of(trace, start.policy, [Eviction(k, o, p) for k, (o, p) in state.plan.items()],
                       recompute=[trace.segments[s].name for s in state.recompute],
                       selective=[trace.segments[s].name for s in state.selective], **{**start.meta, "search_evals": evals})
    return plan, state.score, evals


def planning_seconds(trace: Trace) -> float:
    """The default planning time of the searching planners (``default``, ``local-search``), all of
    the planning included: 0.9 s up to 500 saved tensors, growing to 2.7 s at 2,000 (under the
    3 s a 2,000-tensor plan may take, with room for the last simulation's overrun)."""
    return 0.9 + 1.8 * min(max(trace.n_tensors - 500, 0), 1500) / 1500


@dataclass(frozen=True)
class LocalSearch:
    """The best single-pass heuristic's plan, improved by :func:`improve` until ``search_seconds``
    of planning in all (the heuristics included; default :func:`planning_seconds`) are spent."""

    search_seconds: float | None = None
    seed: int = 0
    name: str = "local-search"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        t0 = time.perf_counter()
        total = self.search_seconds if self.search_seconds is not None else planning_seconds(trace)
        start, _ = best_plan(trace, budget, hardware, heuristic_plans(trace, budget, hardware, deadline=t0 + total / 2))
        left = max(total - (time.perf_counter() - t0), 0.0)
        plan, _, _ = improve(trace, budget, hardware, start, seconds=left, seed=self.seed,
                             target=analytic_floor(trace, budget, hardware))  # nothing beats the R8 floor
        return SwapPlan.of(trace, self.name, plan.evictions, start=start.policy, search_evals=plan.meta["search_evals"],
                           seed=self.seed)
