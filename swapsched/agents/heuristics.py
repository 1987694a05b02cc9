"""Heuristic schedulers from the memory-swapping literature, each a policy
``plan(trace, budget, hardware) -> SwapPlan`` (DESIGN.md "Where this sits in the field").

All of them issue a tensor's swap-out at its last forward pack (R7's earliest point that frees it)
and differ in *which* tensors they evict and *when* they prefetch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from swapsched.agents.recompute import hybridize
from swapsched.env.simulator import simulate
from swapsched.hardware import Hardware
from swapsched.plan import LEADS, Eviction, SwapPlan, lead_prefetch, on_demand_plan, swap_out_event
from swapsched.trace import Trace

__all__ = ["NoSwap", "SwapAll", "VDNN", "Belady", "Capuchin", "heuristic_plans", "planned_demand", "rebuilt_at", "needed_at", "min_around_blocks", "repair",
           "HEAVY_OPS"]

#: Ops vDNN-conv treats as layers whose compute can hide a copy of their inputs.
HEAVY_OPS = frozenset({"convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution", "conv2d",
                       "mm", "addmm", "bmm", "matmul", "baddbmm", "linear"})


def rebuilt_at(trace: Trace, recompute: Iterable[int] = (), selective: Iterable[int] = ()) -> dict[int, int]:
    """The tensors a plan's recomputed blocks rebuild (R9: every member of a block recomputed
    whole, the cheap members of one recomputed selectively), each with its block's ``at``."""
    out = {k: sg.at for s in recompute for sg in (trace.segments[s],) for k in sg.members}
    out.update({k: sg.at for s in selective for sg in (trace.segments[s],) for k in sg.cheap})
    return out


def needed_at(trace: Trace, blocks: Iterable[int] = ()) -> np.ndarray:
    """The event each tensor is first needed at in backward: its first unpack, or, for the anchor
    of a recomputed block, the block's ``at`` if earlier (R9: the recompute reads the anchor)."""
    need = trace.first_unpack.copy()
    for s in blocks:
        sg = trace.segments[s]
        need[sg.anchor] = min(int(need[sg.anchor]), sg.at)
    return need


def _held_by_blocks(trace: Trace, blocks: Iterable[int]) -> list[int]:
    """The members of checkpointed blocks, which no plan may also evict (R9: the checkpoint
    rebuilds them, or holds them if selective; only a block's anchor may be swapped)."""
    return [k for s in blocks for k in trace.segments[s].members]


def planned_demand(trace: Trace, evictions: list[Eviction] | tuple[Eviction, ...], hardware: Hardware,
                   rebuilt: Mapping[int, int] | None = None) -> np.ndarray:
    """Device bytes at the end of each gap if the plan ran without stalls (a planning estimate).

    A tensor counts from the gap of its first pack to the gap it is freed in (R2), except, if
    evicted, from the first gap that starts after its swap-out would finish to the gap before its
    prefetch event (the swap-in allocates at that event, R6), and, if ``rebuilt`` (tensor -> its
    block's ``at``, :func:`rebuilt_at`), from the gap after its release to the gap before ``at``
    (R9: dropped, then rebuilt by the recompute).

    ``SwapEnv``'s action mask counts the same occupancy with the swap-out taking no time (its
    ``_DecisionTable.occupy_from``): a bound that never masks a feasible action, where this is an
    estimate for choosing one. Two uses of one rule, kept apart on purpose: merged, either the
    mask would refuse plans that fit or the heuristics would plan as if copies were free.
    """
    n = trace.n_events
    b = trace.tensor_bytes
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, trace.first_pack, b)
    np.add.at(delta, trace.freed + 1, -b)
    starts = trace.event_times - trace.gaps
    for e in evictions:
        rel = _release_gap(trace, starts, e.tensor, e.swap_out_at, hardware)
        if rel < e.prefetch_at:
            delta[rel] -= b[e.tensor]
            delta[e.prefetch_at] += b[e.tensor]
    for k, at in (rebuilt or {}).items():
        if int(trace.release[k]) + 1 < at:
            delta[int(trace.release[k]) + 1] -= b[k]
            delta[at] += b[k]
    return trace.static_bytes + trace.other_bytes + np.cumsum(delta)[:-1]


def _release_gap(trace: Trace, starts: np.ndarray, k: int, so: int, hw: Hardware) -> int:
    """The first gap ``k`` is off the device: its swap-out is complete and the program has
    released it (R2)."""
    done = trace.event_times[so] + hw.d2h_time(int(trace.tensor_bytes[k]))
    return max(so + 1, int(trace.release[k]) + 1, int(np.searchsorted(starts, done, side="left")))


