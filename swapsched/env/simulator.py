"""A pure discrete-event simulation of one training step under a SwapPlan (rules R1-R8 of DESIGN.md).

No gymnasium here: explicit inputs (trace, plan, hardware, budget) in, a :class:`SimResult` out.

- :func:`simulate` runs a whole plan.
- :class:`Simulation` is the incremental form the Env drives: ``schedule`` evictions whose swap-out
  is at or after the next unprocessed event, ``run_until`` an event, then ``finish``.
- :func:`analytic_floor` is the R8 bound.

State lives in flat preallocated arrays indexed by tensor id (``loc``, ``out_done``, ``in_done``)
plus two FIFO queues for the copy engines; per-trace tables (what is allocated, freed, unpacked at
each event) are computed once per trace and cached. The loop touches only Python lists and floats,
so the result is deterministic bit for bit.

Locations of a tensor (``loc``): NOT_YET produced, RESIDENT, OUT (being copied to the host),
HOST, IN (swap-in allocated, copying or done), WAITING (prefetch issued, waiting for room, R6),
FREED.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from swapsched.hardware import Hardware
from swapsched.plan import Eviction, SwapPlan
from swapsched.trace import Trace

__all__ = ["SimResult", "Simulation", "simulate", "analytic_floor", "Timeline", "EventTables", "event_tables"]

#: Where a tensor is; the runtime's records use the same values (one set of states for both executors).
NOT_YET, RESIDENT, OUT, HOST, IN, WAITING, FREED = range(7)


@dataclass(frozen=True)
class Timeline:
    """What ``--plot`` draws: memory over time and the busy intervals of the three streams."""

    memory: tuple[tuple[float, int], ...]  # (time s, device bytes) after each change
    compute: tuple[tuple[float, float], ...]  # (start, end) of each gap's compute
    d2h: tuple[tuple[float, float, int], ...]  # (start, end, tensor)
    h2d: tuple[tuple[float, float, int], ...]
    stalls: tuple[tuple[float, float, int], ...]  # (start, end, event)


@dataclass(frozen=True)
class SimResult:
    """R8: what a plan costs. On OOM, ``iteration_s`` and ``overhead`` are ``inf``."""

    iteration_s: float
    ideal_s: float
    stall_s: float
    stall_fwd_s: float
    stall_bwd_s: float
    peak_bytes: int
    budget_bytes: int
    oom: bool
    oom_event: int | None
    d2h_bytes: int
    h2d_bytes: int
    timeline: Timeline | None = field(default=None, compare=False, repr=False)
    # the host's own cost of the copies (Hardware copy_issue_s, copy_host_s_per_byte, wait_resume_s);
    # already in iteration_s
    host_s: float = 0.0

    @property
    def overhead(self) -> float:
        return self.iteration_s / self.ideal_s - 1.0 if self.ideal_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return None if math.isinf(x) else x

        return {
            "iteration_s": num(self.iteration_s),
            "ideal_s": self.ideal_s,
            "overhead": num(self.overhead),
            "stall_s": num(self.stall_s),
            "stall_fwd_s": num(self.stall_fwd_s),
            "stall_bwd_s": num(self.stall_bwd_s),
            "peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "oom": self.oom,
            "oom_event": self.oom_event,
            "d2h_bytes": self.d2h_bytes,
            "h2d_bytes": self.h2d_bytes,
            "host_s": num(self.host_s),
        }


class EventTables:
    """Per-trace lookup lists, computed once; the simulator's hot loop and the live runtime's
    hooks read only these."""

    def __init__(self, trace: Trace):
        n = trace.n_events
        self.n = n
        self.bytes = trace.tensor_bytes.tolist()
        self.gaps = trace.gaps.tolist()
        self.other = trace.other_bytes.tolist()
        self.is_unpack = trace.event_kind_is_unpack.tolist()
        self.tensor = trace.event_tensor.tolist()
        self.backward_start = trace.backward_start
        self.alloc: list[list[int]] = [[] for _ in range(n)]
        self.free: list[list[int]] = [[] for _ in range(n)]
        for k, (fp, lu) in enumerate(zip(trace.first_pack.tolist(), trace.last_unpack.tolist(), strict=False)):
            self.alloc[fp].append(k)
            self.free[lu].append(k)
        self.alloc_bytes = [sum(self.bytes[k] for k in ks) for ks in self.alloc]
        # R2: the event after whose gap the program no longer holds each tensor
        self.release: list[list[int]] = [[] for _ in range(n)]
        for k, r in enumerate(trace.release.tolist()):
            self.release[r].append(k)
        # R2: tensors whose memory outlives their last unpack (the node that read them still runs)
        # are freed after the gap of this event instead
        self.freed_late: list[list[int]] = [[] for _ in range(n)]
        self.late = [False] * trace.n_tensors
        for k, (f, lu) in enumerate(zip(trace.freed.tolist(), trace.last_unpack.tolist(), strict=False)):
            if f > lu:
                self.freed_late[f].append(k)
                self.late[k] = True


def event_tables(trace: Trace) -> EventTables:
    """The trace's lookup lists, computed once per trace (kept in ``trace.derived``)."""
    t = trace.derived.get("sim")
    if t is None:
        t = trace.derived["sim"] = EventTables(trace)
    return t


