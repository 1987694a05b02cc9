"""What the training state's placements hold where (R13-R14), and when a group is fetched: the
tables the simulated step (``state_exec.py``), the activation planners' view of a placed state
(``agents/state_search.py``) and the runtime's state at rest read.

Per placement (``swapsched/state.py``), what is on the device:

- ``device``: everything, all step (counted in the step's static bytes, as before the state).
- ``param``: the gradient and optimizer state always; the parameter from the step's start
  through its forward use, copied out after it (freed when the copy lands, R2-like), fetched
  ahead of its backward use (R14) and kept to the next step's forward.
- ``stream``: parameter and gradient always; the optimizer state from its fetch (issued when the
  group's gradient completes, waiting for room, R6) until its copy out after the device step.
- ``host-step``: the parameter always; the gradient from its backward use until its copy to the
  host lands. The host steps the group (R15) and the updated parameter is copied back; its next
  forward use waits for that copy (R16).
- ``full``: ``host-step`` with the parameter on the device only while forward or backward uses
  it: fetched ahead of each use, let go after (the host's copy is the master).
- ``stream-full``: the parameter as in ``full``, the gradient as in ``host-step``; once the
  gradient has landed on the host, parameter, gradient and optimizer state are streamed in (as
  ``stream``'s state) for the device step, the gradient let go after it and the parameter and
  state copied out.

Where the step begins with no gradient (``Trace.state_gradients_born``, R3), each gradient is on
the device from its group's ``backward_at`` on, not all step: the static bytes leave it out
(``static_parts``), and under ``device``, ``param`` and ``stream`` it is held from there to the
step's end (``born_gradients_held``).

R19, the disk tier: a group placed on the disk rests there the parts ``disk_parts`` names (its
optimizer state; with tier ``state`` its parameter's master too), and the host holds them only
in staging while they are read or written (``STAGING_SLOTS`` buffers in flight, each its group's size).

Fetches go one group ahead (R14): a group's forward fetch is issued as the previous fetched
group's forward starts (the first at the step's start), its backward fetch as the previous one's
backward starts (the first as backward starts); a sharded step's all-gathers alike (R18).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.state import MEASURED_OPTIMIZER_RATES, OPTIMIZERS

__all__ = ["STATIC_PARTS", "static_parts", "HOST_PARTS", "STREAM_IN_PARTS", "STREAM_OUT_PARTS", "state_split",
           "keeps_gradient", "born_gradients_held", "host_gradients_coming", "resident_parts", "part_bytes", "stream_in_bytes", "one_ahead", "fetch_events", "by_event", "disk_parts", "STAGING_SLOTS", "optimizer_rates",
           "staging_bytes", "host_need", "Held", "held", "as_held"]

#: The parts of a group the step's static bytes hold under each placement (module docstring)
STATIC_PARTS = {"device": ("param_bytes", "grad_bytes", "optim_bytes"), "param": ("grad_bytes", "optim_bytes"),
                "stream": ("param_bytes", "grad_bytes"), "host-step": ("param_bytes",), "full": (), "stream-full": ()}
#: ... and what the host holds for it all step (R11: pinned state, beside swapped activations)
HOST_PARTS = {"device": (), "param": ("param_bytes",), "stream": ("optim_bytes",),
              "host-step": ("param_bytes", "grad_bytes", "optim_bytes"),
              "full": ("param_bytes", "grad_bytes", "optim_bytes"), "stream-full": ("param_bytes", "grad_bytes", "optim_bytes")}
#: What the device step of a streamed group brings in, lets go right after, and copies out
STREAM_IN_PARTS = {"stream": ("optim_bytes",), "stream-full": ("param_bytes", "grad_bytes", "optim_bytes")}
STREAM_OUT_PARTS = {"stream": ("optim_bytes",), "stream-full": ("param_bytes", "optim_bytes")}


#: R19: the groups a disk's staging buffers hold at once: one being read, one being stepped, one
#: being written (ZeRO-Infinity's ``buffer_count``, planned rather than set); each buffer is its
#: group's size
STAGING_SLOTS = 3


def optimizer_rates(trace: Any, hardware: Hardware) -> tuple[float, float]:
    """R15: parameters a second the device and the host step ``trace``'s groups at (inf: the
    optimizer keeps no state to step): the user's optimizer as measured on this machine where the
    trace says (``MEASURED_OPTIMIZER_RATES``), else the hardware's (a memory roofline on the
    device, its host figure on the host)."""
    kind = OPTIMIZERS.get(str(trace.meta.get("optimizer", "adamw")), OPTIMIZERS["adamw"])
    if not kind.touched_bytes_per_param:
        return math.inf, math.inf
    measured = trace.meta.get(MEASURED_OPTIMIZER_RATES) or {}
    return (float(measured.get("device") or hardware.device_optimizer_rate(kind.touched_bytes_per_param)),
            float(measured.get("host") or hardware.host_optimizer_rate()))


def disk_parts(placement: str, tier: str | None) -> tuple[str, ...]:
    """R19: the parts of a group placed ``placement`` that rest on the disk under ``tier``
    (None: not on the disk): of its host parts, the optimizer state, and with ``state`` the
    parameter's master; never the gradient."""
    if tier is None:
        return ()
    parts = ("optim_bytes",) if tier == "optim" else ("param_bytes", "optim_bytes")
    return tuple(p for p in parts if p in HOST_PARTS[placement])