@dataclass(frozen=True)
class NoSwap:
    """Keep every saved tensor on the device. Infeasible below the activation peak (OOM, reported)."""

    name: str = "no-swap"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        return SwapPlan.of(trace, self.name, [])


@dataclass(frozen=True)
class SwapAll:
    """PyTorch's ``torch.autograd.graph.save_on_cpu``: every saved tensor goes to the host when it
    is packed and comes back on demand when it is unpacked; no prefetch."""

    name: str = "swap-all"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        return on_demand_plan(trace, self.name)


@dataclass(frozen=True)
class VDNN:
    """vDNN (Rhu et al., "vDNN: Virtualized Deep Neural Networks for Scalable, Memory-Efficient
    Neural Network Design", MICRO 2016).

    ``vdnn-all`` offloads the feature maps of every layer; ``vdnn-conv`` only the inputs of
    convolution and heavy matmul layers (the tensors those ops save), whose long compute hides the
    copy. During backward of layer *n* it prefetches what layer *n-1* needs. Departures: a "layer" is
    a module path of the trace; the budget is ignored, as in the paper (vDNN's static policies do not
    look at it), so a budget it cannot meet is an OOM in the simulation, not a silent fix.
    """

    conv_only: bool = False

    @property
    def name(self) -> str:
        return "vdnn-conv" if self.conv_only else "vdnn-all"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        fu = trace.first_unpack
        chosen = [k for k in range(trace.n_tensors) if not self.conv_only or trace.tensors[k].op in HEAVY_OPS]
        # layers in backward order, each starting at its first unpack
        layer_start: dict[str, int] = {}
        for k in np.argsort(fu, kind="stable"):
            layer_start.setdefault(trace.tensors[k].module, int(fu[k]))
        starts = sorted(layer_start.values())
        evs = []
        for k in chosen:
            so = swap_out_event(trace, k)
            mine = layer_start[trace.tensors[k].module]
            pos = starts.index(mine)
            pf = starts[pos - 1] if pos > 0 else int(fu[k])  # prefetch during the layer before
            evs.append(Eviction(k, so, min(max(pf, so), int(fu[k]))))
        return SwapPlan.of(trace, self.name, evs)


def _release_gaps(trace: Trace, hw: Hardware) -> np.ndarray:
    """For each tensor, the first gap it is off the device if swapped out at its last forward pack."""
    starts = trace.event_times - trace.gaps
    return np.array([_release_gap(trace, starts, k, swap_out_event(trace, k), hw) for k in range(trace.n_tensors)],
                    dtype=np.int64)


def _removable(trace: Trace, gap: int, evicted: np.ndarray, need: np.ndarray | None = None) -> np.ndarray:
    """Tensors whose eviction can lower the demand of ``gap``: swapped out (at their last forward
    pack) and released by the program (R2) before the gap starts, and not needed until after it.
    If the copy has not finished by then, compute waits for it (R4): a stall, not an OOM."""
    ok = ~evicted & (trace.release < gap) & (gap < (trace.first_unpack if need is None else need))
    return np.flatnonzero(ok)


def _evict_until_fits(trace: Trace, demand: np.ndarray, budget: int, release: np.ndarray, score: np.ndarray,
                      back_at: Callable[[int, int], int], exclude: Iterable[int] = (),
                      need: np.ndarray | None = None) -> list[int]:
    """Walk the gaps over budget in order; at each, evict the removable tensor of highest ``score``
    until the planned demand fits. ``back_at(k, gap)`` is the gap from which ``k`` is planned back
    on the device; ``exclude``: tensors never evicted (a recomputed block's, R9); ``need``: the
    event each tensor is next needed at (default its first unpack, :func:`needed_at`). Updates
    ``demand``; returns the tensors in the order chosen."""
    chosen = np.zeros(trace.n_tensors, dtype=bool)
    chosen[list(exclude)] = True
    order: list[int] = []
    for g in np.flatnonzero(demand > budget):
        while demand[g] > budget:
            cands = _removable(trace, int(g), chosen, need)
            if not cands.size:
                break  # nothing can help this gap: the simulation will report the OOM
            k = int(cands[np.argmax(score[cands])])  # ties: the lowest id
            chosen[k] = True
            order.append(k)
            demand[min(release[k], g) : back_at(k, int(g))] -= trace.tensor_bytes[k]
    return order