class Simulation:
    """Incremental simulation of one step. Events are processed in order; evictions may be added
    until the simulation reaches their swap-out event."""

    def __init__(self, trace: Trace, hardware: Hardware, budget: int, *, record: bool = False):
        self.trace, self.hw, self.budget = trace, hardware, int(budget)
        tb = self.tb = event_tables(trace)
        nt = trace.n_tensors
        self.loc = [NOT_YET] * nt
        # R2: a swap-out frees its bytes once it completed *and* the program released the tensor
        self.released = [False] * nt
        self.held_after_copy = [False] * nt  # copied out, still held by the program
        self.held_late = [False] * nt  # last unpacked, still held by the node that reads it
        self.out_done = [0.0] * nt
        self.in_done = [0.0] * nt
        self.issue_time = [0.0] * nt
        self.out_at: list[list[int]] = [[] for _ in range(tb.n)]
        self.prefetch_at: list[list[int]] = [[] for _ in range(tb.n)]
        self.d2h_q: deque[tuple[float, int]] = deque()  # swap-outs in flight: (done time, tensor), FIFO
        self.waiting: deque[int] = deque()  # prefetches waiting for room, in issue order (R6)
        self.d2h_free = 0.0
        self.h2d_free = 0.0
        self.used = 0  # saved bytes on the device: resident + copying out + copying in (R3)
        self.cur_other = 0
        self.static = int(trace.static_bytes)
        self.peak = self.static
        self.t = 0.0
        self.stall_fwd = 0.0
        self.stall_bwd = 0.0
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.next_event = 0
        self.oom_event: int | None = None
        self.hook = hardware.hook_cost_s
        # host costs of the copies: owed as they arise (an admission may happen in a drain) and
        # paid by the compute thread before its next gap
        self.issue = hardware.copy_issue_s
        self.resume = hardware.wait_resume_s
        self.per_byte = hardware.copy_host_s_per_byte
        self.host_debt = 0.0
        self.host_s = 0.0
        self.lat = hardware.copy_latency_s
        self.inv_d2h = 1.0 / hardware.d2h_bytes_per_s
        self.inv_h2d = 1.0 / hardware.h2d_bytes_per_s
        self.record = record
        if record:
            self._mem: list[tuple[float, int]] = [(0.0, self.static)]
            self._compute: list[tuple[float, float]] = []
            self._d2h: list[tuple[float, float, int]] = []
            self._h2d: list[tuple[float, float, int]] = []
            self._stalls: list[tuple[float, float, int]] = []

    # ------------------------------------------------------------------ plan input
    def schedule(self, tensor: int, swap_out_at: int, prefetch_at: int) -> None:
        """Add an eviction (R7). Its swap-out must not be in the past of the simulation."""
        assert swap_out_at >= self.next_event, "eviction scheduled in the simulated past"
        self.out_at[swap_out_at].append(tensor)
        self.prefetch_at[prefetch_at].append(tensor)

    @property
    def done(self) -> bool:
        return self.next_event >= self.tb.n or self.oom_event is not None

    @property
    def stall_s(self) -> float:
        return self.stall_fwd + self.stall_bwd

    # ------------------------------------------------------------------ memory and copies
    def _note_mem(self) -> None:
        m = self.static + self.cur_other + self.used
        if m > self.peak:
            self.peak = m
        if self.record:
            self._mem.append((self.t, m))

    def _complete_one_swapout(self) -> float:
        """Retire the oldest in-flight swap-out (R6 FIFO); returns its completion time."""
        done, k = self.d2h_q.popleft()
        if self.released[k]:
            self.used -= self.tb.bytes[k]
        else:
            self.held_after_copy[k] = True
        if self.loc[k] == OUT:
            self.loc[k] = HOST
        if self.record:
            self._mem.append((done, self.static + self.cur_other + self.used))
        return done

    def _drain(self, now: float) -> None:
        """Retire swap-outs completed by ``now``, admitting waiting prefetches as room appears."""
        q = self.d2h_q
        while q and q[0][0] <= now:
            c = self._complete_one_swapout()
            if self.waiting:
                self._admit(c)
        if self.waiting:
            self._admit(now)

    def _start_swapin(self, k: int, at: float) -> None:
        """Allocate ``k``'s bytes at ``at`` and queue its copy on the host->device engine (R6)."""
        b = self.tb.bytes[k]
        self.used += b
        self._note_mem()
        self.host_debt += self.issue + b * self.per_byte
        start = max(at, self.h2d_free, self.out_done[k])
        end = start + self.lat + b * self.inv_h2d
        self.h2d_free = end
        self.in_done[k] = end
        self.loc[k] = IN
        self.h2d_bytes += b
        if self.record:
            self._h2d.append((start, end, k))

    def _admit(self, now: float) -> None:
        """Give room to waiting prefetches, strictly in issue order (R6)."""
        room = self.budget - self.static - self.cur_other - self.used
        w = self.waiting
        while w:
            k = w[0]
            b = self.tb.bytes[k]
            if b > room:
                return
            w.popleft()
            room -= b
            self._start_swapin(k, max(now, self.issue_time[k]))

    def _make_room(self, need: int, event: int) -> bool:
        """Compute needs ``need`` more bytes now: wait for in-flight swap-outs (R4). False on OOM."""
        limit = self.budget - self.static - self.cur_other
        while self.used + need > limit:
            if not self.d2h_q:
                self.oom_event = event
                return False
            c = self._complete_one_swapout()
            if c > self.t:
                self._stall(c - self.t, event)
        return True

    def _let_go(self, held: list[bool], k: int) -> None:
        """R2: whoever held ``k`` past the point its bytes would otherwise go lets go now."""
        if held[k]:
            held[k] = False
            self.used -= self.tb.bytes[k]
            if self.waiting:
                self._admit(self.t)

    def _allocate(self, i: int) -> bool:
        """Room for the non-saved bytes of gap ``i`` and for event ``i``'s new tensors, which then
        become resident (R4: before the gap starts). False on OOM."""
        need = self.tb.alloc_bytes[i]
        if not self._make_room(need, i):
            return False
        for k in self.tb.alloc[i]:
            self.loc[k] = RESIDENT
        self.used += need
        self._note_mem()
        return True

    def _stall(self, dt: float, event: int) -> None:
        if self.record:
            self._stalls.append((self.t, self.t + dt, event))
        self.t += dt
        self.host_debt += self.resume
        if event < self.tb.backward_start:
            self.stall_fwd += dt
        else:
            self.stall_bwd += dt

    def _pay_host(self) -> None:
        """The compute thread spends what the copies cost the host before it computes on."""
        self.t += self.host_debt
        self.host_s += self.host_debt
        self.host_debt = 0.0

    # ------------------------------------------------------------------ the event loop
    def run_until(self, stop: int) -> None:
        """Process events ``next_event .. stop-1`` (R4, R5)."""
        tb = self.tb
        stop = min(stop, tb.n)
        loc = self.loc
        while self.next_event < stop and self.oom_event is None:
            i = self.next_event
            # -- the gap before event i: room to produce its new tensors (R4)
            self._drain(self.t)
            self.cur_other = tb.other[i]
            if (tb.alloc[i] or self.cur_other) and not self._allocate(i):
                return
            if self.host_debt:
                self._pay_host()
            gap = tb.gaps[i] + self.hook
            if self.record:
                self._compute.append((self.t, self.t + gap))
            self.t += gap
            self._drain(self.t)
            # -- the program lets go of tensors after this gap, and nodes that ran free theirs (R2)
            for k in tb.freed_late[i]:
                self._let_go(self.held_late, k)
            for k in tb.release[i]:
                self.released[k] = True
                self._let_go(self.held_after_copy, k)
            # -- (a) an unpack of a tensor that is not resident waits for its swap-in (R5a)
            if tb.is_unpack[i]:
                k = tb.tensor[i]
                s = loc[k]
                if s != RESIDENT:
                    if s == WAITING:  # on demand goes ahead of prefetches still waiting for room
                        self.waiting.remove(k)
                        s = HOST
                    if s in (HOST, OUT):
                        if not self._make_room(tb.bytes[k], i):
                            return
                        self._start_swapin(k, self.t)
                    if self.in_done[k] > self.t:
                        self._stall(self.in_done[k] - self.t, i)
                    loc[k] = RESIDENT
                    self._drain(self.t)
            # -- (b) free tensors whose last use is i
            for k in tb.free[i]:
                if loc[k] == RESIDENT:
                    if tb.late[k]:
                        self.held_late[k] = True
                    else:
                        self.used -= tb.bytes[k]
                loc[k] = FREED
            if tb.free[i]:
                if self.record:
                    self._mem.append((self.t, self.static + self.cur_other + self.used))
                if self.waiting:
                    self._admit(self.t)
            # -- (c) swap-outs planned at i
            for k in self.out_at[i]:
                assert loc[k] == RESIDENT, "swap-out of a tensor that is not resident (plan breaks R7)"
                b = tb.bytes[k]
                start = self.t if self.t > self.d2h_free else self.d2h_free
                end = start + self.lat + b * self.inv_d2h
                self.d2h_free = end
                self.out_done[k] = end
                loc[k] = OUT
                self.host_debt += self.issue + b * self.per_byte
                self.d2h_q.append((end, k))
                self.d2h_bytes += b
                if self.record:
                    self._d2h.append((start, end, k))
            # -- (d) prefetches planned at i
            pf = self.prefetch_at[i]
            if pf:
                for k in pf:
                    if loc[k] in (OUT, HOST):  # equal to the first unpack: already back on demand
                        loc[k] = WAITING
                        self.issue_time[k] = self.t
                        self.waiting.append(k)
                self._admit(self.t)
            self.next_event = i + 1

    def finish(self) -> SimResult:
        self.run_until(self.tb.n)
        oom = self.oom_event is not None
        hooks = self.hook * self.tb.n
        ideal = self.trace.ideal_s + hooks
        if not oom:
            if self.host_debt:
                self._pay_host()
            self.t += self.trace.tail_compute_s
            if self.record:
                self._compute.append((self.t - self.trace.tail_compute_s, self.t))
        timeline = None
        if self.record:
            timeline = Timeline(tuple(self._mem), tuple(self._compute), tuple(self._d2h), tuple(self._h2d), tuple(self._stalls))
        return SimResult(
            iteration_s=math.inf if oom else self.t,
            ideal_s=ideal,
            stall_s=math.inf if oom else self.stall_s,
            stall_fwd_s=math.inf if oom else self.stall_fwd,
            stall_bwd_s=math.inf if oom else self.stall_bwd,
            peak_bytes=int(self.peak),
            budget_bytes=self.budget,
            oom=oom,
            oom_event=self.oom_event,
            d2h_bytes=int(self.d2h_bytes),
            h2d_bytes=int(self.h2d_bytes),
            timeline=timeline,
            host_s=math.inf if oom else self.host_s,
        )


