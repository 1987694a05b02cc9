"""A pure discrete-event simulation of one training step under a SwapPlan (rules R1-R9 of DESIGN.md).

No gymnasium here: explicit inputs (trace, plan, hardware, budget) in, a :class:`SimResult` out.

- :func:`simulate` runs a whole plan.
- :class:`Simulation` is the incremental form the Env drives: ``schedule`` evictions whose swap-out
  is at or after the next unprocessed event, ``run_until`` an event, then ``finish``.
Its result, :class:`~swapsched.env.result.SimResult`, is ``result.py``'s; the floors (R8, and joint over swap
and recompute) are in ``floors.py``; the per-event tables and tensor states (the runtime's too) in ``events.py``.

State lives in flat preallocated arrays indexed by tensor id (``loc``, ``out_done``, ``in_done``)
plus two FIFO queues for the copy engines (when each is next free: ``copy_engines.py``, R6);
per-trace tables (what is allocated, freed, unpacked at each event) are computed once per trace
and cached. The loop touches only Python lists and floats,
so the result is deterministic bit for bit.

Locations of a tensor (``loc``): NOT_YET produced, RESIDENT, OUT (being copied to the host),
HOST, IN (swap-in allocated, copying or done), WAITING (prefetch issued, waiting for room, R6),
FREED, and DROPPED (a member of a recomputed block, between its release and the recompute, R9).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from swapsched.env.copy_engines import CopyEngines
from swapsched.env.events import DROPPED, FREED, HOST, IN, NOT_YET, OUT, RESIDENT, WAITING, event_tables
from swapsched.env.result import SimResult, Timeline
from swapsched.env.state_exec import StateExecution, run_to_steady_state
from swapsched.hardware import Hardware
from swapsched.plan import Eviction, SwapPlan
from swapsched.trace import Trace

__all__ = ["Simulation", "simulate"]


class Simulation:
    """Incremental simulation of one step. Events are processed in order; evictions may be added
    until the simulation reaches their swap-out event."""

    def __init__(self, trace: Trace, hardware: Hardware, budget: int, *, record: bool = False, guard: bool = False):
        hardware = hardware.for_ranks(trace.world_size)  # R18: the node's host is shared by its ranks
        self.trace, self.hw, self.budget = trace, hardware, int(budget)
        # R4, guard: where the plan leaves no room and no swap-out is in flight, evict on the spot
        # what the runtime's guard would (MIN) instead of stopping at OOM; for predicting a step
        # the runtime executes, never for judging a plan
        self.guard = guard
        self.guard_evictions = 0
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
        self.out_at: list[tuple[int, ...]] = [()] * tb.n
        self.prefetch_at: list[tuple[int, ...]] = [()] * tb.n
        self.recomputed = [False] * len(tb.segments)  # R9: the plan's blocks to recompute
        self.selective = [False] * len(tb.segments)  # R9, selective: of those, the ones that rebuild only `cheap`
        self.any_recompute = False
        self.recompute_s = 0.0
        self.d2h_q: deque[tuple[float, int]] = deque()  # swap-outs in flight: (done time, tensor), FIFO
        self.waiting: deque[int] = deque()  # prefetches waiting for room, in issue order (R6)
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
        # R6/R8: what the runtime's hooks cost each event (``_hook_cost``, set as the step starts)
        self.hook = hardware.hook_cost_s
        self.hook_now: float | None = None
        # host costs of the copies: owed as they arise (an admission may happen in a drain) and
        # paid by the compute thread before it next computes or waits
        self.issue, self.resume, self.per_byte = hardware.copy_issue_s, hardware.wait_resume_s, hardware.copy_host_s_per_byte
        self.host_debt = 0.0
        self.host_s = 0.0
        self.engines = CopyEngines(hardware)  # R6, R10, R11
        # R11: host bytes held by swapped tensors (from the swap-out's issue to the step's end, as
        # the runtime's pool holds them), their peak, and the host budget a swap-out must fit
        self.host_used = self.host_peak = 0
        self.host_budget = hardware.host_budget_bytes
        self.host_skipped = 0
        self.st: StateExecution | None = None  # R13-R16: the plan's state placements (schedule_state)
        self.record = record
        if record:
            self._mem: list[tuple[float, int]] = [(0.0, self.static)]
            self._compute: list[tuple[float, float]] = []
            self._d2h: list[tuple[float, float, int]] = []
            self._h2d: list[tuple[float, float, int]] = []
            self._stalls: list[tuple[float, float, int]] = []
            self._recomputes: list[tuple[float, float, int]] = []

    # ------------------------------------------------------------------ plan input
    def schedule(self, tensor: int, swap_out_at: int, prefetch_at: int) -> None:
        """Add an eviction (R7), not in the simulated past. Copies of one event issue by tensor id
        (R6), as ``SwapPlan.of`` lays a plan out: an episode simulates as the plan it becomes."""
        assert swap_out_at >= self.next_event, "eviction scheduled in the simulated past"
        self.out_at[swap_out_at] = tuple(sorted((*self.out_at[swap_out_at], tensor)))
        self.prefetch_at[prefetch_at] = tuple(sorted((*self.prefetch_at[prefetch_at], tensor)))

    def schedule_recompute(self, segment: int, selective: bool = False) -> None:
        """Recompute block ``segment`` (an index into ``trace.segments``) instead of keeping its
        members (R9); ``selective``: only its cheap members, the rest held. Before the simulation
        reaches the first of their releases."""
        self.recomputed[segment] = True
        self.selective[segment] = selective
        self.any_recompute = True

    def schedule_state(self, plan: SwapPlan, carry: dict[int, float] | None = None) -> None:
        """Execute ``plan``'s state placements (R13-R16) in this step; ``carry``: when each
        group's parameter is ready, in this step's clock (what the step before left under way).
        Before the first event."""
        assert self.next_event == 0, "state scheduled after the step started"
        self.st = StateExecution(self, plan, carry)
        if self.host_budget is not None:  # R11: the swapped activations have what the state leaves of it
            self.host_budget -= self.st.result.host_bytes

    @property
    def done(self) -> bool:
        return self.next_event >= self.tb.n or self.oom_event is not None

    @property
    def stall_s(self) -> float:
        return self.stall_fwd + self.stall_bwd

    # ------------------------------------------------------------------ memory and copies
    def _note_mem(self, transient: int = 0) -> None:  # transient: bytes held this instant only (R3)
        m = self.static + self.cur_other + self.used + transient
        self.peak = max(self.peak, m)
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
        if self.st is not None:
            self.st.retire(now)
            self.st.admit()

    def _start_swapin(self, k: int, at: float) -> None:
        """Allocate ``k``'s bytes at ``at`` and queue its copy on the host->device engine (R6)."""
        b = self.tb.bytes[k]
        self.used += b
        self._note_mem()
        self.host_debt += self.issue + b * self.per_byte
        start, end = self.engines.span(False, max(at, self.out_done[k]), b)
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

    def _make_room(self, need: int, event: int, keep: int = -1) -> bool:
        """Compute needs ``need`` more bytes now: wait for in-flight swap-outs (R4). False on OOM."""
        limit = self.budget - self.static - self.cur_other
        while self.used + need > limit:
            if self.d2h_q:
                self._wait_until(self._complete_one_swapout(), event)
            elif self.st is not None and self.st.give_room(event):
                continue  # R13/R15: the state's own copies out, or a stream-in taken back
            elif not (self.guard and self._guard_evict(event, keep)):
                self.oom_event = event
                return False
        return True

    def _guard_evict(self, event: int, keep: int) -> bool:
        """R4, guard, as the runtime's: of the tensors on the device (resident, or swapped in
        ahead of use) other than ``keep``, the one whose first unpack is farthest after ``event``
        (MIN) goes. A resident one is swapped out (its bytes go once the program lets go too,
        R2); a prefetch is taken back: its copy lands, then its buffer goes, the host copy being
        whole. Either comes back on demand (R5a). False where there is none."""
        fu, loc = self.trace.first_unpack, self.loc
        best, far = -1, event
        host_room = math.inf if self.host_budget is None else self.host_budget - self.host_used
        for k in range(len(loc)):
            if ((loc[k] == RESIDENT and self.tb.bytes[k] <= host_room) or loc[k] == IN) and k != keep and fu[k] > far:
                best, far = k, int(fu[k])  # R11: a swap-out needs room on the host
        if best < 0:
            return False
        self.guard_evictions += 1
        if loc[best] == IN:
            self._wait_until(self.in_done[best], event)
            loc[best] = HOST
            self.used -= self.tb.bytes[best]
        else:
            self._issue_swapout(best)
        return True

    def _issue_swapout(self, k: int) -> None:
        """R6: ``k``'s swap-out, queued on the device-to-host engine behind the ones in flight."""
        b = self.tb.bytes[k]
        self.host_used += b  # R11: held on the host until the step ends
        if self.host_used > self.host_peak:
            self.host_peak = self.host_used
        start, end = self.engines.span(True, self.t, b)
        self.out_done[k] = end
        self.loc[k] = OUT
        self.host_debt += self.issue + b * self.per_byte
        self.d2h_q.append((end, k))
        self.d2h_bytes += b
        if self.record:
            self._d2h.append((start, end, k))

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

    def _bring_back(self, k: int, event: int) -> bool:
        """R5(a): compute needs ``k`` at ``event``: wait for its swap-in, or start one on demand
        (ahead of the prefetches still waiting for room). False on OOM."""
        s = self.loc[k]
        if s == WAITING:  # on demand goes ahead of prefetches still waiting for room
            self.waiting.remove(k)
            s = HOST
        if s in (HOST, OUT):
            if not self._make_room(self.tb.bytes[k], event):
                return False
            self._start_swapin(k, self.t)
        self._wait_until(self.in_done[k], event)
        self.loc[k] = RESIDENT
        self._drain(self.t)
        return True

    def _recompute(self, s: int, event: int) -> bool:
        """R9 at ``event``: the block's input (its anchor) must be on the device (R5a), room is made for
        the members it rebuilds (R4), then the compute stream runs the block's forward again. False on OOM."""
        sg = self.tb.segments[s]
        loc, b = self.loc, self.tb.bytes
        if loc[sg.anchor] != RESIDENT and not self._bring_back(sg.anchor, event):
            return False
        rebuilt = [k for k in sg.members if loc[k] == DROPPED]
        forward_s = sg.cheap_forward_s if self.selective[s] else sg.forward_s
        need = sum(b[k] for k in rebuilt)
        # R3: between two gaps it holds of their other bytes what lives across both, and what its
        # forward holds beyond its members (Segment.transient_bytes); the recompute reads the anchor
        gap_other, self.cur_other = self.cur_other, min(self.cur_other, self.tb.other[event + 1] if event + 1 < self.tb.n else 0)
        if not self._make_room(need + sg.transient_bytes, event, keep=sg.anchor):
            return False
        self.used += need
        self._note_mem(sg.transient_bytes)
        self.cur_other = gap_other
        for k in rebuilt:
            loc[k] = RESIDENT
        if self.host_debt:
            self._pay_host()
        if self.record:
            self._recomputes.append((self.t, self.t + forward_s, s))
        self.t += forward_s
        self.recompute_s += forward_s
        self._drain(self.t)
        return True

    def _wait_until(self, done: float, event: int) -> None:
        """Compute waits for a copy that ends at ``done``. The host work it owes comes first: the
        runtime issues its copies inside the hooks, so that work is spent before the thread blocks
        and overlaps the wait."""
        if self.host_debt:
            self._pay_host()
        if done > self.t:
            self._stall(done - self.t, event)

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
    def _hook_cost(self) -> float:
        """What the runtime's hooks cost each event: nothing where the plan moves nothing (the
        runtime runs it without hooks). (A recomputed block's members never pass the runtime's
        hooks, R9; charged all the same, see DESIGN R6/R8 "the hooks' cost".)"""
        st = self.st
        return self.hook if any(self.out_at) or (st is not None and any(w != "device" for w in st.where)) else 0.0

    def run_until(self, stop: int) -> None:
        """Process events ``next_event .. stop-1`` (R4, R5)."""
        tb = self.tb
        if self.hook_now is None:
            self.hook_now = self._hook_cost()
        stop = min(stop, tb.n)
        loc = self.loc
        while self.next_event < stop and self.oom_event is None:
            i = self.next_event
            # -- the gap before event i: room to produce its new tensors (R4)
            self._drain(self.t)
            self.cur_other = tb.other[i]
            if self.st is not None and not self.st.before_gap(i):
                return
            if (tb.alloc[i] or self.cur_other) and not self._allocate(i):
                return
            if self.host_debt:
                self._pay_host()
            gap = tb.gaps[i] + self.hook_now
            if self.record:
                self._compute.append((self.t, self.t + gap))
            self.t += gap
            self._drain(self.t)
            if self.st is not None:
                self.st.after_gap(i)
            # -- the program lets go of tensors after this gap, and nodes that ran free theirs (R2)
            for k in tb.freed_late[i]:
                self._let_go(self.held_late, k)
            for k in tb.release[i]:
                self.released[k] = True
                self._let_go(self.held_after_copy, k)
                if self.any_recompute:
                    s = tb.member_of[k]
                    if s >= 0 and self.recomputed[s] and loc[k] == RESIDENT and (not self.selective[s] or tb.cheap[k]):
                        # R9: a checkpointed block keeps no saved copy: it goes when the program lets go
                        loc[k] = DROPPED
                        self.used -= tb.bytes[k]
                        if self.waiting:
                            self._admit(self.t)
            # -- R9: backward reaches a recomputed block: rebuild its members before the event
            if self.any_recompute and tb.recompute_at[i]:
                for s in tb.recompute_at[i]:
                    if self.recomputed[s] and not self._recompute(s, i):
                        return
            if self.st is not None and not self.st.at_unpack(i):
                return
            # -- (a) an unpack of a tensor that is not resident waits for its swap-in (R5a)
            if tb.is_unpack[i] and loc[tb.tensor[i]] != RESIDENT and not self._bring_back(tb.tensor[i], i):
                return
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
                if self.guard_evictions and loc[k] != RESIDENT:
                    continue  # the guard evicted it already (R4, guard): the runtime skips it too
                assert loc[k] == RESIDENT, "swap-out of a tensor that is not resident (plan breaks R7)"
                if self.host_budget is not None and self.host_used + tb.bytes[k] > self.host_budget:
                    self.host_skipped += 1  # R11: no room on the host: it stays on the device
                    continue
                self._issue_swapout(k)
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
        ideal = self.trace.ideal_s  # plain training: no hook of the runtime's
        st = self.st
        if st is not None:
            ideal += st.ideal_step_s  # R15: the ideal step steps every group on the device
        if not oom:
            if self.host_debt:
                self._pay_host()
            self.t += self.trace.tail_compute_s
            if self.record:
                self._compute.append((self.t - self.trace.tail_compute_s, self.t))
            if st is not None and not st.finish():
                oom = True
            elif self.host_debt:  # the state's copies and hooks after the tail (state_exec._copy)
                self._pay_host()
        timeline = None
        if self.record:
            timeline = Timeline(tuple(self._mem), tuple(self._compute), tuple(self._d2h), tuple(self._h2d), tuple(self._stalls),
                                tuple(self._recomputes), *(st.spans() if st is not None else ((), (), (), (), ())))
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
            recompute_s=self.recompute_s,
            guard_evictions=self.guard_evictions,
            host_peak_bytes=int(self.host_peak) + (st.result.host_bytes if st is not None else 0),
            host_skipped=self.host_skipped,
            state=None if st is None else st.cost(),
            host_ranks=self.hw.ranks_per_host if self.trace.world_size > 1 else 1,
        )