def _place_prefetches(trace: Trace, budget: int, hw: Hardware, evicted: list[int], demand: np.ndarray,
                      need: np.ndarray | None = None) -> list[Eviction]:
    """Prefetch each evicted tensor as early as the planned memory allows (nearest use first),
    back by ``need`` (default its first unpack)."""
    fu = trace.first_unpack if need is None else need
    evs = []
    for k in sorted(evicted, key=lambda k: (fu[k], k)):
        so, f = swap_out_event(trace, k), int(fu[k])
        b = int(trace.tensor_bytes[k])
        pf = f
        while pf - 1 > so and demand[pf - 1] + b <= budget:
            pf -= 1
        demand[pf:f] += b
        evs.append(Eviction(k, so, pf))
    return evs


def repair(trace: Trace, plan: SwapPlan, budget: int, hardware: Hardware, rounds: int = 50) -> SwapPlan:
    """Make a planned schedule survive the simulation's timing.

    A plan made on ideal times can prefetch a tensor so early that, once stalls shift compute, it
    holds memory a later production needs: an OOM (R4/R6). Until the simulation is clean, each round
    delays to the OOM event the prefetches that hold memory there (issued before it, needed after
    it); if none does, it evicts one more tensor there by the MIN rule (farthest next use).
    """
    evs = {e.tensor: e for e in plan.evictions}
    chosen = [*plan.recomputed(trace), *plan.recomputed_selectively(trace)]
    held, fu = _held_by_blocks(trace, chosen), needed_at(trace, chosen)
    for _ in range(rounds):
        res = simulate(trace, replace(plan, evictions=tuple(sorted(evs.values()))), hardware, budget, validate=False)
        if not res.oom:
            break
        assert res.oom_event is not None  # an OOM says where
        e = int(res.oom_event)
        early = [k for k, ev in evs.items() if ev.prefetch_at < e < fu[k]]
        if early:
            for k in early:
                evs[k] = Eviction(k, evs[k].swap_out_at, min(e, int(fu[k])))
            continue
        evicted = np.zeros(trace.n_tensors, dtype=bool)
        evicted[list(evs)] = True
        evicted[held] = True  # a checkpointed block's (R9): not a swap's to move
        cands = _removable(trace, e, evicted, fu)
        if not cands.size:
            break  # nothing left to move: the OOM is reported, never hidden
        k = int(cands[np.argmax(fu[cands])])
        evs[k] = Eviction(k, swap_out_event(trace, k), int(fu[k]))
    return replace(plan, evictions=tuple(sorted(evs.values())))


@dataclass(frozen=True)
class Belady:
    """Belady-style MIN (Belady, "A study of replacement algorithms for a virtual-storage computer",
    IBM Systems Journal 1966), as swap schedulers use it: when the next production would not fit
    the budget, evict the resident tensor whose next use is farthest; prefetch each as early as
    memory allows. Departures: the swap-out is issued at the tensor's last forward use rather than
    at the moment of need, because a copy is not instantaneous; and the plan is then checked on the
    simulator and repaired (:func:`repair`) where stalls made an early prefetch crowd out a production."""

    name: str = "min"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        return min_around_blocks(trace, budget, hardware, name=self.name)


def min_around_blocks(trace: Trace, budget: int, hardware: Hardware, *, recompute: Iterable[int] = (),
                      selective: Iterable[int] = (), name: str = "min") -> SwapPlan:
    """Belady's MIN for what the given blocks (indices into ``trace.segments``) leave: they are
    recomputed, whole or selectively (R9), their rebuilt members off the device from their release
    to the recompute and never swapped; the rest is swapped by the MIN rule until the planned
    demand fits, then repaired on the simulator (with the recomputes, which cost compute there)."""
    recompute, selective = sorted(set(recompute)), sorted(set(selective) - set(recompute))
    blocks = [*recompute, *selective]
    fu = needed_at(trace, blocks)
    demand = planned_demand(trace, [], hardware, rebuilt_at(trace, recompute, selective))
    # farthest next use first; back on the device only when used (prefetches are placed next)
    evicted = _evict_until_fits(trace, demand, budget, _release_gaps(trace, hardware), fu, lambda k, g: int(fu[k]),
                                exclude=_held_by_blocks(trace, blocks), need=fu)
    plan = SwapPlan.of(trace, name, _place_prefetches(trace, budget, hardware, evicted, demand, fu),
                       recompute=[trace.segments[s].name for s in recompute],
                       selective=[trace.segments[s].name for s in selective])
    return repair(trace, plan, budget, hardware)