def simulate(trace: Trace, plan: SwapPlan | list[Eviction], hardware: Hardware, budget: int, *, record: bool = False,
             validate: bool = True) -> SimResult:
    """Simulate one step of ``trace`` executing ``plan`` under ``budget`` bytes on ``hardware``."""
    whole = plan if isinstance(plan, SwapPlan) else SwapPlan(trace.name, "?", tuple(plan))
    if validate:
        whole.validate(trace)
    sim = Simulation(trace, hardware, budget, record=record)
    sim.out_at, sim.prefetch_at = whole.by_event(trace.n_events)  # what schedule() builds one eviction at a time
    return sim.finish()


def analytic_floor(trace: Trace, budget: int, hardware: Hardware) -> float:
    """R8's lower bound on the step time, split at the gap where it binds.

    At gap *j* at least ``must_j`` = demand_j - budget bytes are off the device, so they finished
    their swap-out before the gap started and start their swap-in after it: the step takes at least
    ``max(compute before j, must_j / B_d2h) + max(compute from j on, must_j / B_h2d)``. The bound is
    the largest over all gaps (R8 states it with *j* at the forward/backward boundary).
    """
    if trace.n_events == 0:
        return trace.ideal_s
    gaps = trace.gaps + hardware.hook_cost_s
    before = np.concatenate(([0.0], np.cumsum(gaps)[:-1]))
    after = gaps.sum() + trace.tail_compute_s - before
    demand = trace.static_bytes + trace.other_bytes + trace.resident_bytes_no_swap
    must = np.maximum(demand - budget, 0).astype(np.float64)
    bound = np.maximum(before, must / hardware.d2h_bytes_per_s) + np.maximum(after, must / hardware.h2d_bytes_per_s)
    return float(bound.max())
