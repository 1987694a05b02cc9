"""R18: a sharded step's collectives inside the simulated step (one rank; ranks are symmetric,
so its step is the job's).

:class:`Collectives` is driven by :class:`~swapsched.env.state_exec.StateExecution` at its points
of the loop, for a trace of ``world_size`` > 1 (``swapsched/sharding.py``). Each unit (state
group) is all-gathered and reduce-scattered on one collective stream of its own, FIFO, which
overlaps the compute and the copy engines: the all-gathers on one stream and the
reduce-scatters on another, each FIFO, as FSDP2 issues them (a reduce-scatter never waits
behind an all-gather still waiting for its shard); a collective of ``S`` bytes over ``N``
ranks takes ``collective_latency_s + S (N - 1) / N / Hardware.collective_rate(N)``.

- **Forward**: a unit's all-gather is issued one unit ahead, as FSDP2's implicit prefetch does
  (as the previous unit's forward starts; the first as the step starts), and waited for before
  its forward's first gap; its unsharded parameters (``gather_bytes``) are allocated as it is
  issued, where they fit, else gathered on demand at its use (R4 makes room then).
- **After forward**: the unsharded parameters go (``reshard_after_forward=True``), or stay to
  the unit's backward (a unit the plan keeps unsharded, ``SwapPlan.unsharded``).
- **Backward**: a resharded unit is all-gathered again, one ahead in backward's order (the
  first as backward starts), and waited for at its ``backward_at``, where its unsharded
  gradient (``reduce_bytes``) is allocated. As its gradient completes (``grad_at``) the
  unsharded parameters go and its reduce-scatter is issued; the unsharded gradient goes when
  that lands, and the rank's shard of it is ready then (a host placement copies it out after).
- **The step's end**: the optimizer steps once every reduce-scatter has landed (FSDP2's
  post-backward callback waits for them).

A unit whose shard lives on the host (``full``, ``stream-full``) is gathered once its shard's
fetch has landed (FSDP2's ``CPUOffloadPolicy`` copies the shard in, then all-gathers it).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from swapsched.env.state_parts import by_event, one_ahead

__all__ = ["Collectives", "gather_events", "unsharded_deltas"]


class Collectives:
    """The all-gathers and reduce-scatters of one rank's step (module docstring). ``sim``: the
    Simulation (clock, memory, R4); ``frees``: the heap of (time, bytes) the state's copies out
    give back as they land, which the reduce-scatters share; ``shard_ready(j)``: when unit
    ``j``'s shard is on the device (its fetch's end, or now)."""

    def __init__(self, sim: Any, keep: set[str], frees: list[tuple[float, int]],
                 shard_ready: Callable[[int], float]) -> None:
        trace, hw = sim.trace, sim.hw
        self.sim, self.frees, self.shard_ready = sim, frees, shard_ready
        self.groups = trace.state
        world = trace.world_size
        self.share = (world - 1) / world
        self.rate = hw.collective_rate(world)
        self.lat = hw.collective_latency_s
        self.keep = {j for j, g in enumerate(trace.state) if g.name in keep}
        self.free = {"gather": 0.0, "reduce": 0.0}  # each collective stream's clock
        n = len(self.groups)
        self.unsharded = [False] * n  # the unit's unsharded parameters are allocated
        self.done: list[float | None] = [None] * n  # an issued all-gather's end
        self.gathered_bytes = self.reduced_bytes = 0
        self.busy_s = 0.0
        self.stall_s = 0.0
        self.spans: list[tuple[float, float, int]] = []
        events = sim.tb.n
        fwd, bwd = gather_events(trace, keep)
        self.issue_fwd = by_event(events + 1, [(i, j) for j, i in fwd.items()])
        self.issue_bwd = by_event(events + 1, [(i, j) for j, i in bwd.items()])

    # ------------------------------------------------------------------ the stream
    def _collective(self, stream: str, nbytes: int, at: float, group: int) -> float:
        """One collective of ``nbytes`` (unsharded) ready at ``at``, FIFO on ``stream``; its end."""
        start = max(at, self.free[stream])
        end = start + self.lat + nbytes * self.share / self.rate
        self.busy_s += end - start
        self.free[stream] = end
        if self.sim.record:
            self.spans.append((start, end, group))
        return end

    def gather(self, j: int, on_demand: bool = False, event: int = 0) -> bool:
        """Issue unit ``j``'s all-gather (its bytes allocated now); a prefetch with no room
        waits to be gathered on demand at the unit's use. False on OOM."""
        if self.unsharded[j]:
            return True
        sim, b = self.sim, self.groups[j].gather_bytes
        if on_demand:
            if not sim._make_room(b, event):
                return False
        elif b > sim.budget - sim.static - sim.cur_other - sim.used:
            return True
        sim.used += b
        sim._note_mem()
        self.unsharded[j] = True
        self.gathered_bytes += b
        self.done[j] = self._collective("gather", b, max(sim.t, self.shard_ready(j)), j)
        return True

    def need(self, j: int, event: int) -> bool:
        """Compute uses unit ``j``'s unsharded parameters now: wait for its all-gather (issued
        on demand where it was not). False on OOM."""
        if not self.unsharded[j] and not self.gather(j, on_demand=True, event=event):
            return False
        done = self.done[j]
        if done is not None and done > self.sim.t:
            before = self.sim.t
            self.sim._wait_until(done, event)
            self.stall_s += self.sim.t - before
        self.done[j] = None
        return True

    def reshard(self, j: int) -> None:
        """Unit ``j``'s unsharded parameters go."""
        if self.unsharded[j]:
            self.unsharded[j] = False
            self.done[j] = None
            self.sim.used -= self.groups[j].gather_bytes

    # ------------------------------------------------------------------ the loop's points
    def before_gap(self, i: int, forward_at: tuple[int, ...]) -> bool:
        for j in forward_at:
            if not self.need(j, i):
                return False
        for j in self.issue_fwd[i]:
            self.gather(j)  # a prefetch: never out of memory (it waits for its use instead)
        return True

    def after_gap(self, forward_end: tuple[int, ...]) -> None:
        for j in forward_end:
            if j not in self.keep:
                self.reshard(j)

    def at_unpack(self, i: int, backward_at: tuple[int, ...]) -> bool:
        sim = self.sim
        for j in backward_at:
            if not self.need(j, i):
                return False
            b = self.groups[j].reduce_bytes  # the unsharded gradient backward accumulates
            if not sim._make_room(b, i):
                return False
            sim.used += b
            sim._note_mem()
        for j in self.issue_bwd[i]:
            self.gather(j)
        return True

    def grad_complete(self, j: int) -> float:
        """Unit ``j``'s gradient is complete: its unsharded parameters go, its reduce-scatter is
        issued; returns when the rank's shard of the gradient is ready."""
        self.reshard(j)
        b = self.groups[j].reduce_bytes
        end = self._collective("reduce", b, self.sim.t, j)
        self.reduced_bytes += b
        heapq.heappush(self.frees, (end, b))
        return end

    def drain(self, event: int) -> None:
        """The step's end: the optimizer waits for every reduce-scatter."""
        before = self.sim.t
        self.sim._wait_until(self.free["reduce"], event)
        self.stall_s += self.sim.t - before


