"""Planning the whole training state under one budget (R13-R16): where each state group lives
and steps, jointly with the activations' plan; the peers users run for it; and the floor.

- :func:`activation_view`: the trace an activation planner plans on once the state is placed:
  the state's static part in ``static_bytes``, what it holds gap by gap (parameters fetched for
  their uses, gradients until they are copied out, and, asked for, room for the largest
  streamed group's stream-in once the first streamed gradient is done) in the gaps' non-saved
  bytes (R3), and no state of its own. Every activation planner plans on it unchanged.
- :func:`plan_state`: ``default``'s search (none where the state kept is within ``FLOOR_SLACK``
  of :func:`state_floor`: no placement can gain more). Candidates place the largest groups first in one
  placement or two (every placement at eight shares of the groups, and the two-level mixes
  ``stream`` + ``param``, ``host-step`` + ``full``, ``stream`` + ``stream-full``,
  ``stream-full`` + ``full``); each (a placement that streams: also keeping room for a
  stream-in, and planned for 3/4 of the budget, ``STREAM_VARIANTS``) is ranked by its plan with
  every block checkpointed on its view, scored on the simulator with the state
  (:mod:`env.state_exec`), a millisecond each; the ``SCREENED`` best are planned by a fast
  activation planner too and score the better of the two. The best is planned again by the full
  activation planner (on a sharded trace, R18, with the share of its last units kept unsharded
  after forward that steps fastest), and the best of those plans and the peers' own is the plan:
  ``default`` fits wherever a peer does and is never slower than one.
- :class:`StatePeer`: ZeRO-Offload, FSDP2's ``CPUOffloadPolicy`` and torchao's
  ``CPUOffloadOptimizer``, each a fixed rule over every group, with the activation plan their
  users run (every block checkpointed); for sharded steps (R18) FSDP2 without offload and
  DeepSpeed ZeRO-3 offload, and :class:`PartialOffloadPeer`, #188120's fractional offload.
- :func:`state_floor`: a lower bound on any plan's step with the state movable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from swapsched.agents.recompute import CheckpointAll
from swapsched.budget import BudgetError, format_bytes
from swapsched.env.collectives import unsharded_deltas
from swapsched.env.floors import joint_floor
from swapsched.env.result import SimResult
from swapsched.env.simulator import simulate
from swapsched.env.state_parts import (
    born_gradients_held,
    disk_parts,
    fetch_events,
    optimizer_rates,
    part_bytes,
    state_split,
    stream_in_bytes,
)
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.policy import Policy
from swapsched.state import DISK_PLACEMENTS, allowed_disk_tiers, allowed_placements, frozen_placement
from swapsched.trace import Event, Trace

__all__ = ["activation_view", "plan_state", "smallest_state_budget", "StatePeer", "PartialOffloadPeer", "PEERS", "state_floor",
           "candidate_placements", "UNSHARDED_SHARES", "spill_to_disk"]

#: Shares of the groups (largest first) a one-placement candidate moves
SHARES = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8, 1.0)
#: How many screened candidates the full activation planner plans again (each a search of its own)
FINALISTS = 1
#: A placement that streams is screened with its activations planned three ways (room kept for
#: that many stream-ins, a share of the budget): the activations a budget leaves room for can
#: starve the stream-ins (R6), so a plan made for less room, or keeping room, may step faster
STREAM_VARIANTS = ((0, 1.0), (1, 1.0), (1, 0.75))


def activation_view(trace: Trace, placement: dict[str, str], stream_room: int = 0,
                    unsharded: frozenset[str] = frozenset()) -> Trace:
    """``trace`` as an activation planner sees it with its state placed (module docstring);
    ``stream_room``: how many streamed groups' stream-ins it keeps room for (the largest);
    ``unsharded``: a sharded trace's units kept unsharded after forward (R18: the unsharded
    parameters and gradients it holds count too)."""
    groups = trace.state
    where = [placement.get(g.name, "device") for g in groups]
    born = trace.state_gradients_born
    static, _ = state_split(groups, placement, born=born)
    n = trace.n_events
    extra = unsharded_deltas(trace, set(unsharded))
    fwd, bwd = fetch_events(groups, where, min(trace.backward_start, n))
    for j, g in enumerate(groups):
        w = where[j]
        if w == "param":  # on the device through its forward use, and again from its backward fetch
            extra[0] += g.param_bytes
            extra[g.forward_end + 1] -= g.param_bytes
            extra[bwd[j]] += g.param_bytes
        elif w in ("full", "stream-full"):
            extra[fwd[j]] += g.param_bytes
            extra[g.forward_end + 1] -= g.param_bytes
            extra[bwd[j]] += g.param_bytes
            extra[max(g.grad_at, bwd[j])] -= g.param_bytes
        if w in ("host-step", "full", "stream-full"):  # made on the device in backward, copied out as it completes
            start = min(g.backward_at + 1, n)
            extra[start] += g.grad_bytes
            extra[max(g.grad_at, start)] -= g.grad_bytes
    # streamed groups come in for their device step once their gradients are done (R15): room
    # kept for them from the first such gradient on, else the activations kept there may starve
    # the stream-ins of room (R6: they wait for it); too much room, and the activations swap more
    streamed = [j for j, w in enumerate(where) if w in ("stream", "stream-full")]
    if streamed and stream_room:
        sizes = sorted((stream_in_bytes(groups[j], where[j]) for j in streamed), reverse=True)
        extra[min(min(groups[j].grad_at for j in streamed), n)] += sum(sizes[:stream_room])
    held = np.cumsum(extra)[:n]
    if born:  # R3: made in backward, held to the step's end
        held += born_gradients_held(groups, where, n)[:n]
    events = tuple(Event(e.kind, e.tensor, e.compute_s, e.flops, int((e.other_bytes or 0) + h) if (e.other_bytes or h) else None)
                   for e, h in zip(trace.events, held.tolist(), strict=True))
    out = replace(trace, static_bytes=int(trace.fixed_bytes + static), events=events, state=(), world_size=1)
    out.__dict__["segments"] = trace.segments  # the same blocks (a restriction the trace carries is kept)
    return out


def candidate_placements(trace: Trace, fine: bool = False) -> list[dict[str, str]]:
    """The placements ``default`` screens (module docstring), all on the device first; those
    the trace allows (R18: a live sharded step's ``allowed_placements``). ``fine``: each share's
    neighbours too (one group more, one fewer): where the host's budget binds (R11, R19), the
    device's and the host's room leave a narrow band of shares that fit both."""
    groups = trace.state
    order = sorted(range(len(groups)), key=lambda j: (-groups[j].bytes, j))
    counts = sorted({max(1, round(len(groups) * f)) for f in SHARES})
    if fine:
        counts = sorted({c + d for c in counts for d in (-1, 0, 1) if 1 <= c + d <= len(groups)})
    out: list[dict[str, str]] = [{}]
    for kind in ("stream", "param", "host-step", "full", "stream-full"):
        out += [{groups[j].name: kind for j in order[:k]} for k in counts]
    for base, top in (("stream", "param"), ("host-step", "full"), ("stream", "stream-full"), ("stream-full", "full")):
        for k in counts[:-1]:
            mix = {g.name: base for g in groups}
            mix.update({groups[j].name: top for j in order[:k]})
            out.append(mix)
    allowed = set(allowed_placements(trace.meta))
    frozen = {g.name for g in groups if g.frozen}
    seen: set[tuple[tuple[str, str], ...]] = set()
    kept = []
    for c in out:
        # a frozen group (R13: no gradient, no step) rests on the host or stays on the device
        c = {g: w for g, w in ((g, frozen_placement(w) if g in frozen else w) for g, w in c.items()) if w != "device"}
        key = tuple(sorted(c.items()))
        if set(c.values()) <= allowed and key not in seen:
            seen.add(key)
            kept.append(c)
    return kept


def spill_to_disk(trace: Trace, placement: dict[str, str], hardware: Hardware, leave: int = 0) -> dict[str, str]:
    """R19: the groups of ``placement`` whose host parts rest on the disk, and their tiers: none
    where the host budget holds the state (the disk is slower than the host); else the fewest
    groups, the largest first, with their optimizer state there, then, as far as that is not
    enough, their parameters' masters too, until the host (staging included) holds the rest.
    All of them where even that is not enough (the simulator keeps on the device what the host
    still cannot hold, R11). Only the tiers the trace allows (``allowed_disk_tiers``). ``leave``:
    host bytes to leave the swapped activations (R11: they share the host budget)."""
    if not hardware.has_disk or hardware.host_budget_bytes is None:
        return {}
    host = hardware.host_budget_bytes - leave
    if state_split(trace.state, placement)[1] <= host:
        return {}
    movable = [g for g in trace.state if placement.get(g.name, "device") in DISK_PLACEMENTS]
    disk: dict[str, str] = {}
    for tier in allowed_disk_tiers(trace.meta):
        order = sorted(movable, key=lambda g: (-part_bytes(g, disk_parts(placement[g.name], tier)), g.forward_at))
        for g in order:
            if state_split(trace.state, placement, disk)[1] <= host:
                return disk
            if g.frozen and tier != "state" or not disk_parts(placement[g.name], tier):
                continue
            disk[g.name] = tier
    return disk


def _with_state(trace: Trace, act: SwapPlan, placement: dict[str, str], name: str, hardware: Hardware | None = None,
                leave: int = 0, **options: Any) -> SwapPlan:
    """``act`` with ``placement`` of the state; on ``hardware`` with a disk, what the host budget
    cannot hold on the disk, leaving ``leave`` bytes of it (R19, :func:`spill_to_disk`)."""
    disk = {} if hardware is None else spill_to_disk(trace, placement, hardware, leave)
    return SwapPlan.of(trace, name, act.evictions, recompute=act.recompute, selective=act.selective, state=placement,
                       disk=disk, **options, **act.meta)


def _placed(trace: Trace, act: SwapPlan, placement: dict[str, str], name: str, hardware: Hardware, budget: int,
            **options: Any) -> tuple[SwapPlan, SimResult]:
    """``act`` with ``placement`` (:func:`_with_state`), simulated. R19: where the state's spill
    left the swapped activations no host room (they stayed on the device, out of memory), the
    state spills again leaving them every evicted tensor's bytes."""
    plan = _with_state(trace, act, placement, name, hardware, **options)
    r = simulate(trace, plan, hardware, budget, validate=False)
    if r.oom and r.host_skipped and hardware.has_disk and act.evictions:
        sizes = trace.tensor_bytes
        again = _with_state(trace, act, placement, name, hardware, leave=sum(int(sizes[e.tensor]) for e in act.evictions),
                            **options)
        if again.disk != plan.disk:
            r2 = simulate(trace, again, hardware, budget, validate=False)
            if not r2.oom:
                return again, r2
    return plan, r


#: How many candidates (with their stream variants) the screen plans, the best of them once
#: every one is ranked by its plan with every block checkpointed (a millisecond each; the
#: screen's own plan is a search, about 0.3 s each on a 70B-shaped trace); more where none of
#: those fits
SCREENED = 8


def _screened(trace: Trace, budget: int, hardware: Hardware, screen: Policy, name: str, *,
              first: bool = False) -> list[tuple[float, int, dict[str, str], int, int]]:
    """Each candidate placement (and stream variant) whose screened plan fits ``budget`` in
    simulation: (step, candidate, placement, stream room, activation budget). Every candidate
    is ranked by its plan with every block checkpointed (the peers' activation plan); the
    ``SCREENED`` best are planned by ``screen`` too, and score the better of the two. ``first``:
    stop at the first that fits."""
    ranked: list[tuple[float, int, dict[str, str], int, int]] = []
    fine = hardware.host_budget_bytes is not None and hardware.host_budget_bytes < sum(g.bytes for g in trace.state)
    for c, placement in enumerate(candidate_placements(trace, fine)):
        streams = any(w in ("stream", "stream-full") for w in placement.values())
        for room, share in STREAM_VARIANTS if streams else ((0, 1.0),):
            view = activation_view(trace, placement, room)
            act_budget = max(int(budget * share), view.min_feasible_bytes)
            if view.min_feasible_bytes > budget or (share < 1.0 and act_budget >= budget):
                continue
            plan, r = _placed(trace, CheckpointAll().plan(view, act_budget, hardware), placement, name, hardware, budget)
            if first and not r.oom:
                return [(r.iteration_s, c, placement, room, act_budget)]
            ranked.append((r.iteration_s, c, placement, room, act_budget))  # inf where it does not fit
    ranked.sort(key=lambda x: (x[0], x[1]))
    scored: list[tuple[float, int, dict[str, str], int, int]] = []
    for k, (checkpointed, c, placement, room, act_budget) in enumerate(ranked):
        if k >= SCREENED and scored:
            break
        view = activation_view(trace, placement, room)
        _, r = _placed(trace, screen.plan(view, act_budget, hardware), placement, name, hardware, budget)
        step = min(checkpointed, r.iteration_s)  # OOM is inf
        if math.isfinite(step):
            scored.append((step, c, placement, room, act_budget))
            if first:
                return scored
    return scored


def smallest_state_budget(trace: Trace, hardware: Hardware, screen: Policy, *, above: int,
                          tolerance: float = 0.01) -> int | None:
    """The smallest budget, within ``tolerance``, at which a placement :func:`plan_state` screens
    fits in simulation, bisected from ``above`` (a budget that did not fit) up to the smallest
    feasible budget with the state kept; None if none fits there either. The trace's own floor
    with the state movable is a bound that leaves no room to fetch a group ahead of its use (R17),
    so a user refused needs this figure instead."""
    lo, hi = above, max(trace.min_feasible_bytes, above + 1)
    if not _screened(trace, hi, hardware, screen, "probe", first=True):
        return None
    while hi - lo > max(tolerance * hi, 1):
        mid = (lo + hi) // 2
        if _screened(trace, mid, hardware, screen, "probe", first=True):
            hi = mid
        else:
            lo = mid
    return hi


#: Where the screen's plan with the state kept is within this share of the floor with the state
#: movable (:func:`state_floor`, a proven bound), no placement can gain more: it is the plan
FLOOR_SLACK = 0.01


def plan_state(trace: Trace, budget: int, hardware: Hardware, *, inner: Policy, screen: Policy, name: str) -> SwapPlan:
    """``default``'s joint plan of the state and the activations (module docstring); the screen's
    plan with the state kept, without screening, where the floor proves no placement gains more
    than ``FLOOR_SLACK``. Raises :class:`BudgetError` where no candidate fits, naming the
    smallest budget at which one does."""
    kept_view = activation_view(trace, {})  # R3: gradients born in the step leave forward room
    if trace.world_size == 1 and budget >= kept_view.min_feasible_bytes:
        kept = _with_state(trace, screen.plan(kept_view, budget, hardware), {}, name)
        r = simulate(trace, kept, hardware, budget, validate=False)
        if not r.oom and r.iteration_s <= (1 + FLOOR_SLACK) * state_floor(trace, budget, hardware):
            return kept
    scored = _screened(trace, budget, hardware, screen, name)
    if not scored:
        host = hardware.host_budget_bytes
        why = ("" if host is None else
               f"; the host budget, {format_bytes(host)}, keeps on the device every group whose host part does not fit "
               f"in it (R11): the whole state needs {format_bytes(sum(g.bytes for g in trace.state))} of host memory"
               + (f", less what the disk budget ({format_bytes(hardware.disk_budget_bytes or 0)}) holds beside staging "
                  "buffers for it (R19)" if hardware.has_disk else ""))
        least = smallest_state_budget(trace, hardware, screen, above=budget)
        found = ("" if least is None else
                 f"the smallest budget at which a placement fits is {format_bytes(least)} ({least} bytes), to within 1%; ")
        raise BudgetError(f"no placement of {trace.name!r}'s state fits {format_bytes(budget)}: {found}no plan can meet "
                          f"less than {format_bytes(trace.min_feasible_bytes_movable)} with the state movable, a bound "
                          f"that leaves no room to fetch a group ahead of its use{why}; try a larger budget"
                          + ("" if host is None else " or host budget"), smallest_bytes=least)
    scored.sort()
    best: tuple[float, SwapPlan] | None = None
    for _, _, placement, room, act_budget in scored[:FINALISTS]:
        keep = _unsharded(trace, budget, hardware, screen, placement, room, act_budget, name)
        view = activation_view(trace, placement, room, keep)
        for pol in (inner, screen, CheckpointAll()):
            plan, r = _placed(trace, pol.plan(view, act_budget, hardware), placement, name, hardware, budget,
                              unsharded=keep)
            if not r.oom and (best is None or r.iteration_s < best[0]):
                best = (r.iteration_s, plan)
    assert best is not None  # the finalist's screened plan fits (the screen's or every block checkpointed)
    # the peers' own rules are candidates too: default is never slower than a peer that fits
    allowed, tiers = set(allowed_placements(trace.meta)), set(allowed_disk_tiers(trace.meta))
    for peer in PEERS.values():
        plan = peer.plan(trace, budget, hardware)
        if (not set(plan.placement().values()) <= allowed or not set(plan.on_disk().values()) <= tiers
                or plan.disk and not hardware.has_disk):  # R19: no disk, no disk peer (it is zero3-offload then)
            continue
        r = simulate(trace, plan, hardware, budget, validate=False)
        if not r.oom and r.iteration_s < best[0]:
            best = (r.iteration_s, replace(plan, policy=name))
    return best[1]


#: R18: the shares of a sharded trace's units (the last in forward, whose backward comes first)
#: that ``default`` tries keeping unsharded from forward to backward (``reshard_after_forward``)
UNSHARDED_SHARES = (0.0, 1 / 8, 1 / 4, 1 / 2, 1.0)


def _screened_plan(trace: Trace, budget: int, hardware: Hardware, screen: Policy, placement: dict[str, str], room: int,
                   act_budget: int, name: str, keep: frozenset[str]) -> SwapPlan:
    """The screen's plan of ``placement`` with ``keep`` unsharded, or every block checkpointed
    where that does not fit (as :func:`_screened`)."""
    view = activation_view(trace, placement, room, keep)
    plan, r = _placed(trace, screen.plan(view, act_budget, hardware), placement, name, hardware, budget, unsharded=keep)
    if r.oom:
        plan, _ = _placed(trace, CheckpointAll().plan(view, act_budget, hardware), placement, name, hardware, budget,
                          unsharded=keep)
    return plan


def _unsharded(trace: Trace, budget: int, hardware: Hardware, screen: Policy, placement: dict[str, str], room: int,
               act_budget: int, name: str) -> frozenset[str]:
    """R18: the units of a sharded trace to keep unsharded after forward, for ``placement``:
    the share (``UNSHARDED_SHARES``, the last units first) whose screened plan steps fastest and
    fits; none on one device."""
    if trace.world_size == 1:
        return frozenset()
    order = [g.name for g in sorted(trace.state, key=lambda g: -g.forward_at)]
    best: tuple[float, frozenset[str]] = (math.inf, frozenset())
    for share in UNSHARDED_SHARES:
        keep = frozenset(order[:math.ceil(len(order) * share)])
        r = simulate(trace, _screened_plan(trace, budget, hardware, screen, placement, room, act_budget, name, keep),
                     hardware, budget, validate=False)
        if not r.oom and r.iteration_s < best[0]:
            best = (r.iteration_s, keep)
    return best[1]


@dataclass(frozen=True)
class StatePeer:
    """A fixed state rule over every group, with every block checkpointed (module docstring)."""

    name: str
    placement: str
    host_step: str = "after-backward"
    param_return: str = "each"
    #: where the peer puts frozen groups (R13); None: as ``placement`` means for them (``frozen_placement``)
    frozen: str | None = None
    #: R19: the disk tier of every group (None: nothing on the disk)
    disk: str | None = None

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        act = CheckpointAll().plan(trace, budget, hardware)
        frozen = self.frozen or frozen_placement(self.placement)
        placement = {g.name: frozen if g.frozen else self.placement for g in trace.state}
        placement = {g: w for g, w in placement.items() if w != "device"}
        # R19: its tier where the trace allows it, else the one it does (live: ZeRO-Infinity's
        # offload_param: cpu with offload_optimizer: nvme)
        tiers = allowed_disk_tiers(trace.meta)
        tier = self.disk if self.disk in tiers else next(iter(tiers), None)
        disk = {g: tier for g in placement} if self.disk is not None and tier is not None else {}
        plan = _with_state(trace, act, placement, self.name, host_step=self.host_step, param_return=self.param_return)
        return replace(plan, disk=tuple(sorted(disk.items())))


#: The peers by name: ZeRO-Offload (gradients out as they complete, the fp32 step on the host
#: after backward, the parameters back together), FSDP2 CPUOffloadPolicy (parameters,
#: gradients and state on the host, parameters fetched for each use, the step on the host),
#: torchao CPUOffloadOptimizer (gradients out as produced, the host step after backward, each
#: parameter back as its step finishes)
@dataclass(frozen=True)
class PartialOffloadPeer:
    """FSDP2 with the offload #188120 proposes (``cpu_offload_by_budget``): ``CPUOffloadPolicy``
    (``full``) on the units with the largest parameters first, as few as make the rank fit its
    budget, every block checkpointed; all of them where none fits."""

    name: str = "fsdp-partial"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        act = CheckpointAll().plan(trace, budget, hardware)
        order = [g.name for g in sorted(trace.state, key=lambda g: (-g.param_bytes, g.forward_at))]

        def offloading(k: int) -> SwapPlan:
            placement = {name: "full" for name in order[:k]}
            return _with_state(trace, act, placement, self.name, host_step="after-backward")

        lo, hi = 0, len(order)  # the fewest units offloaded that fit: bisected (more offloaded, less held)
        if simulate(trace, offloading(hi), hardware, budget, validate=False).oom:
            return offloading(hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if simulate(trace, offloading(mid), hardware, budget, validate=False).oom:
                lo = mid + 1
            else:
                hi = mid
        return offloading(lo)


PEERS: dict[str, StatePeer | PartialOffloadPeer] = {
    "zero-offload": StatePeer("zero-offload", "host-step", param_return="all"),
    "fsdp-offload": StatePeer("fsdp-offload", "full"),
    "ao-offload": StatePeer("ao-offload", "host-step", param_return="each"),
    # R18, sharded: FSDP2 with no offload; #188120's partial offload; DeepSpeed ZeRO-3 with its
    # parameters and optimizer offloaded (offload_param + offload_optimizer to the CPU: every
    # unit's shard on the host, fetched for each use, the CPU Adam after backward, the
    # parameters back together)
    "fsdp": StatePeer("fsdp", "device"),
    "fsdp-partial": PartialOffloadPeer(),
    "zero3-offload": StatePeer("zero3-offload", "full", param_return="all"),
    # R13, frozen weights (LoRA): accelerate's device_map="auto" with CPU offload, frozen weights
    # on the host fetched per module in forward and backward, the adapters on the device
    "accelerate-offload": StatePeer("accelerate-offload", "device", frozen="full"),
    # R19, the disk tier: DeepSpeed ZeRO-Infinity (ZeRO-3 with offload_param and offload_optimizer
    # to NVMe): every group's parameters and optimizer state on the disk, the parameters read for
    # each use, the CPU Adam after backward reading and writing its state there, the parameters
    # back together
    "zero-infinity": StatePeer("zero-infinity", "full", param_return="all", disk="state"),
}


def state_floor(trace: Trace, budget: int, hardware: Hardware) -> float:
    """A lower bound on any plan's step with the state movable (R16's floor).

    The activations' part is :func:`joint_floor` on the trace with its state on the device and
    the budget raised by all of the state (no plan of the activations does better with more
    room). The state's part: at gap *j*, ``must_j`` bytes beyond what the activations can free
    (``static + other + must-resident - budget``) are state off the device, and each placement
    brings back over the link, per byte it frees, at least ``r`` = the least of (a parameter's
    bytes over its gradient's and optimizer state's: ``host-step``; 1: ``param``, ``stream``;
    twice the parameter over the whole group: ``full``). So the step takes at least
    ``r * max_j must_j / B_h2d``, and at least the compute with the optimizer's steps split at
    best between the device and the host (:func:`_optimizer_floor`)."""
    if not trace.state:
        return joint_floor(trace, budget, hardware)
    state_bytes = sum(g.bytes for g in trace.state)
    activations = joint_floor(trace, budget + state_bytes, hardware)
    ratios = [1.0]
    for g in trace.state:
        if g.grad_bytes + g.optim_bytes > 0:
            ratios.append(g.param_bytes / (g.grad_bytes + g.optim_bytes))
        if g.bytes > 0:
            ratios.append(2 * g.param_bytes / g.bytes)  # full; stream-full brings back more (all of it, once more)
    must = 0
    if trace.n_events:
        demand = trace.fixed_bytes + state_bytes + trace.other_bytes + trace.must_resident_bytes
        demand = demand - trace.state_gradients_unborn_bytes  # R3: a gradient is there from its birth
        must = int(max(0, (demand - budget).max()))
    link = min(ratios) * must / hardware.link_bytes_per_s("h2d")
    return max(activations, link, _optimizer_floor(trace, hardware)) if math.isfinite(activations) else activations


def _optimizer_floor(trace: Trace, hardware: Hardware) -> float:
    """R15: the optimizer's steps run on the compute stream (the device's share, after the step's
    compute) or on the host (its share, within the step's period): with a share ``x`` of the
    parameters on the host the step takes at least ``max(I + (1 - x) D, x H)`` (``I`` the ideal
    compute, ``D`` and ``H`` every parameter's step on the device and on the host), least at
    ``x = (I + D) / (D + H)``."""
    device_rate, host_rate = optimizer_rates(trace, hardware)
    params = sum(g.params for g in trace.state if not g.frozen)  # frozen groups do not step (R13)
    if math.isinf(device_rate) or not params:
        return trace.ideal_s
    ideal, dev, host = trace.ideal_s, params / device_rate, params / host_rate
    x = min(1.0, (ideal + dev) / (dev + host))
    return max(ideal + (1 - x) * dev, x * host)
