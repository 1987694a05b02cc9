"""The executing step: a plan carried out event by event (R5, R7) from the saved-tensor hooks; its
copies and its room under the budget (R4, R6, R11, the guard) are ``copies.py``'s."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from swapsched.budget import format_bytes
from swapsched.env.events import FREED, HOST, IN, OUT, RESIDENT, event_tables
from swapsched.errors import present
from swapsched.runtime.casts import Recast, recast
from swapsched.runtime.copies import CopyingStep
from swapsched.runtime.layout import PlanLayout
from swapsched.runtime.profile_step import ProfileStep
from swapsched.runtime.recorder import is_parameter
from swapsched.runtime.reports import CollectiveTally, Divergence, DivergenceError, StepReport
from swapsched.runtime.stash import UNTRACKED, Packed, Record, rebuild
from swapsched.runtime.state_rest import HOST_PLACEMENTS

if TYPE_CHECKING:
    from swapsched.runtime.frame import StepFrame

__all__ = ["ExecuteStep"]

# as torch.utils.checkpoint's CheckpointError says how to find what differs
DIVERGENCE_TIP = ("To find why: runtime.trace.tensors[k] has the op and module that saved tensor k in the "
                  "profiled steps, to compare with what your step ran there. Shapes that vary between steps "
                  "(padded batches, a last partial batch) are planned per shape when strict is off; "
                  "control flow that depends on the data (an early exit, a layer skipped) gives each path "
                  "its own trace, profiled again on every switch")


class ExecuteStep(CopyingStep):
    """Steps 2..: execute the plan event by event (R5, R7): the hooks follow the layout's events,
    issue its swap-outs and prefetches, and leave the trace where the step does; the copies and the
    room under the budget they wait for (R4, R6, R11, the guard) are :class:`CopyingStep`'s."""

    __slots__ = ("layout", "out_at", "prefetch_at", "tensor_bytes", "frees", "expected", "work", "n_seen",
                 "first_sight", "gaps", "hook_s", "last_exit", "tail_s", "alloc", "other", "marks_in", "marks_out",
                 "mark_start", "mark_end", "scale", "profile", "started", "untracked", "may_unhook", "unhooked",
                 "issued_start", "issued_at", "waited_at", "plain_hook_s", "plain_events", "mover_at", "mover_in",
                 "mover_spent_start", "mover_waited_at", "state_host_s")

    def __init__(self, frame: StepFrame):
        super().__init__(frame)  # the copies' and the room's state (copies.py)
        self._load(present(frame.layout, "the plan's layout of an executing step"))
        # after a divergence: the largest ratio seen of a tensor's bytes to the trace's, by which
        # R4 scales the trace's next allocation (a batch of another size is one family, scaled)
        self.scale = 1.0
        # a step whose first saved tensor shows a shape no plan was made for is profiled instead
        # (it hands every hook call to this profiling step), and that shape is planned after it
        self.profile: ProfileStep | None = None
        # storages of this step the trace does not track (the profiling found someone else holds
        # them: the caller's batch), as (weak storage, bytes, key): a step that hands its hooks to
        # a profiling step passes on the ones seen so far, whose bytes its trace counts as static
        self.untracked: list[tuple[weakref.ref[Any], int, int]] = []
        self.started = time.perf_counter()
        # a plan that moves nothing needs no hooks: where this shape's plan evicts nothing and its
        # steps have followed it, the step's first saved tensor confirms the shape and the hooks
        # come off for the rest of the step (no Python runs per saved tensor; StepHost.take_hooks_off)
        self.may_unhook = frame.host.may_unhook(self.layout)
        self.unhooked = False
        self.n_seen = 0
        # host clock per trace event: the compute gap before its hook, and the time in the hooks
        # (waits included; ``finish`` takes the stalls out). Meaningful on the CPU backend, where
        # compute is synchronous; the runtime re-times its trace from them (see PolicyRuntime).
        self.gaps: list[float] = []
        self.hook_s = 0.0
        self.tail_s = 0.0
        # R6/R8's host costs apart (retime.fitted_host_costs): the hook time of the events that
        # issued no copy and waited for none (the copies issued and the waits so far, as the last
        # event's hook ended)
        backend, mover = self.backend, frame.state
        self.issued_start = self.issued_at = backend.issued
        self.waited_at = backend.waited_s
        self.plain_hook_s, self.plain_events = 0.0, 0
        # the state mover's own time (R13-R16: its module and gradient hooks run between the
        # step's hooks): taken out of the gap it fell in, as the hooks' own time is, and out of
        # the hooks' (it works inside an unpack's too, ``at_unpack``: ``mover_in`` is its time as
        # that hook started); its waits are stalls, the rest its host time (``finish``)
        self.mover_spent_start = self.mover_at = mover.spent_s if mover is not None else 0.0
        self.mover_waited_at = mover.waited_s if mover is not None else 0.0
        self.mover_in: float | None = None
        self.state_host_s: float | None = None
        self.last_exit = time.perf_counter()
        # on a real device, for the steps the runtime re-times its trace from: a mark in the
        # compute order as each hook starts and ends (CUDA timing events), read after the step
        # (R1's gaps as the device ran them, where the profiling steps' synchronous copies
        # stretched them). Entries are by event index: a hook that returns early (a parameter)
        # is overwritten by the event's own hook. None: not timed on the device.
        self.marks_in: list[Any] | None = None
        self.marks_out: list[Any] = []
        self.mark_start = self.mark_end = None
        if frame.device_timed:
            self.marks_in = [None] * self.trace.n_events
            self.mark_start = self.backend.mark()
        if self.audit:
            self._audit_meter()

    def _load(self, layout: PlanLayout) -> None:
        """Follow ``layout`` (at the step's start, or at its first saved tensor: another shape's)."""
        self.layout = layout
        self.trace = tr = layout.trace
        # this shape's budget: a relative one is its own activation peak's share (DESIGN.md, "Budgets")
        self.budget = present(layout.budget_bytes, "the budget of the shape's layout")
        # the model's, plus what the profiling found held by others; of the training state, what
        # the plan leaves on the device all step (R14), and what the state mover holds beyond it now
        moved_off = int(tr.static_bytes) - layout.step_static_bytes  # the state the plan keeps off the device
        # R18: what FSDP2 holds between micro-batches now, in place of what the plan's trace counted
        held, planned_held = self.frame.held[0], int(tr.meta.get("held_bytes", 0))
        self.static_base = self.frame.static_bytes - moved_off + held  # the audit's base: the bytes the step starts with
        self.static = layout.step_static_bytes - planned_held + held + (self.frame.state.transient if self.frame.state is not None else 0)
        self.room = self.budget - self.static  # for saved tensors
        self.out_at, self.prefetch_at = layout.out_at, layout.prefetch_at
        tb = event_tables(tr)  # the simulator's per-trace lists, shared
        self.tensor_bytes = tb.bytes
        self.frees = tb.free  # tensors whose last unpack is each event
        self.alloc = tb.alloc_bytes  # bytes of the tensors first packed at each event (made in its gap)
        # non-saved bytes live in each gap (R3), as the profiling steps measured them
        # (runtime/transients.py): activations' gradients, outputs not saved, what a recompute
        # rebuilds and a selective checkpoint keeps (R9); and the state's gradients born in the step
        self.other = layout.other_held
        # the hooks' hot path reads two flat lists: the expected event (tensor id for a pack, its
        # complement ~id for an unpack) and whether anything happens after it (a free, a planned
        # swap-out or prefetch). Diverging empties both, which turns every later check off.
        self.expected: list[int] | tuple[()] = layout.expected_codes
        self.work: list[bool] | tuple[()] = layout.work_at
        self.first_sight = layout.first_sight

    def _gradient_static(self, p: Any) -> bool:
        # R3 with R13: a gradient the step makes and the placement keeps on the device is metered
        # from its birth; a host-placed one's device bytes are the mover's (measured_device_bytes)
        if not self.trace.state_gradients_born:
            return True
        mover = self.frame.state
        placed = mover.params.get(id(p)) if mover is not None else None
        return placed is not None and placed.placement in HOST_PLACEMENTS

    def state_bytes(self, delta: int) -> None:
        if self.deaths:
            self._count_deaths()
        super().state_bytes(delta)
        self.room -= delta

    def state_room(self) -> int:
        """The bytes a state fetch may take now under the budget (R6: it waits for room)."""
        if self.deaths:
            self._count_deaths()
        # what the coming gap holds beyond the saved tensors needs room too (R3: ``other``)
        other = self.other[self.i] if self.i < len(self.other) else 0
        return self.budget - self.static - self.used - int(other)

    def _first_tensor(self, nbytes: int) -> bool:
        """The step's first saved tensor has ``nbytes`` where this layout expects other bytes: take
        the plan of the shape that has them, or profile this step. False when profiling."""
        t0 = time.perf_counter()
        layout = self.frame.host.layout_of_shape(nbytes, self.layout)
        self.planning_s += time.perf_counter() - t0
        # the same storage, in order of first sight, must be that shape's first event as well
        if layout is not None and layout.first_sight.get(self.n_seen, -1) == layout.trace.events[0].tensor:
            self._load(layout)
            if self.marks_in is not None:
                self.marks_in = [None] * self.trace.n_events
            return True
        self.frame.host.note_grads()  # a shape no plan can fit is refused after this step, its gradients undone
        self.profile = ProfileStep(self.frame, since=(self.started, self.n_seen), carried=self.untracked)
        return False

    # ------------------------------------------------------------------ hooks
    def _diverge(self, seen: str) -> None:
        """The step's events left the trace at event ``self.i`` (it did ``seen``): nothing more is
        planned, and what is evicted comes back on demand."""
        if self.divergence is None:
            i, ex = self.i, self.expected
            if i >= len(ex):
                expected = "the end of the step"
            elif ex[i] >= 0:
                expected = f"pack of tensor {ex[i]} ({format_bytes(int(self.tensor_bytes[ex[i]]))})"
            else:
                expected = f"unpack of tensor {~ex[i]}"
            self.divergence = Divergence(i, expected, seen)
            if self.frame.strict:
                raise DivergenceError(f"step {self.frame.step} {self.divergence} (SwapRuntime(strict=True)). {DIVERGENCE_TIP}")
        self.diverged = True
        # no more planned work; R4 keeps making room before each gap, from the trace's next
        # allocation scaled by what this step's tensors weigh against the trace's (self.scale)
        self.expected = self.work = ()
        self.waiting.clear()

    def pack(self, t: torch.Tensor) -> Any:
        # the hot path: every saved tensor of the step passes here, so lookups come first and
        # each rarer case costs only the branch that needs it
        if self.profile is not None:
            return self.profile.pack(t)
        t_in = time.perf_counter()
        if self.marks_in is not None and self.i < len(self.marks_in):
            self.marks_in[self.i] = self.backend.mark()
        st = t.untyped_storage()
        key = st._cdata
        rec = self.keys.get(key)
        i = self.i
        if rec is None:
            cast = Recast.of(t)  # R12: a parameter's compute copy, made again at unpack
            if cast is not None:
                return cast
            if is_parameter(t):  # parameters stay (counted in static_bytes), and get no trace id
                self.keys[key] = UNTRACKED
                return Packed(None, t)
            nbytes = st.nbytes()
            if self.audit and key not in self.frame.static_keys:  # a buffer (BatchNorm's running stats) is static already
                self._watch(st)
            # ids in order of first sight, as the profiling step numbered them; a storage the
            # trace does not have (never unpacked there) is not tracked and just stays
            tid = self.first_sight.get(self.n_seen, -1)
            if self.may_unhook and i == 0 and tid >= 0 and self.tensor_bytes[tid] == nbytes:
                self.frame.host.take_hooks_off()  # the shape is the plan's, and the plan moves nothing
                self.unhooked = True
                return Packed(None, t)
            if i == 0 and tid >= 0 and self.tensor_bytes[tid] != nbytes:
                if not self._first_tensor(nbytes):  # a new shape: this step profiles it
                    return present(self.profile, "the profiling step a new shape hands over to").pack(t)
                tid = self.first_sight.get(self.n_seen, -1)
            self.n_seen += 1
            if tid < 0:
                self.keys[key] = UNTRACKED
                self._on_death(st, self.keys.pop, key, None)
                if i == 0:  # only before the first traced event can the step still hand over (below)
                    self.untracked.append((weakref.ref(st), nbytes, key))
                return Packed(None, t)
            rec = Record(tid, nbytes, key)
            self.keys[key] = rec
            self.records.append(rec)
            self.by_tid[tid] = rec
            ex = self.expected
            if i >= len(ex) or ex[i] != tid or self.tensor_bytes[tid] != nbytes:
                self._diverge(f"pack of tensor {tid} ({format_bytes(nbytes)})")
                self.scale = max(self.scale, nbytes / max(int(self.tensor_bytes[tid]), 1))
            # it is already made: counted before anything else moves, so an overshoot shows in the
            # peak, and so the drain below cannot admit a waiting prefetch (R6) into the room that
            # R4 made for this tensor before its gap (_room_for_next); _make_room only catches what
            # that missed
            if self.deaths:
                self._count_deaths()
            self.used += nbytes
            self._on_death(st, self.deaths.append, nbytes)
            if self.static + self.used > self.peak:
                self.peak = self.static + self.used
            if self.outs:
                self._drain()
            if self.used > self.room:
                self._make_room(0, tid)
        elif rec is UNTRACKED:
            return Packed(None, t)
        else:
            ex = self.expected
            if i >= len(ex) or ex[i] != rec.tid:
                self._diverge(f"pack of tensor {rec.tid} again")
        p = Packed(rec, t)  # holds a detached alias (see Packed)
        if rec.state != RESIDENT:
            p.let_go()  # evicted earlier in the step: rebuilt on unpack
        rec.handles.append(weakref.ref(p))
        self._end_event(i, t_in)
        return p

    def unpack(self, p: Packed | Recast) -> torch.Tensor:
        if isinstance(p, Recast):  # not an event of the trace: backward computes with the cast
            return recast(p, self.frame.state, self.i)
        if p.profiled:  # packed after this step handed its hooks to a profiling step
            return present(self.profile, "the profiling step this one handed over to").unpack(p)
        t_in = time.perf_counter()
        if self.marks_in is not None and self.i < len(self.marks_in):
            self.marks_in[self.i] = self.backend.mark()
        p.check_version()
        rec = p.rec
        state = self.frame.state
        if state is not None:  # backward reaches the state's groups by the trace's events (R14)
            spent = state.spent_s
            state.at_unpack(self.i, p.tensor if rec is None else None)
            if rec is not None:  # its time in this hook is the mover's, not the hook's (_end_event)
                self.mover_in = spent
        if rec is None:
            assert p.tensor is not None, "a kept tensor is never let go"  # hot path: a plain assert narrows it
            return p.tensor
        i = self.i
        ex = self.expected
        if i >= len(ex) or ex[i] != ~rec.tid:
            self._diverge(f"unpack of tensor {rec.tid}")
        out = p.tensor
        if out is None:  # evicted at some point (a handle holds its tensor only while resident)
            out = self._make_resident(p, rec)
        self._end_event(i, t_in)
        return out

    def _end_event(self, i: int, t_in: float) -> None:
        """After event ``i``: the plan's work at it, room for the next event's tensor (R4, before
        its gap), and the hook's own time and the compute gap before it."""
        self.i = i + 1
        work = self.work
        if i < len(work) and work[i]:
            self._after_event(i)
        alloc = self.alloc
        if i + 1 < len(alloc):
            other = self.other[i + 1]  # not scaled: a weight's gradient is the same for any batch
            need = int(alloc[i + 1] * self.scale) + other
            if self.used + need > self.room:
                self._room_for_next(need)
            if other and self.static + self.used + other > self.peak:
                self.peak = self.static + self.used + other  # what the gap holds beyond the saved tensors
        if self.marks_in is not None:
            self.marks_out.append(self.backend.mark())
        now = time.perf_counter()
        gap = t_in - self.last_exit  # the compute since the previous event's hook
        hook = now - t_in
        mover = self.frame.state
        if mover is not None:  # the mover's own time: in the gap, and in this hook (at_unpack)
            at_in = mover.spent_s if self.mover_in is None else self.mover_in
            gap -= at_in - self.mover_at
            hook -= mover.spent_s - at_in
            self.mover_at, self.mover_in = mover.spent_s, None
        self.gaps.append(gap)
        self.hook_s += hook
        backend = self.backend
        if backend.issued == self.issued_at and backend.waited_s == self.waited_at:
            self.plain_hook_s += hook
            self.plain_events += 1
        else:
            self.issued_at, self.waited_at = backend.issued, backend.waited_s
        self.last_exit = now

    def _make_resident(self, p: Packed, rec: Record) -> torch.Tensor:
        """(a) of an unpack of ``rec`` whose tensor was evicted: wait for its prefetch, or bring it on demand."""
        if self.outs or self.deaths:
            self._drain()
        # a freed tensor unpacked again (the step diverged) comes back from its host copy, which
        # stays until the step ends
        if rec.state in (OUT, HOST) or (rec.state == FREED and rec.host is not None):
            if rec in self.waiting:
                self.waiting.remove(rec)  # on demand goes ahead of prefetches waiting for room
            self._make_room(rec.nbytes, rec.tid)
            self._start_in(rec)
            self.on_demand += rec.nbytes
        if rec.state == IN:
            inn = rec.inn
            assert inn is not None, "a tensor coming in has its swap-in"
            t0 = time.perf_counter()
            self.waits += not self.backend.done(inn)
            self._wait(rec, inn, use=True)
            self.stall_s += time.perf_counter() - t0
            if self.diverged:
                # no plan says when it is last used: the swap-in buffer lives only as long as
                # autograd holds what unpack returns (its finalizer takes the bytes out); an unpack
                # after that brings it back again from the host copy, which stays to the step's end
                rec.inn, rec.state = None, HOST
                return rebuild(p, inn.dst)
            rec.flat = flat = inn.dst
            rec.state = RESIDENT
            # a backward that records a graph (double backward) may save what it unpacked: the
            # swap-in buffer is the same saved tensor (R2), as the profiling step numbered it
            st = flat.untyped_storage()
            self.keys[st._cdata] = rec
            self._on_death(st, self.keys.pop, st._cdata, None)
            return rebuild(p, flat)
        assert rec.flat is not None, "a resident tensor that was let go has its swapped-in storage"
        return rebuild(p, rec.flat)

    def _after_event(self, i: int) -> None:
        """(b)-(d) after event ``i``; called only for events with work (``self.work``)."""
        # (b) free what is last used here
        for tid in self.frees[i]:
            rec = self.by_tid[tid]
            # our own references go (the swap-in buffer is held by rec.flat and by the swap-in
            # ticket's dst); autograd drops its handles itself, which frees the storage here as
            # plain PyTorch would. A host copy stays until the step ends, in case an unplanned
            # unpack (divergence) needs it again.
            rec.flat = None
            rec.inn = None
            rec.state = FREED
            if self.keys.get(rec.key) is rec:
                del self.keys[rec.key]  # no pack of it may follow; its address may be reused
        # (c) swap-outs planned here
        for tid in self.out_at[i]:
            out = self.by_tid.get(tid)
            if out is not None and out.state == RESIDENT:
                if not self._host_room(out.nbytes):
                    self.host_skipped += 1  # R11: no room on the host, it stays (as the simulator has it)
                    continue
                self._issue_out(out)
        # (d) prefetches planned here, in issue order, waiting for room (R6)
        pf = self.prefetch_at[i]
        if pf:
            for tid in pf:
                inn = self.by_tid.get(tid)
                if inn is not None and inn.state in (OUT, HOST) and inn not in self.waiting:
                    self.waiting.append(inn)
            self._admit()

    # ------------------------------------------------------------------ end of step
    def finish(self) -> None:
        if self.profile is not None:
            self.profile.finish()
            self.exits.close()  # the audit meter, entered as the step began
            return
        if self.unhooked:  # nothing was watched after the first saved tensor: nothing to check
            self._settle()
            return
        self.tail_s = time.perf_counter() - self.last_exit
        if self.marks_in is not None:
            self.mark_end = self.backend.mark()
        self.hook_s -= self.stall_s
        mover = self.frame.state
        if mover is not None:  # its time in the tail; its waits in the step are stalls, the rest its host time
            self.tail_s -= mover.spent_s - self.mover_at
            waited = mover.waited_s - self.mover_waited_at
            self.stall_s += waited
            self.state_host_s = mover.spent_s - self.mover_spent_start - waited
        if not self.diverged and self.i != self.trace.n_events:
            self._diverge(f"the end of the step after {self.i} of {self.trace.n_events} events")
        self._settle()

    def abort(self) -> None:
        if self.profile is not None:
            self.profile.abort()
        self._settle()

    def _device_gaps(self) -> tuple[tuple[float, ...] | None, float | None]:
        """Each gap and the tail from the device's marks (the step has synchronized), or None."""
        ins, outs, n = self.marks_in, self.marks_out, self.trace.n_events
        if ins is None or self.diverged or self.mark_end is None or len(outs) != n or any(m is None for m in ins):
            return None, None
        elapsed = self.backend.elapsed_s
        before = [self.mark_start, *outs[:-1]]
        return tuple(max(elapsed(a, b), 0.0) for a, b in zip(before, ins, strict=True)), elapsed(outs[-1], self.mark_end)

    def report(self, step_s: float) -> StepReport:
        if self.profile is not None:
            return self.profile.report(step_s)
        cuda_peak = self.backend.peak_bytes()
        if self.unhooked:
            # unwatched: no count of ours and no gaps; the plan moves nothing and no hook runs, so
            # the prediction is the trace's ideal step and the peak the plan's, as simulated (on
            # CUDA torch's allocator measures it too: cuda_peak_bytes)
            return StepReport(
                step=self.frame.step, mode="execute", step_s=step_s, stall_s=0.0, predicted_step_s=self.trace.ideal_s,
                evicted_bytes=0, prefetched_bytes=0, on_demand_bytes=0,
                peak_device_bytes=self.layout.predicted_peak_bytes, budget_bytes=self.budget,
                plan_followed=True, guard_evictions=0, kept_small=int(self.layout.plan.meta.get("kept_small", 0)),
                cuda_peak_bytes=cuda_peak, recomputed_blocks=self.frame.blocks.names if self.frame.blocks is not None else (),
                selective_blocks=self.frame.blocks.selective if self.frame.blocks is not None else (),
                shape_predicted=self.layout.predicted, plain_step_s=self.trace.ideal_s, unhooked=True,
                plan_source=self.layout.plan_source)
        # host-clock gaps mean compute only where compute is synchronous, and only for a whole step
        timed = self.backend.emulated and not self.diverged and len(self.gaps) == self.trace.n_events
        gaps, tail = (tuple(self.gaps), self.tail_s) if timed else self._device_gaps()
        return StepReport(
            step=self.frame.step, mode="diverged" if self.diverged else "execute", step_s=step_s,
            stall_s=self.stall_s + self.backend.take_device_stall_s(),  # CUDA: compute's waits on the device
            predicted_step_s=self.layout.predicted_s, evicted_bytes=self.evicted, prefetched_bytes=self.prefetched,
            on_demand_bytes=self.on_demand, peak_device_bytes=self.peak, budget_bytes=self.budget,
            # followed, and within budget: the guard may find nothing to evict (a tensor read again
            # by a later backward pass after its first unpack stays), which leaves the peak over
            plan_followed=not self.diverged and self.guard == 0 and self.peak <= self.budget,
            divergence=self.divergence,
            guard_evictions=self.guard, kept_small=int(self.layout.plan.meta.get("kept_small", 0)), cuda_peak_bytes=cuda_peak,
            hook_s=self.hook_s, copies=self.copies, waits=self.waits, plain_hook_s=self.plain_hook_s,
            plain_events=self.plain_events, state_host_s=self.state_host_s,
            state_tensors=len(self.frame.state.params) if self.frame.state is not None else 0,
            state_copies=max(self.backend.issued - self.issued_start - self.copies, 0) if self.frame.state is not None else 0,
            gaps_s=gaps, tail_s=tail,
            measured_peak_bytes=self.measured_peak(), unowned_bytes=int(self.trace.meta.get("unowned_bytes", 0)),
            recomputed_blocks=self.frame.blocks.names if self.frame.blocks is not None else (),
            selective_blocks=self.frame.blocks.selective if self.frame.blocks is not None else (),
            shape_predicted=self.layout.predicted, plain_step_s=self.trace.ideal_s, plan_source=self.layout.plan_source,
            host_peak_bytes=self.host_held, host_skipped=self.host_skipped,
            collectives=CollectiveTally.of(self.meter.collectives if self.meter is not None else None),
            predicts_optimizer_step=bool(self.trace.state),  # R15: the simulated step includes it
        )