@dataclass(frozen=True)
class Capuchin:
    """Capuchin (Peng et al., "Capuchin: Tensor-based GPU Memory Management for Deep Learning",
    ASPLOS 2020): its swap half, then (``recompute=True``, the default) its hybrid choice between
    swapping and recomputing (:func:`~swapsched.agents.recompute.hybridize`, R9).

    From the measured step, rank tensors by free time (time between the use before eviction and the
    reuse, less the round-trip copy), evict the best until the budget holds, and place each prefetch
    to finish just before its use; then its feedback loop: simulate, and move the prefetch of each
    tensor whose reuse stalled one lead class earlier, for up to ``rounds`` rounds, keeping the best.
    Departures: the feedback runs on the simulator rather than on a second real iteration, and the
    swap half ends with :func:`repair`; recompute is per block (``torch.utils.checkpoint``'s unit),
    not per tensor. ``recompute=False`` (``capuchin-swap``) is the swap half alone.
    """

    rounds: int = 6
    recompute: bool = True
    name: str = "capuchin"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        times = trace.event_times
        fu = trace.first_unpack
        b = trace.tensor_bytes
        lfp = trace.last_forward_pack
        free_time = (times[fu] - times[lfp]
                     - 2 * hardware.copy_latency_s - b / hardware.link_bytes_per_s("d2h") - b / hardware.link_bytes_per_s("h2d"))
        demand = planned_demand(trace, [], hardware)
        planned_pf: dict[int, int] = {}

        def just_in_time(k: int, g: int) -> int:  # lands one transfer before the reuse, after gap g
            planned_pf[k] = self._eviction(trace, k, 1, hardware, after=g).prefetch_at
            return planned_pf[k]

        chosen = _evict_until_fits(trace, demand, budget, _release_gaps(trace, hardware), free_time, just_in_time)
        lead_idx = {k: 1 for k in chosen}
        if not lead_idx:
            return self._hybrid(trace, budget, hardware, SwapPlan.of(trace, self.name, []))
        guard = {k: self._first_needed_gap(trace, k, planned_pf[k], demand, budget) for k in lead_idx}
        best_plan, best_t = None, math.inf
        for _ in range(self.rounds + 1):
            evs = [self._eviction(trace, k, li, hardware, after=guard[k]) for k, li in lead_idx.items()]
            plan = SwapPlan.of(trace, self.name, evs)
            res = simulate(trace, plan, hardware, budget, record=True, validate=False)
            if best_plan is None or res.iteration_s < best_t:
                best_plan, best_t = plan, res.iteration_s
            stalled = {ev for _, _, ev in res.timeline.stalls} if res.timeline else set()
            moved = False
            for k in lead_idx:
                if int(fu[k]) in stalled and lead_idx[k] < len(LEADS) - 1:
                    lead_idx[k] += 1
                    moved = True
            if res.oom or not moved:
                break
        assert best_plan is not None
        return self._hybrid(trace, budget, hardware, repair(trace, best_plan, budget, hardware))

    def _hybrid(self, trace: Trace, budget: int, hardware: Hardware, swap_plan: SwapPlan) -> SwapPlan:
        if not (self.recompute and trace.segments):
            return swap_plan

        return hybridize(trace, budget, hardware, swap_plan)

    @staticmethod
    def _first_needed_gap(trace: Trace, k: int, pf: int, demand: np.ndarray, budget: int) -> int:
        """The last gap before its reuse where bringing ``k`` back would break the planned budget:
        its prefetch must come after it. (``demand`` already holds ``k`` from gap ``pf`` on.)"""
        g = int(trace.first_unpack[k]) - 1
        bk = int(trace.tensor_bytes[k])
        while g > swap_out_event(trace, k) and demand[g] + (bk if g < pf else 0) <= budget:
            g -= 1
        return g

    @staticmethod
    def _eviction(trace: Trace, k: int, lead_index: int, hw: Hardware, after: int) -> Eviction:
        so = swap_out_event(trace, k)
        pf = lead_prefetch(trace, k, lead_index, hw, so)
        f = int(trace.first_unpack[k])
        return Eviction(k, so, min(max(pf, after + 1 if after >= so else so), f))


def heuristic_plans(trace: Trace, budget: int, hardware: Hardware, deadline: float | None = None) -> list[SwapPlan]:
    """The single-pass heuristics' exact swap plans (no-swap, swap-all, vDNN both ways, min, capuchin's
    swap half).

    With a ``deadline`` (a ``time.perf_counter()`` value), capuchin is left out when it would not
    fit before it: its feedback loop and repair cost about 100 simulations of the step (3.8 s on a
    2,055-tensor GPT, where one simulation takes 30-50 ms), longer than the whole planning time."""
    plans = [h.plan(trace, budget, hardware) for h in (NoSwap(), SwapAll(), VDNN(), VDNN(conv_only=True), Belady())]
    if deadline is not None:
        t0 = time.perf_counter()
        simulate(trace, plans[-1], hardware, budget, validate=False)
        if t0 + 100 * (time.perf_counter() - t0) > deadline:
            return plans
    return [*plans, Capuchin(recompute=False).plan(trace, budget, hardware)]