def host_need(group: Any, placement: str, tier: str | None) -> int:
    """What the host holds for ``group`` all step (R11): its host parts less those on the disk."""
    return part_bytes(group, HOST_PARTS[placement]) - part_bytes(group, disk_parts(placement, tier))


def staging_bytes(trace_state: tuple, placement: dict[str, str], disk: dict[str, str]) -> int:
    """R19: the host's staging buffers for the disk: at most ``STAGING_SLOTS`` in flight, each the
    size of its group's bytes there, so at most the ``STAGING_SLOTS`` largest groups' together."""
    return _staging(part_bytes(g, disk_parts(placement.get(g.name, "device"), disk.get(g.name))) for g in trace_state)


def _staging(sizes: Any) -> int:
    """The ``STAGING_SLOTS`` largest of the groups' ``sizes`` on the disk, together."""
    return sum(sorted(sizes, reverse=True)[:STAGING_SLOTS])


def static_parts(placement: str, born: bool = False) -> tuple[str, ...]:
    """The parts the step's static bytes hold under ``placement``; ``born`` (R3): the step makes
    the gradients, so they are held from their birth instead (module docstring)."""
    parts = STATIC_PARTS[placement]
    return tuple(p for p in parts if p != "grad_bytes") if born else parts


def state_split(trace_state: tuple, placement: dict[str, str], disk: dict[str, str] | None = None,
                born: bool = False) -> tuple[int, int]:
    """(device-static bytes, host bytes) of the state under ``placement`` (module docstring),
    with ``disk``'s groups resting their disk parts on the disk (R19: the host holds staging);
    ``born``: the gradients counted from their birth (``static_parts``)."""
    static = host = 0
    disk = disk or {}
    for g in trace_state:
        where = placement.get(g.name, "device")
        static += part_bytes(g, static_parts(where, born))
        host += host_need(g, where, disk.get(g.name))
    return static, host + (staging_bytes(trace_state, placement, disk) if disk else 0)


def keeps_gradient(placement: str) -> bool:
    """Whether ``placement`` keeps the gradient on the device to the step's end (``device``,
    ``param``, ``stream``); the others copy it to the host as it completes."""
    return "grad_bytes" not in HOST_PARTS[placement]


def born_gradients_held(groups: tuple, where: list[str], n: int) -> np.ndarray:
    """R3: per gap (``n + 1``: the tail last), the gradients born in the step that stay on the
    device to its end (under ``device``, ``param`` and ``stream``; the others' go to the host as
    they complete), each from the gap of its group's ``backward_at``: the event at that gap's end
    makes it (the simulator, ``state_exec``) while what the gap holds is still there."""
    held = np.zeros(n + 1, dtype=np.int64)
    for g, w in zip(groups, where, strict=True):
        if keeps_gradient(w):
            held[min(g.backward_at, n):] += g.grad_bytes
    return held


def host_gradients_coming(groups: tuple, where: list[str], n: int) -> np.ndarray:
    """R4 with R14: per gap (``n + 1``: the tail last), the gradients of groups whose placement
    copies them to the host (``host-step``, ``full``, ``stream-full``) that are yet to be made,
    each from the gap after its group's ``backward_at`` through the gap that makes it (the one
    that ends at its ``grad_at``). The simulator allocates such a gradient at the event
    ``backward_at``, waiting for room (``state_exec``); the executing runtime holds its room from
    there, since autograd makes it unasked and the state mover counts it only once its hook sees
    it complete."""
    held = np.zeros(n + 1, dtype=np.int64)
    for g, w in zip(groups, where, strict=True):
        if not keeps_gradient(w):
            first = g.backward_at + 1
            held[min(first, n):min(max(g.grad_at, first), n) + 1] += g.grad_bytes
    return held


def resident_parts(placement: str) -> tuple[str, ...]:
    """The parts of a group (``"param_bytes"``, ``"grad_bytes"``, ``"optim_bytes"``) the device
    holds all step under ``placement`` (module docstring); the rest is off it between uses."""
    return STATIC_PARTS[placement]


