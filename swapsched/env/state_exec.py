"""The state plan inside the simulated step (R13-R16): parameters fetched and let go, gradients
copied out, the optimizer's state streamed, the host's optimizer step, and what one step leaves
the next.

:class:`StateExecution` is driven by :class:`~swapsched.env.simulator.Simulation` at four points
of its loop (before a gap, at an event's unpack, after a gap, after the tail) and shares its
clock, its device memory (``used``, R3) and its copy engines (R6): a state copy queues behind
the activations' copies in its direction, and a state fetch that has no room waits like a
prefetch. What each placement holds where, and when a group is fetched, is
``state_parts.py``'s.

A fetch the compute reaches first is waited for, as an unpack waits for its swap-in (R5a); on
demand where it was never issued.

The step ends when the compute stream is done: forward, backward, the tail and the device's
optimizer steps (R15: each group's parameters over the device's rate, ``optimizer_rates``, a
streamed group once its state has arrived). What the host still does then (its steps, the
parameters' copies back) runs into the next step: :attr:`carry` is when each group's parameter
is ready, in the next step's clock (R16); :func:`~swapsched.env.simulator.simulate` runs the
step again from that carry until it repeats (the steady state).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from swapsched.env.collectives import Collectives
from swapsched.env.disk_tier import DiskTier
from swapsched.env.result import SimResult, StateCost
from swapsched.env.state_parts import (
    STREAM_IN_PARTS,
    STREAM_OUT_PARTS,
    by_event,
    fetch_events,
    held,
    keeps_gradient,
    optimizer_rates,
    part_bytes,
    state_split,
    stream_in_bytes,
)
from swapsched.plan import SwapPlan

__all__ = ["StateExecution", "StateResult", "run_to_steady_state", "STEADY_STATE_ROUNDS"]

#: R16: the most steps simulated one after another to reach the steady state of a plan that
#: leaves work under way into the next step (the host's optimizer steps and parameters' copies)
STEADY_STATE_ROUNDS = 6

class StateResult:
    """What the state cost a simulated step (folded into ``SimResult``)."""

    def __init__(self) -> None:
        self.param_off = self.grad_off = self.optim_off = 0  # bytes placed off the device
        self.host_bytes = 0
        self.host_step_s = 0.0
        self.device_step_s = 0.0
        self.skipped = 0  # groups the host budget could not hold: kept on the device (R11)
        self.stall_s = 0.0


class StateExecution:
    """The state plan of one simulated step (module docstring)."""

    def __init__(self, sim: Any, plan: SwapPlan, carry: dict[int, float] | None = None):
        # ``sim``: the Simulation driving this (env/simulator.py, which imports this module):
        # its clock, memory, engines and R4/R5 waits
        trace, hw = sim.trace, sim.hw
        self.sim = sim
        self.groups = trace.state
        self.host_after_backward = plan.host_step == "after-backward"
        self.return_all = plan.param_return == "all"
        placement = plan.placement()
        self.device_rate, self.host_rate = optimizer_rates(trace, hw)
        self.result = StateResult()
        self.carry = dict(carry or {})  # group -> time its parameter is ready on the host/device (this step's clock)
        # R19 then R11: what the disk and host budgets hold of the plan (state_parts.held)
        h = held(self.groups, placement, plan.on_disk(), hw)
        self.disk = DiskTier(self.groups, h, hw, self.carry)
        self.where: list[str] = list(h.where)
        r = self.result
        r.skipped, r.host_bytes = h.skipped, h.host
        for g, w in zip(self.groups, self.where, strict=True):
            if w in ("param", "full", "stream-full"):
                r.param_off += g.param_bytes
            if w in ("host-step", "full", "stream-full"):
                r.grad_off += g.grad_bytes
            if w in ("host-step", "full", "stream", "stream-full"):
                r.optim_off += g.optim_bytes
        n = sim.tb.n
        self.next_carry: dict[int, float] = {}
        self.resident = [w in ("device", "param", "host-step", "stream") for w in self.where]  # its parameter
        self.fetch_done: list[float | None] = [None] * len(self.groups)  # an issued fetch's end
        self.waiting: list[int] = []  # fetches issued with no room yet (R6), in issue order
        self.frees: list[tuple[float, int]] = []  # (done, bytes): copies out whose bytes go when they land
        self.optim_done: dict[int, float] = {}  # streamed groups: their stream-in's end
        self.optim_waiting: list[int] = []
        # stream-ins admitted ahead of their device step (the last admitted last), and those the
        # compute took back for room, which wait for backward's end (R15)
        self.admitted: list[int] = []
        self.deferred: set[int] = set()
        self.backward_over = False
        self.not_before: dict[int, float] = {}  # stream-full: its stream-in reads the gradient once it landed
        self.grad_on_host: dict[int, float] = {}  # host-stepped groups: when the gradient landed
        self.returns: list[tuple[float, int]] = []  # (issue time, group): parameters going back (R16)
        self.host_free = 0.0
        # what --plot draws (sim.record): the state's copies and the host's steps
        self.d2h_spans: list[tuple[float, float, int]] = []
        self.h2d_spans: list[tuple[float, float, int]] = []
        self.host_spans: list[tuple[float, float, int]] = []
        # per event: whose forward starts, ends, backward starts, gradient completes; fetches issued
        self.fwd_at = by_event(n + 1, [(g.forward_at, j) for j, g in enumerate(self.groups)])
        self.fwd_end = by_event(n + 1, [(g.forward_end, j) for j, g in enumerate(self.groups)])
        self.bwd_at = by_event(n + 1, [(g.backward_at, j) for j, g in enumerate(self.groups)])
        self.grad_at = by_event(n + 1, [(g.grad_at, j) for j, g in enumerate(self.groups)])
        fwd, bwd = fetch_events(self.groups, self.where, min(sim.tb.backward_start, n))
        self.fetch_fwd_at = by_event(n + 1, [(i, j) for j, i in fwd.items()])
        self.fetch_bwd_at = by_event(n + 1, [(i, j) for j, i in bwd.items()])
        # the static part of the state (module docstring) is in sim.static; the parameters of
        # ``param`` groups are on the device as the step starts
        born = trace.state_gradients_born  # R3: each gradient from its group's backward on, not static
        static, _ = state_split(self.groups, {g.name: w for g, w in zip(self.groups, self.where, strict=True)}, born=born)
        sim.static = int(trace.fixed_bytes + static)
        for j, w in enumerate(self.where):
            if w == "param":
                sim.used += self.groups[j].param_bytes
        sim.peak = sim.static + sim.used
        if sim.record:
            sim._mem = [(0.0, sim.static + sim.used)]
        # made on the device as backward reaches the group: copied out as it completes (the host
        # steps it), or, born in the step under the other placements, held to the step's end
        self.grad_dynamic = [born or w in ("host-step", "full", "stream-full") for w in self.where]
        # R3: the gradients yet to be born that their placement keeps: a stream-in admitted ahead
        # leaves them room (taken back from it, it would wait for backward's end, R15)
        self.unborn_kept = sum(g.grad_bytes for g, w in zip(self.groups, self.where, strict=True)
                               if born and keeps_gradient(w))
        # R18: a sharded step's all-gathers and reduce-scatters (env/collectives.py)
        self.coll: Collectives | None = None
        if trace.world_size > 1:
            self.coll = Collectives(sim, set(plan.unsharded), self.frees, self._shard_ready)

    def _shard_ready(self, j: int) -> float:
        """When group ``j``'s shard is on the device for its all-gather (R18)."""
        done = self.fetch_done[j]
        return done if done is not None else self.carry.get(j, 0.0) if self.where[j] == "full" else 0.0

    # ------------------------------------------------------------------ copies and memory
    def _copy(self, direction: str, nbytes: int, at: float, group: int = -1) -> float:
        """A state copy on the engine of ``direction`` (R6, FIFO behind what is queued); its end.
        The host issues a copy per parameter tensor of the group, each costing it what an
        activation's does (R6/R8's host costs), paid before the compute thread next computes or waits."""
        sim = self.sim
        sim.host_debt += sim.issue * (self.groups[group].tensors if group >= 0 else 1) + nbytes * sim.per_byte
        start, end = sim.engines.span(direction == "d2h", at, nbytes)
        if direction == "d2h":
            sim.d2h_bytes += nbytes
        else:
            sim.h2d_bytes += nbytes
        if sim.record:
            (self.d2h_spans if direction == "d2h" else self.h2d_spans).append((start, end, group))
        return end

    def _out(self, nbytes: int, group: int = -1) -> float:
        """Copy ``nbytes`` of the device's state to the host; they go when the copy lands (its end)."""
        end = self._copy("d2h", nbytes, self.sim.t, group)
        heapq.heappush(self.frees, (end, nbytes))
        return end

    def _in(self, j: int, nbytes: int, at: float, parts: tuple[str, ...] | None = None) -> float:
        """Copy ``nbytes`` of group ``j`` to the device once they are on the host (``at``): R19,
        those of ``parts`` (else all) resting on the disk are read into staging first; its end."""
        on_disk = self.disk.nbytes(j, parts)
        if on_disk:
            at = max(at, self.disk.read(j, on_disk))
        end = self._copy("h2d", nbytes, at, j)
        if on_disk:
            self.disk.release(end)
        return end

    def retire(self, now: float) -> None:
        """Copies out that landed by ``now`` give their bytes back (called from the sim's drain)."""
        while self.frees and self.frees[0][0] <= now:
            self.sim.used -= heapq.heappop(self.frees)[1]

    def wait_one_free(self, event: int) -> bool:
        """R4 with state copies in flight: wait for the earliest to land. False where none is."""
        if not self.frees:
            return False
        done, nbytes = heapq.heappop(self.frees)
        self.sim._wait_until(done, event)
        self.sim.used -= nbytes
        return True

    def _fetch(self, j: int, on_demand: bool = False, event: int = 0) -> bool:
        """Issue group ``j``'s parameter fetch (R14): its bytes are allocated now, or it waits
        for room in issue order (R6); on demand, room is made as for compute (R4). False on OOM."""
        sim, b = self.sim, self.groups[j].param_bytes
        room = sim.budget - sim.static - sim.cur_other - sim.used
        if on_demand:
            if not sim._make_room(b, event):
                return False
        elif b > room or self.waiting:
            self.waiting.append(j)
            return True
        sim.used += b
        sim._note_mem()
        self.fetch_done[j] = self._in(j, b, max(sim.t, self.carry.get(j, 0.0)), ("param_bytes",))
        return True

    def admit(self) -> None:
        """Waiting fetches get room in issue order (R6), then waiting state streams."""
        sim = self.sim
        while self.waiting:
            j = self.waiting[0]
            if self.groups[j].param_bytes > sim.budget - sim.static - sim.cur_other - sim.used:
                return
            self.waiting.pop(0)
            self._fetch(j)
        while self.optim_waiting:
            j = self.optim_waiting[0]
            b = self._stream_in_bytes(j)
            if b > sim.budget - sim.static - sim.cur_other - sim.used - self.unborn_kept or not self.backward_over and (
                    j in self.deferred or self.host_after_backward):  # the runtime streams at optimizer.step()
                return
            self.optim_waiting.pop(0)
            sim.used += b
            sim._note_mem()
            self.admitted.append(j)
            self.optim_done[j] = self._in(j, b, max(sim.t, self.not_before.get(j, 0.0)))

    def give_room(self, event: int) -> bool:
        """R4 with the state placed: the compute needs room; a state copy out in flight lands
        (waited for), else a stream-in admitted ahead gives its room back. False where neither."""
        return self.wait_one_free(event) or self.reclaim_stream_in()

    def reclaim_stream_in(self) -> bool:
        """R15: the compute needs room that a stream-in admitted ahead of its device step holds:
        the last admitted goes (its bytes once its copy lands) and comes in again after
        backward. False where none is admitted."""
        if not self.admitted:
            return False
        j = self.admitted.pop()
        heapq.heappush(self.frees, (self.optim_done.pop(j), self._stream_in_bytes(j)))
        self.optim_waiting.insert(0, j)  # its gradient completed before those still waiting
        self.deferred.add(j)
        return True

    def _stream_in_bytes(self, j: int) -> int:
        return stream_in_bytes(self.groups[j], self.where[j])

    def _need(self, j: int, event: int) -> bool:
        """Compute uses group ``j``'s parameter now: wait for its fetch, issuing it on demand if
        it was never issued or still waits for room (R5a). False on OOM."""
        if self.resident[j]:
            return True
        if j in self.waiting:
            self.waiting.remove(j)
        if self.fetch_done[j] is None and not self._fetch(j, on_demand=True, event=event):
            return False
        done = self.fetch_done[j]
        assert done is not None
        before = self.sim.t
        self.sim._wait_until(done, event)
        self.result.stall_s += self.sim.t - before
        self.resident[j] = True
        self.fetch_done[j] = None
        return True

    # ------------------------------------------------------------------ the loop's four points
    def before_gap(self, i: int) -> bool:
        """Gradients complete at ``i`` go out (or their state comes in); forward's uses of the
        gap are made ready; the forward fetches planned here are issued. False on OOM."""
        self._returns_due()
        for j in self.grad_at[i]:
            self._grad_complete(j)
        for j in self.fwd_at[i]:
            w = self.where[j]
            if w == "host-step" and self.carry.get(j, 0.0) > self.sim.t:  # R16: the update is not back yet
                before = self.sim.t
                self.sim._wait_until(self.carry[j], i)
                self.result.stall_s += self.sim.t - before
            if w in ("full", "stream-full") and not self._need(j, i):
                return False
        for j in self.fetch_fwd_at[i]:
            if not self.resident[j] and self.fetch_done[j] is None and j not in self.waiting and not self._fetch(j):
                return False
        return self.coll is None or self.coll.before_gap(i, self.fwd_at[i])

    def at_unpack(self, i: int) -> bool:
        """Backward reaches the groups whose backward starts at ``i``: their parameters must be
        here, and their gradients are allocated; the backward fetches planned here are issued."""
        sim = self.sim
        for j in self.bwd_at[i]:
            if not self._need(j, i):
                return False
            if self.grad_dynamic[j]:
                b = self.groups[j].grad_bytes
                if not sim._make_room(b, i):
                    return False
                sim.used += b
                sim._note_mem()
                if keeps_gradient(self.where[j]):
                    self.unborn_kept -= b
        for j in self.fetch_bwd_at[i]:
            if not self.resident[j] and self.fetch_done[j] is None and j not in self.waiting and not self._fetch(j):
                return False
        return self.coll is None or self.coll.at_unpack(i, self.bwd_at[i])

    def after_gap(self, i: int) -> None:
        """Forward is done with the groups whose forward ends at ``i``."""
        if self.coll is not None:
            self.coll.after_gap(self.fwd_end[i])
        for j in self.fwd_end[i]:
            w = self.where[j]
            if w == "param":  # the updated parameter goes to the host, where backward fetches it from
                self.resident[j] = False
                self._out(self.groups[j].param_bytes, j)
            elif w in ("full", "stream-full"):  # the host's copy is the master: nothing to copy
                self.resident[j] = False
                self.sim.used -= self.groups[j].param_bytes
        if self.frees or self.waiting or self.optim_waiting:
            self.retire(self.sim.t)
            self.admit()

    def _grad_complete(self, j: int) -> None:
        w = self.where[j]
        g = self.groups[j]
        if w != "device":  # R6/R8 with R13: the mover's hooks' bookkeeping for the group's tensors this step
            self.sim.host_debt += self.sim.hw.state_hook_s * g.tensors
        if g.frozen:  # no gradient and no step (R13): backward is done with its parameters
            if w == "full":
                self.resident[j] = False
                self.sim.used -= g.param_bytes
            return
        # R18: sharded, the rank's shard of the gradient is there once its reduce-scatter lands
        ready = self.sim.t if self.coll is None else self.coll.grad_complete(j)
        if w in ("host-step", "full", "stream-full"):
            end = self._copy("d2h", g.grad_bytes, ready, j)
            heapq.heappush(self.frees, (end, g.grad_bytes))
            if w in ("full", "stream-full"):  # backward is done with it
                self.resident[j] = False
                self.sim.used -= g.param_bytes
            if w == "stream-full":
                self.not_before[j] = end
                self.optim_waiting.append(j)
                self.admit()
                return
            self.grad_on_host[j] = end
            if not self.host_after_backward:
                self._host_step(j, end)
        elif w == "stream":
            self.optim_waiting.append(j)
            self.admit()

    def _host_step(self, j: int, ready: float) -> None:
        """R15: the host steps group ``j`` once its gradient is there and the host is free; R19:
        and once what of it rests on the disk is read, written back after the step."""
        start = max(self.host_free, ready)
        on_disk = self.disk.nbytes(j)
        if on_disk:
            start = max(start, self.disk.read(j, on_disk))
        end = start + self.groups[j].params / self.host_rate
        if on_disk:
            self.disk.write(j, on_disk, end, held=True)
        self.result.host_step_s += end - start
        self.host_free = end
        if self.sim.record:
            self.host_spans.append((start, end, j))
        if self.where[j] == "host-step" and not self.return_all:
            self.returns.append((end, j))
        elif self.where[j] == "full":
            self.next_carry[j] = end  # the next forward's fetch reads the updated master copy

    def _returns_due(self) -> None:
        """Parameters whose host step finished by now go back (R16), in order."""
        if not self.returns:
            return
        self.returns.sort()
        while self.returns and self.returns[0][0] <= self.sim.t:
            at, j = self.returns.pop(0)
            self.next_carry[j] = self._copy("h2d", self.groups[j].param_bytes, at, j)

    def finish(self) -> bool:
        """After the tail: the gradients complete there, the device's optimizer steps (R15), the
        host's steps after backward, the parameters' copies back; what the next step inherits
        (:attr:`next_carry`, in its clock). False on OOM."""
        sim = self.sim
        n = sim.tb.n
        for j in self.grad_at[n]:
            self._grad_complete(j)
        if self.coll is not None:
            self.coll.drain(n)
        self.backward_over = True
        end_backward = sim.t
        order = sorted(range(len(self.groups)), key=lambda j: (self.groups[j].grad_at, -self.groups[j].forward_at))
        for j in order:  # the device's steps, on the compute stream
            w = self.where[j]
            if w not in ("device", "param", "stream", "stream-full") or self.groups[j].frozen:
                continue
            streamed = w in STREAM_IN_PARTS
            if streamed:
                if j in self.optim_waiting:
                    self.optim_waiting.remove(j)
                    b = self._stream_in_bytes(j)
                    if not sim._make_room(b, max(n - 1, 0)):
                        return False
                    sim.used += b
                    sim._note_mem()
                    self.optim_done[j] = self._in(j, b, max(sim.t, self.not_before.get(j, 0.0)))
                if j in self.admitted:
                    self.admitted.remove(j)
                before = sim.t
                sim._wait_until(self.optim_done[j], n)
                self.result.stall_s += sim.t - before
            dt = self.groups[j].params / self.device_rate
            sim.t += dt
            self.result.device_step_s += dt
            if streamed:
                g = self.groups[j]
                if w == "stream-full":
                    sim.used -= g.grad_bytes  # the step has read it
                landed = self._out(part_bytes(g, STREAM_OUT_PARTS[w]), j)
                on_disk = self.disk.nbytes(j)
                if on_disk:  # R19: on through staging to the disk
                    self.disk.write(j, on_disk, landed)
            self.retire(sim.t)
            self.admit()
        if self.host_after_backward:
            for j in sorted(self.grad_on_host, key=lambda j: self.grad_on_host[j]):
                self._host_step(j, max(self.grad_on_host[j], end_backward))
        if self.return_all:
            done = self.host_free
            for j, w in enumerate(self.where):
                if w == "host-step":
                    self.returns.append((done, j))
        # the parameters' copies back are issued as their steps end, whenever that is (R16)
        for at, j in sorted(self.returns):
            self.next_carry[j] = self._copy("h2d", self.groups[j].param_bytes, at, j)
        self.returns.clear()
        return True

    @property
    def ideal_step_s(self) -> float:
        """R15: every group stepped on the device, as the ideal (infinite memory) step does."""
        return sum(g.params for g in self.groups if not g.frozen) / self.device_rate

    def spans(self) -> tuple[tuple[tuple[float, float, int], ...], ...]:
        """What ``--plot`` draws (``Timeline``'s state rows): copies out, copies in, host steps,
        the disk's reads and writes."""
        return (tuple(self.d2h_spans), tuple(self.h2d_spans), tuple(self.host_spans), tuple(self.disk.reads),
                tuple(self.disk.writes))

    def cost(self) -> StateCost:
        r = self.result
        c = self.coll
        d = self.disk
        return StateCost(r.param_off, r.grad_off, r.optim_off, r.host_bytes, r.host_step_s, r.device_step_s, r.stall_s,
                         r.skipped, *((0.0, 0.0, 0, 0) if c is None else (c.busy_s, c.stall_s, c.gathered_bytes, c.reduced_bytes)),
                         disk_bytes=d.disk_bytes, disk_read_bytes=d.read_bytes, disk_written_bytes=d.written_bytes,
                         staging_bytes=d.staging_bytes, disk_skipped=d.skipped)

    def carry_for_next(self, step_s: float) -> dict[int, float]:
        """When each group's parameter is ready in the next step's clock (R16): only what is
        still under way when this step ends."""
        # R19: and when each group's copy on the disk is current (``disk_tier``'s keys)
        return {j: t - step_s for j, t in {**self.next_carry, **self.disk.next_ready}.items() if t > step_s}


def run_to_steady_state(step: Callable[[dict[int, float] | None], tuple[SimResult, StateExecution | None]]) -> SimResult:
    """R16: ``step(carry)`` simulates one step from what the last left under way; run it again
    from there until the step repeats (a training loop's steady state), at most
    ``STEADY_STATE_ROUNDS`` times. A step with no state, out of memory, or leaving nothing under
    way with nothing come in, is its own steady state."""
    carry: dict[int, float] | None = None
    for _ in range(STEADY_STATE_ROUNDS):
        result, st = step(carry)
        if st is None or result.oom:
            return result
        nxt = st.carry_for_next(result.iteration_s)
        if not nxt and not carry:
            return result
        if carry is not None and nxt.keys() == carry.keys() and all(abs(nxt[j] - carry[j]) <= 1e-9 * (1 + result.iteration_s)
                                                                    for j in nxt):
            return result
        carry = nxt
    return result