def simulate(trace: Trace, plan: SwapPlan | list[Eviction] | tuple[Eviction, ...], hardware: Hardware, budget: int, *,
             record: bool = False, validate: bool = True, recompute: Sequence[int] = (),
             selective: Sequence[int] = (), guard: bool = False) -> SimResult:
    """Simulate one step of ``trace`` executing ``plan`` under ``budget`` bytes on ``hardware``.
    ``recompute``/``selective``: with a list of evictions, the blocks (indices into
    ``trace.segments``) to recompute whole or selectively. ``guard``: where the plan leaves no
    room, evict as the live runtime's guard does (R4, guard) instead of stopping at OOM: the step
    the runtime would execute, not a judgement of the plan."""
    if isinstance(plan, SwapPlan):
        whole, blocks, selective = plan, plan.recomputed(trace), plan.recomputed_selectively(trace)
    else:
        names = [trace.segments[s].name for s in recompute], [trace.segments[s].name for s in selective]
        whole = SwapPlan(trace.name, "?", tuple(plan), recompute=tuple(names[0]), selective=tuple(names[1]))
        blocks = list(recompute)
    if validate:
        whole.validate(trace)

    def step(carry: dict[int, float] | None) -> tuple[SimResult, StateExecution | None]:
        sim = Simulation(trace, hardware, budget, record=record, guard=guard)
        sim.out_at, sim.prefetch_at = whole.by_event(trace.n_events)  # what schedule() builds one eviction at a time
        for s in blocks:
            sim.schedule_recompute(s)
        for s in selective:
            sim.schedule_recompute(s, selective=True)
        if trace.state:
            sim.schedule_state(whole, carry)
        return sim.finish(), sim.st

    return run_to_steady_state(step)