def part_bytes(group: Any, fields: tuple[str, ...]) -> int:
    """The bytes of ``group``'s parts named by ``fields`` (``param_bytes``, ...)."""
    return sum(getattr(group, f) for f in fields)


def stream_in_bytes(group: Any, placement: str) -> int:
    """What a streamed group's device step brings in (R15); 0 for a placement that streams nothing."""
    return part_bytes(group, STREAM_IN_PARTS.get(placement, ()))


def one_ahead(uses: list[tuple[int, int]], first: int | None = None) -> dict[int, int]:
    """R14: ``(event of its use, group)`` pairs -> the event at which each group's fetch is
    issued: as the previous group's use starts, the first at ``first`` (or its own use, if
    earlier; the step's start: 0)."""
    uses = sorted(uses)
    start = 0 if first is None else first
    return {j: min(start, at) if k == 0 else uses[k - 1][0] for k, (at, j) in enumerate(uses)}


def fetch_events(groups: tuple, where: list[str], backward_start: int) -> tuple[dict[int, int], dict[int, int]]:
    """R14: the event at which each fetched group's forward fetch and backward fetch are issued:
    one group ahead (module docstring)."""
    return (one_ahead([(g.forward_at, j) for j, g in enumerate(groups) if where[j] in ("full", "stream-full")]),
            one_ahead([(g.backward_at, j) for j, g in enumerate(groups) if where[j] in ("param", "full", "stream-full")],
                      backward_start))


def by_event(n: int, pairs: list[tuple[int, int]]) -> list[tuple[int, ...]]:
    """Per event ``i`` < ``n``, the groups ``j`` of the ``(i, j)`` pairs, in order."""
    out: list[tuple[int, ...]] = [()] * n
    for i, j in pairs:
        if 0 <= i < n:
            out[i] += (j,)
    return out


@dataclass(frozen=True)
class Held:
    """What of a state plan the disk and host budgets hold (:func:`held`)."""

    where: tuple[str, ...]  # each group's placement (``device`` where the host could not hold it)
    parts: tuple[tuple[str, ...], ...]  # each group's parts on the disk
    skipped: int  # groups kept on the device for the host budget (R11)
    disk_skipped: int  # groups resting on the host for the disk budget (R19)
    staging: int  # the disk's staging buffers (R19)
    host: int  # what the host holds for the state, staging included


def held(groups: tuple, placement: dict[str, str], tiers: dict[str, str], hardware: Hardware) -> Held:
    """R19 then R11: each group's disk parts as far as the disk budget holds them, in the groups'
    order (one it cannot hold rests them on the host), the staging buffers for what is there,
    then each group's placement as far as the host budget holds the rest (one it cannot hold
    stays on the device). The one home of this rule: the simulator runs, and the runtime carries
    out (:func:`as_held`), what it leaves."""
    room = hardware.disk_budget_bytes if hardware.has_disk else 0
    assert room is not None
    parts: list[tuple[str, ...]] = []
    disk_skipped = 0
    for g in groups:
        on = disk_parts(placement.get(g.name, "device"), tiers.get(g.name))
        if on and part_bytes(g, on) > room:
            on = ()
            disk_skipped += 1
        room -= part_bytes(g, on)
        parts.append(on)
    staging = _staging(part_bytes(g, on) for g, on in zip(groups, parts, strict=True))
    host_room = math.inf if hardware.host_budget_bytes is None else hardware.host_budget_bytes - staging
    where, skipped, host = [], 0, 0
    for j, g in enumerate(groups):
        w = placement.get(g.name, "device")
        need = host_need(g, w, tiers.get(g.name) if parts[j] else None)
        if need > host_room:
            w, parts[j] = "device", ()
            skipped += 1
        else:
            host_room -= need
            host += need
        where.append(w)
    return Held(tuple(where), tuple(parts), skipped, disk_skipped, staging, host + staging)


def as_held(plan: SwapPlan, groups: tuple, hardware: Hardware) -> SwapPlan:
    """``plan`` with the state placements and disk tiers the budgets hold (:func:`held`), as the
    simulator ran it: what the runtime carries out."""
    h = held(groups, plan.placement(), plan.on_disk(), hardware)
    tiers = plan.on_disk()
    state = tuple(sorted((g.name, w) for g, w in zip(groups, h.where, strict=True) if w != "device"))
    disk = tuple(sorted((g.name, tiers[g.name]) for g, on in zip(groups, h.parts, strict=True) if on))
    return plan if (state, disk) == (plan.state, plan.disk) else replace(plan, state=state, disk=disk)