def gather_events(trace: Any, keep: set[str]) -> tuple[dict[int, int], dict[int, int]]:
    """R18: the event at which each unit's forward all-gather is issued, and each resharded
    unit's backward one: one unit ahead (module docstring); ``keep``: the units not resharded."""
    groups = trace.state
    return (one_ahead([(g.forward_at, j) for j, g in enumerate(groups)]),
            one_ahead([(g.backward_at, j) for j, g in enumerate(groups) if g.name not in keep],
                      min(trace.backward_start, trace.n_events)))


def unsharded_deltas(trace: Any, keep: set[str]) -> Any:
    """R18: the unsharded bytes a sharded step holds, as changes per event (``n_events + 1``
    entries, their running sum the bytes at each gap), as the module docstring times them with
    every all-gather on time: the activation planners' view of a sharded trace
    (``state_search.activation_view``). ``keep``: the units not resharded after forward."""
    import numpy as np

    n = trace.n_events
    delta = np.zeros(n + 1, dtype=np.int64)
    if trace.world_size == 1:
        return delta
    fwd_issue, bwd_issue = gather_events(trace, keep)
    for j, g in enumerate(trace.state):
        delta[fwd_issue[j]] += g.gather_bytes
        if g.name in keep:
            delta[max(g.grad_at, g.forward_end + 1)] -= g.gather_bytes
        else:
            delta[g.forward_end + 1] -= g.gather_bytes
            delta[bwd_issue[j]] += g.gather_bytes
            delta[max(g.grad_at, bwd_issue[j])] -= g.gather_bytes
        delta[min(g.backward_at, n)] += g.reduce_bytes
        delta[max(g.grad_at, g.backward_at)] -= g.reduce_bytes
    return delta
