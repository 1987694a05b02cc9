"""SwapPlan: which saved tensors to evict, when to swap each out and when to prefetch it (R7),
which blocks to recompute instead (R9), and where each state group lives and steps (R13-R16)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from swapsched.errors import UserError
from swapsched.jsonfile import Fields, open_json, write_json
from swapsched.state import DISK_PLACEMENTS, DISK_TIERS, PLACEMENTS, frozen_placement

if TYPE_CHECKING:
    from swapsched.hardware import Hardware
    from swapsched.trace import Trace

__all__ = [
    "Eviction", "SwapPlan", "PlanError", "BlockState", "load_plan", "save_plan", "HOST_STEPS", "PARAM_RETURNS",
    "LEADS", "swap_out_event", "on_demand_plan", "prefetch_event", "lead_prefetch", "lead_eviction", "carry_evictions",
]

class BlockState(str, Enum):
    """What a plan does with a recomputable block (R9): keeps (or swaps) its tensors, recomputes it
    whole in backward, or checkpoints it selectively (rebuilds only its cheap members)."""

    KEPT = "kept"
    WHOLE = "whole"
    SELECTIVE = "selective"


FORMAT = "swapsched.plan"
#: 2 adds ``recompute`` (R9), 3 ``selective`` (R9, selective), 4 ``state`` and ``host_step``
#: (R13-R16), 5 ``unsharded`` (R18), 6 ``disk`` (R19); files of every earlier version still load
#: (no state placed: all on the device; every unit resharded after forward; nothing on the disk).
VERSION = 6
READS = (1, 2, 3, 4, 5, 6)
#: R15: when the host steps its groups. ``overlap``: each as soon as its gradient is on the host
#: (during backward); ``after-backward``: once backward is done (``optimizer.step()``'s place in
#: the user's loop, as ZeRO-Offload, FSDP2 and torchao run it).
HOST_STEPS = ("overlap", "after-backward")
#: R15: when a host-stepped parameter goes back. ``each``: as its group's step finishes;
#: ``all``: once every group has stepped (ZeRO-Offload copies the fp16 parameters back together)
PARAM_RETURNS = ("each", "all")


class PlanError(UserError):
    """A plan file is malformed or breaks R7 for its trace."""


@dataclass(frozen=True, order=True)
class Eviction:
    """Evict ``tensor``: swap it out at event ``swap_out_at``, prefetch it at ``prefetch_at``."""

    tensor: int
    swap_out_at: int
    prefetch_at: int


@dataclass(frozen=True)
class SwapPlan:
    """The decision for one trace: per saved tensor keep (not listed), swap (an eviction) or
    recompute (a member of a block named in ``recompute``, :attr:`Trace.segments`, R9; or a
    cheap member of a block named in ``selective``, which selective checkpointing rebuilds)."""

    trace: str
    policy: str
    evictions: tuple[Eviction, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    recompute: tuple[str, ...] = ()
    selective: tuple[str, ...] = ()
    #: R13: ``(group, placement)`` for each state group not on the device (swapsched/state.py)
    state: tuple[tuple[str, str], ...] = ()
    host_step: str = "overlap"
    param_return: str = "each"
    #: R18, a sharded step: the units (state groups) kept unsharded from forward to backward
    #: (FSDP2's ``reshard_after_forward=False``); the others are resharded after forward
    unsharded: tuple[str, ...] = ()
    #: R19: ``(group, tier)`` for each placed group whose host parts rest on the disk
    #: (``swapsched/state.py``'s ``DISK_TIERS``)
    disk: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, trace: Trace, policy: str, evictions: Iterable[Eviction], *, recompute: Iterable[str] = (),
           selective: Iterable[str] = (), state: dict[str, str] | None = None, host_step: str = "overlap",
           param_return: str = "each", unsharded: Iterable[str] = (), disk: dict[str, str] | None = None,
           **meta: Any) -> SwapPlan:
        placed = tuple(sorted((g, p) for g, p in (state or {}).items() if p != "device"))
        return cls(trace=trace.name, policy=policy, evictions=tuple(sorted(evictions)), meta=dict(meta),
                   recompute=tuple(sorted(set(recompute))), selective=tuple(sorted(set(selective))), state=placed,
                   host_step=host_step, param_return=param_return, unsharded=tuple(sorted(set(unsharded))),
                   disk=tuple(sorted((disk or {}).items())))

    def placement(self) -> dict[str, str]:
        """Each placed group's placement (groups not named are on the device)."""
        return dict(self.state)

    def on_disk(self) -> dict[str, str]:
        """R19: each group resting on the disk, with its tier."""
        return dict(self.disk)

    def recomputed(self, trace: Trace) -> list[int]:
        """Indices into ``trace.segments`` of the blocks this plan recomputes whole."""
        index = {s.name: s.index for s in trace.segments}
        return sorted(index[n] for n in self.recompute if n in index)

    def recomputed_selectively(self, trace: Trace) -> list[int]:
        """Indices into ``trace.segments`` of the blocks this plan checkpoints selectively."""
        index = {s.name: s.index for s in trace.segments}
        return sorted(index[n] for n in self.selective if n in index)

    @property
    def evicted(self) -> frozenset[int]:
        return frozenset(e.tensor for e in self.evictions)

    def by_event(self, n_events: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """The plan laid out per event, as the simulator and the runtime both execute it: the
        tensors whose swap-out is issued after each event, and those whose prefetch is (in the
        plan's order within an event, R6). Tuples, the empty one shared: a layout keeps these for
        the run, and the garbage collector scans every list."""
        out_at: list[tuple[int, ...]] = [()] * n_events
        prefetch_at: list[tuple[int, ...]] = [()] * n_events
        for e in self.evictions:
            out_at[e.swap_out_at] += (e.tensor,)
            prefetch_at[e.prefetch_at] += (e.tensor,)
        return out_at, prefetch_at

    def validate(self, trace: Trace, source: str = "<plan>") -> SwapPlan:
        """Check R7 against ``trace``; raise :class:`PlanError` naming the eviction and the rule."""
        seen: set[int] = set()
        fp, fu = trace.first_pack, trace.first_unpack
        for k, ev in enumerate(self.evictions):
            where = f"{source}: evictions[{k}]"
            if not 0 <= ev.tensor < trace.n_tensors:
                raise PlanError(f"{where}.tensor: {ev.tensor} out of range: trace {trace.name!r} has {trace.n_tensors} tensors")
            if ev.tensor in seen:
                raise PlanError(f"{where}.tensor: tensor {ev.tensor} evicted twice (R7: at most once per step)")
            seen.add(ev.tensor)
            t = ev.tensor
            if not fp[t] <= ev.swap_out_at < fu[t]:
                raise PlanError(
                    f"{where}.swap_out_at: {ev.swap_out_at} must be in [{fp[t]}, {fu[t]}) "
                    f"(R7: at or after tensor {t}'s first pack, before its first unpack)"
                )
            if not ev.swap_out_at <= ev.prefetch_at <= fu[t]:
                raise PlanError(
                    f"{where}.prefetch_at: {ev.prefetch_at} must be in [{ev.swap_out_at}, {fu[t]}] "
                    f"(R7: at or after the swap-out, at most tensor {t}'s first unpack)"
                )
        groups = {g.name for g in trace.state}
        frozen = {g.name for g in trace.state if g.frozen}
        for k, (group, where) in enumerate(self.state):
            if group not in groups:
                raise PlanError(f"{source}: state[{k}]: trace {trace.name!r} has no state group {group!r}"
                                + ("" if groups else " (it records no state: profile with --optimizer)"))
            if where not in PLACEMENTS:
                raise PlanError(f"{source}: state[{k}]: placement {where!r} unknown; use one of {list(PLACEMENTS)}")
            if group in frozen and where != frozen_placement(where):
                raise PlanError(f"{source}: state[{k}]: group {group!r} is frozen (no gradient, no step): place it "
                                "'device' or 'full' (on the host, fetched for each use)")
        placement = self.placement()
        for k, (group, tier) in enumerate(self.disk):
            if tier not in DISK_TIERS:
                raise PlanError(f"{source}: disk[{k}]: tier {tier!r} unknown; use one of {list(DISK_TIERS)}")
            if placement.get(group, "device") not in DISK_PLACEMENTS:
                raise PlanError(f"{source}: disk[{k}]: group {group!r} is placed {placement.get(group, 'device')!r}, which "
                                f"rests nothing on the host to put on the disk; place it one of {list(DISK_PLACEMENTS)}")
            if group in frozen and tier != "state":
                raise PlanError(f"{source}: disk[{k}]: group {group!r} is frozen (no optimizer state): its tier is 'state'")
        for k, group in enumerate(self.unsharded):
            if trace.world_size == 1:
                raise PlanError(f"{source}: unsharded[{k}]: trace {trace.name!r} is one device's step: nothing is sharded")
            if group not in groups:
                raise PlanError(f"{source}: unsharded[{k}]: trace {trace.name!r} has no unit {group!r}")
        if self.host_step not in HOST_STEPS:
            raise PlanError(f"{source}: host_step: {self.host_step!r} unknown; use one of {list(HOST_STEPS)}")
        if self.param_return not in PARAM_RETURNS:
            raise PlanError(f"{source}: param_return: {self.param_return!r} unknown; use one of {list(PARAM_RETURNS)}")
        segments = {sg.name: sg for sg in trace.segments}
        for k, name in enumerate(self.recompute):
            sg = segments.get(name)
            if sg is None:
                known = ", ".join(list(segments)[:6]) or "none"
                raise PlanError(f"{source}: recompute[{k}]: trace {trace.name!r} has no recomputable block {name!r} "
                                f"(its blocks: {known}{', ...' if len(segments) > 6 else ''})")
            swapped = sorted(seen & set(sg.members))
            if swapped:
                raise PlanError(f"{source}: recompute[{k}]: block {name!r} is recomputed, so its tensor {swapped[0]} cannot "
                                "also be evicted (R9: a member is rebuilt, not swapped; its anchor may be)")
        for k, name in enumerate(self.selective):
            sg = segments.get(name)
            if sg is None or not sg.cheap:
                raise PlanError(f"{source}: selective[{k}]: trace {trace.name!r} has no block {name!r} with members that "
                                "selective checkpointing rebuilds (their ops are all saved ones: matmuls, convolutions, "
                                "attention, views)")
            if name in self.recompute:
                raise PlanError(f"{source}: selective[{k}]: block {name!r} is also in recompute: recompute it whole or "
                                "selectively, not both")
            swapped = sorted(seen & set(sg.members))
            if swapped:
                raise PlanError(f"{source}: selective[{k}]: block {name!r} is checkpointed selectively, so its tensor "
                                f"{swapped[0]} cannot also be evicted (R9: the checkpoint rebuilds its cheap members and "
                                "holds the rest; its anchor may be swapped)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "trace": self.trace,
            "policy": self.policy,
            "meta": self.meta,
            "evictions": [
                {"tensor": e.tensor, "swap_out_at": e.swap_out_at, "prefetch_at": e.prefetch_at} for e in self.evictions
            ],
            "recompute": list(self.recompute),
            "selective": list(self.selective),
            "state": [{"group": g, "placement": p} for g, p in self.state],
            "host_step": self.host_step,
            "param_return": self.param_return,
            "unsharded": list(self.unsharded),
            "disk": [{"group": g, "tier": t} for g, t in self.disk],
        }

    def save(self, path: str | Path) -> Path:
        return save_plan(self, path)


def plan_from_dict(data: Any, source: str = "<dict>") -> SwapPlan:
    f = Fields(source, PlanError)
    if not isinstance(data, dict):
        raise PlanError(f"{source}: expected a JSON object at the top level, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise PlanError(f"{source}: field format: expected {FORMAT!r}, got {data.get('format')!r} (is this a swapsched plan?)")
    version = data.get("version")
    if version not in READS:
        raise PlanError(f"{source}: field version: this swapsched reads versions {', '.join(map(str, READS))}, "
                        f"got {version!r}")
    evs = []
    for k, e in enumerate(f.get(data, "evictions", "evictions", list)):
        w = f"evictions[{k}]"
        evs.append(
            Eviction(
                tensor=f.number(e, "tensor", f"{w}.tensor", integer=True),
                swap_out_at=f.number(e, "swap_out_at", f"{w}.swap_out_at", integer=True),
                prefetch_at=f.number(e, "prefetch_at", f"{w}.prefetch_at", integer=True),
            )
        )
    def block_names(key: str, since: int) -> list[str]:
        names = f.get(data, key, key, list, optional=True) if version >= since else None
        for k, name in enumerate(names or []):
            if not isinstance(name, str) or not name:
                raise PlanError(f"{source}: field {key}[{k}]: expected a block name (a string), got {name!r}")
        return list(names or [])
    return SwapPlan(
        trace=f.get(data, "trace", "trace", str),
        policy=f.get(data, "policy", "policy", str),
        evictions=tuple(sorted(evs)),
        meta=f.get(data, "meta", "meta", dict, optional=True) or {},
        recompute=tuple(sorted(set(block_names("recompute", 2)))),
        selective=tuple(sorted(set(block_names("selective", 3)))),
        state=_state(f, data, source) if version >= 4 else (),
        host_step=str(data.get("host_step", "overlap")) if version >= 4 else "overlap",
        param_return=str(data.get("param_return", "each")) if version >= 4 else "each",
        unsharded=tuple(sorted(set(block_names("unsharded", 5)))),
        disk=_disk(f, data) if version >= 6 else (),
    )


def _disk(f: Fields, data: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((f.get(item, "group", f"disk[{k}].group", str), f.get(item, "tier", f"disk[{k}].tier", str))
                        for k, item in enumerate(f.get(data, "disk", "disk", list, optional=True) or [])))


def _state(f: Fields, data: dict[str, Any], source: str) -> tuple[tuple[str, str], ...]:
    out = []
    for k, item in enumerate(f.get(data, "state", "state", list, optional=True) or []):
        group = f.get(item, "group", f"state[{k}].group", str)
        where = f.get(item, "placement", f"state[{k}].placement", str)
        if where not in PLACEMENTS:
            raise PlanError(f"{source}: field state[{k}].placement: {where!r} unknown; use one of {list(PLACEMENTS)}")
        out.append((group, where))
    return tuple(sorted(out))


def load_plan(path: str | Path, trace: Trace | None = None) -> SwapPlan:
    """Load a plan; with ``trace``, also check it against R7 and that it was made for that trace."""
    plan = plan_from_dict(open_json(path, PlanError), source=str(path))
    if trace is not None:
        if plan.trace != trace.name:
            raise PlanError(f"{path}: field trace: plan was made for {plan.trace!r}, not for trace {trace.name!r}")
        plan.validate(trace, source=str(path))
    return plan


def save_plan(plan: SwapPlan, path: str | Path) -> Path:
    return write_json(plan.to_dict(), path)


# ---------------------------------------------------------------------------- placing evictions
#: Prefetch leads, in transfer times of the tensor itself: 0 is on demand, inf as early as possible
#: (right after the swap-out is issued). The Env's action space and the genetic search share them.
LEADS: tuple[float, ...] = (0.0, 1.0, 2.0, 4.0, 8.0, math.inf)


def swap_out_event(trace: Trace, tensor: int) -> int:
    """Where evicting a tensor first pays off: its last pack before its first unpack (R7)."""
    return int(trace.last_forward_pack[tensor])


def on_demand_plan(trace: Trace, policy: str) -> SwapPlan:
    """Every saved tensor out at its last forward pack (R7), back on demand at its first unpack:
    ``torch.autograd.graph.save_on_cpu``'s schedule."""
    return SwapPlan.of(trace, policy, [Eviction(k, swap_out_event(trace, k), int(trace.first_unpack[k]))
                                       for k in range(trace.n_tensors)])


def prefetch_event(trace: Trace, tensor: int, lead_s: float, swap_out_at: int | None = None) -> int:
    """The latest event whose ideal time is at least ``lead_s`` before the tensor's first unpack,
    clamped to R7's window ``[swap_out_at, first_unpack]``."""
    so = swap_out_event(trace, tensor) if swap_out_at is None else swap_out_at
    fu = int(trace.first_unpack[tensor])
    if lead_s <= 0:
        return fu
    if math.isinf(lead_s):
        return so
    times = trace.event_times
    e = int(np.searchsorted(times, times[fu] - lead_s, side="right")) - 1
    return min(max(e, so), fu)


def lead_prefetch(trace: Trace, tensor: int, lead_index: int, hardware: Hardware, swap_out_at: int | None = None) -> int:
    """The prefetch event ``LEADS[lead_index]`` of ``tensor``'s own transfers ahead of its first
    unpack (:func:`prefetch_event`): how every planner places a prefetch by lead class."""
    lead = LEADS[lead_index] * hardware.h2d_time(trace.tensors[tensor].bytes)
    return prefetch_event(trace, tensor, lead, swap_out_at)


def lead_eviction(trace: Trace, tensor: int, lead_index: int, hardware: Hardware) -> Eviction:
    """Evict ``tensor`` at its last forward pack, prefetching ``LEADS[lead_index]`` transfers ahead."""
    so = swap_out_event(trace, tensor)
    return Eviction(tensor, so, lead_prefetch(trace, tensor, lead_index, hardware, so))


def carry_evictions(plan: SwapPlan, before: Trace, after: Trace) -> tuple[Eviction, ...]:
    """``plan``'s evictions carried from ``before`` onto ``after``, the same steps saving other
    tensors: R9 in the runtime, for a plan that both recomputes and swaps, given whole
    (``use_plan``): once its blocks run under checkpoint, the steps are profiled again and the
    swaps apply to what they still save.

    A tensor of ``before`` outside the recomputed blocks is matched to the next tensor of
    ``after`` (both in order of first pack) with the same bytes, within a few tensors (a block
    under checkpoint saves its inputs, where it saved its members). Events are carried by the
    matched tensors' own events (the k-th event of a tensor to its k-th): an eviction's swap-out
    goes to the carried event at or before it, its prefetch likewise, both clamped to R7's
    window of the matched tensor. Evictions of unmatched tensors are dropped."""
    order_b = sorted(range(before.n_tensors), key=lambda k: int(before.first_pack[k]))
    order_a = sorted(range(after.n_tensors), key=lambda k: int(after.first_pack[k]))
    members = {k for s in before.segments if s.name in (*plan.recompute, *plan.selective) for k in s.members}
    match: dict[int, int] = {}
    j = 0
    for k in order_b:
        if k in members:
            continue
        for look in range(j, min(j + 8, len(order_a))):
            if after.tensors[order_a[look]].bytes == before.tensors[k].bytes:
                match[k] = order_a[look]
                j = look + 1
                break
    # the k-th event of each matched tensor in both traces
    def occurrences(trace: Trace) -> dict[tuple[int, int], int]:
        seen: dict[int, int] = {}
        out = {}
        for i, t in enumerate(trace.event_tensor.tolist()):
            out[(t, seen.get(t, 0))] = i
            seen[t] = seen.get(t, 0) + 1
        return out

    occ_a = occurrences(after)
    carried: list[int] = []  # per event of before: the event of after at or before it (-1: none yet)
    last = -1
    seen_b: dict[int, int] = {}
    for t in before.event_tensor.tolist():
        n = seen_b.get(t, 0)
        seen_b[t] = n + 1
        if t in match and (match[t], n) in occ_a:
            last = max(last, occ_a[(match[t], n)])
        carried.append(last)
    out = []
    for e in plan.evictions:
        t = match.get(e.tensor)
        if t is None:
            continue
        fp, fu = int(after.first_pack[t]), int(after.first_unpack[t])
        so = min(max(carried[e.swap_out_at], fp), fu - 1)
        if so < fp:
            continue  # nowhere to swap it out before it is needed (R7)
        pf = min(max(carried[e.prefetch_at], so), fu)
        out.append(Eviction(t, so, pf))
    return tuple(out)
