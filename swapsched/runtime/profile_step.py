"""The profiling step: record the trace while every saved tensor goes to the host and back on demand."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from swapsched.env.events import HOST
from swapsched.runtime.accounting import StepExecution
from swapsched.runtime.casts import Recast, recast
from swapsched.runtime.mode_time import ModeTime
from swapsched.runtime.profiler import born_gradient_bytes, static_gradients
from swapsched.runtime.recorder import ModulePath, OpNames, StorageIds, TraceRecorder, storage_key
from swapsched.runtime.reports import CollectiveTally, StepReport
from swapsched.runtime.stash import Packed, Record, flat_bytes, rebuild
from swapsched.runtime.transients import TransientMeter
from swapsched.trace import Trace

if TYPE_CHECKING:
    from swapsched.runtime.frame import StepFrame

__all__ = ["ProfileStep"]

# the autograd engine's id of the backward pass running now (a private API, present since torch
# 2.0; where it is missing every pass counts as one, and only a budget error loses its reason)
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: 0)


class ProfileStep(StepExecution):
    """Step 1: record the trace; every saved tensor goes to the host at once and comes back on
    demand, synchronously inside the hook (the recorder excludes hook time from the gaps).

    It also finds the saved storages the runtime does not own: at the end of the step, a storage
    that is still alive although autograd dropped every handle to it is held by someone else (the
    caller's batch or output, a module buffer). Evicting it would free nothing, so the trace leaves
    it out and counts its bytes as static. A graph kept with ``retain_graph`` keeps its handles, so
    its storages are not judged."""

    __slots__ = ("ids", "recorder", "trace", "moved", "device", "owners", "recasts", "grads_born", "released",
                 "freed", "unpacked", "devices", "param_keys", "passes", "modules", "checkpoint_packs", "recomputes",
                 "new_shape", "seen_before", "carried", "carried_keys", "ops", "producers", "held", "first_sight",
                 "transients")

    def __init__(self, frame: StepFrame, since: tuple[float, int] | None = None,
                 carried: list[tuple[weakref.ref[Any], int, int]] | None = None):
        super().__init__(frame)
        clock = self.backend.device_type  # the host clock, or events on the device's stream
        # on the host clock, the two modes below charge their own time here, and the gaps leave it
        # out (mode_time.py); made before they are entered, which its one-off measurement needs
        timer = ModeTime() if clock == "cpu" and since is None else None
        self.ids = StorageIds()  # live storage -> its record (R2)
        # with the model: each saved tensor's module, from which the trace finds its blocks (R9)
        self.modules = ModulePath(frame.model).__enter__() if frame.model is not None else None
        # a whole step (not one handed over mid-step, inside an op's hooks, where a dispatch mode
        # cannot be entered safely) names each saved tensor's op and records which op call made
        # each storage: what selective checkpointing recomputes, and how it names an op call (R9)
        self.ops = OpNames(self.modules).__enter__() if since is None else None
        # and measures what each gap holds beyond the saved tensors (R3's other bytes): entered
        # after the op names, left before them (modes leave in the reverse order)
        # R3: where the run counts gradients from their birth, those the step makes are measured
        # as other bytes (a step handed over mid-step has no meter: its gradients stay static)
        self.grads_born = self.had is not None and since is None
        self.transients = (TransientMeter(lambda: len(self.recorder.kinds), workspace=clock == "cuda",
                                          grads_born=self.grads_born).__enter__() if since is None else None)
        if self.ops is not None and self.transients is not None:
            self.ops.timer = self.transients.timer = timer
        self.recorder = TraceRecorder(clock, ops=self.ops, modules=self.modules, transients=self.transients, timer=timer)
        if self.transients is not None and frame.model is not None:
            # a parameter's gradient is the state's bytes, not a transient, even where the state
            # mover copies it to the host and lets it go (R13); or, counted from its birth, an
            # other byte from the op that made it (R3)
            self.transients.hook_gradients(frame.model.parameters(), self.exits)
        # trace id (order of first sight) -> the op call that made its storage, per module then
        # (OpNames.producers); in trace ids once the step is done
        self.producers: dict[int, tuple[tuple[str, Any, int], ...]] = {}
        # per hook call: the bytes the selective checkpoints held then (R9, selective)
        self.held: list[int] = []
        # R9: id of each pack handle a block's checkpoint made (of its inputs) -> the block, and
        # (hook call, block) for each unpack of one: where backward recomputes the block
        self.checkpoint_packs: dict[int, str] = {}
        self.recomputes: list[tuple[int, str]] = []
        blocks = frame.blocks
        if self.transients is None and blocks is not None and blocks.names and frame.model is not None:
            # a step handed over mid-step has no transient meter: what each recompute really holds
            # is measured from inside it (storages of ours and of the model's parameters and
            # buffers are not new memory)
            static = {storage_key(x) for x in (*frame.model.parameters(), *frame.model.buffers())}
            self.exits.enter_context(blocks.metering(lambda key: key in static or key in self.ids))
        # since: an executing step handed its hooks over (a shape not planned for) at this host
        # time, having seen this many storages first: the recording starts there
        self.recorder.start(since[0] if since else None)
        self.new_shape = since is not None
        self.seen_before = since[1] if since else 0
        # the storages the handing step saw first and did not track (weak storage, bytes, key):
        # counted as held by someone else if still alive at the end, as a whole profile judges them
        self.carried = list(carried or ())
        self.carried_keys = {key: st for st, _, key in self.carried}
        self.trace: Trace | None = None
        # trace tensor id by order of first sight, from this step's start (as a layout keeps it)
        self.first_sight: dict[int, int] = {}
        self.moved = 0
        self.device = self.backend.device_type
        # trace id (order of first sight) -> (storage, handles autograd holds, bytes, key), all weak
        self.owners: dict[int, tuple[weakref.ref[Any], list[weakref.ref[Packed]], int, int]] = {}
        # trace id -> the hook call before which its storage died: here the runtime holds no device
        # copy, so that is when the program itself let go of it (R2's release)
        self.released: dict[int, int] = {}
        # trace id -> the hook call before which its last unpacked copy died: when autograd's node
        # that read it let go (R2's free)
        self.freed: dict[int, int] = {}
        self.unpacked: set[int] = set()
        self.devices: dict[int, torch.device] = {}
        self.recasts = 0  # saved casts of parameters (R12): a step that saves one keeps its hooks
        self.param_keys: set[int] = set()  # parameters live through the step: no finalizer needed
        self.passes: set[int] = set()  # the autograd graph tasks (backward passes) that unpacked

    def pack(self, t: torch.Tensor) -> Packed | Recast:
        cast = Recast.of(t)  # R12: a parameter's compute copy, made again at unpack
        if cast is not None:
            self.recasts += 1
            return cast
        with self._paused():  # the hook's own ops (a detach, its copy) are not the model's
            return self._pack(t)

    def _pack(self, t: torch.Tensor) -> Packed:
        # a storage first seen as a parameter's stays one, whatever view of it comes later (a
        # double backward saves a transpose of an unpacked, detached weight): the executed steps
        # tell parameters by their storage too
        key = t.untyped_storage()._cdata
        if key in self.carried_keys and self.carried_keys[key]() is not None:
            # a storage the handing step saw first (and did not track) is no new sight here
            # either: an executing step of this shape keeps it untracked, so its order of first
            # sight must not count it twice (a view of the caller's batch, saved again later)
            return Packed(None, t, profiled=True)
        tid = None if key in self.param_keys else self.recorder.pack(t)
        self._sample()
        if tid is not None and self.ops is not None and tid not in self.producers:
            self.producers[tid] = self.ops.producers.get(key, ())
        if tid is None:
            self.param_keys.add(t.untyped_storage()._cdata)
            return Packed(None, t, profiled=True)
        st = t.untyped_storage()
        limit = self.frame.hardware.host_budget_bytes
        if st.nbytes() < self.frame.min_bytes or (limit is not None and self.ids.get(t) is None
                                               and self.moved + st.nbytes() > limit):
            # small, or (R11) no room left on the host: it stays on the device for this step
            p = Packed(None, t, tid=tid, profiled=True)
            self._own(tid, st, p)
            return p
        rec = self.ids.get(t)
        if rec is None:
            flat = flat_bytes(t)
            rec = Record(tid, flat.numel(), host=self.backend.copy_out_now(flat), state=HOST)
            self.devices[tid] = t.device  # it comes back to the tensor's own device
            self.ids.add(t, rec)
            self.records.append(rec)
            self.moved += rec.nbytes
            self.recorder.hook_done()  # the copy was hook time, not compute
        p = Packed(rec, t, tid=tid, profiled=True)
        p.let_go()  # the device copy may go: unpack rebuilds from the host
        self._own(tid, st, p)
        blocks = self.frame.blocks
        if blocks is not None and blocks.entering is not None:
            self.checkpoint_packs[id(p)] = blocks.entering  # p lives in autograd's graph until its unpack
        return p

    def _sample(self) -> None:
        """One entry of ``held`` per hook call the recorder took (a step handed over mid-step: a
        whole step's transient meter sees what the checkpoints hold)."""
        if self.transients is not None:
            return
        blocks, held = self.frame.blocks, self.held
        while len(held) < len(self.recorder.kinds):
            held.append(blocks.held if blocks is not None else 0)

    @contextmanager
    def _paused(self) -> Iterator[None]:
        """The hook's own ops are not the model's: the op recorder skips them."""
        if self.ops is None or self.transients is None:
            yield
            return
        self.ops.paused = self.transients.paused = True
        try:
            yield
        finally:
            self.ops.paused = self.transients.paused = False

    def _own(self, tid: int, st: Any, p: Packed) -> None:
        entry = self.owners.get(tid)
        if entry is None:
            self.owners[tid] = (weakref.ref(st), [weakref.ref(p)], st.nbytes(), st._cdata)
            self._on_death(st, self._died, tid)
        else:
            entry[1].append(weakref.ref(p))

    def _died(self, tid: int) -> None:
        """The packed storage died: before its first unpack the program let go of it (it was on
        the host already); after, autograd did (a kept tensor)."""
        if tid in self.unpacked:
            self._freed(tid)
        else:
            self.released.setdefault(tid, len(self.recorder.kinds))

    def _freed(self, tid: int) -> None:
        self.freed[tid] = max(self.freed.get(tid, 0), len(self.recorder.kinds))

    def unpack(self, p: Packed | Recast) -> torch.Tensor:
        if isinstance(p, Recast):
            return recast(p, self.frame.state, -1)
        with self._paused():
            return self._unpack(p)

    def _unpack(self, p: Packed) -> torch.Tensor:
        tid = p.tid
        p.check_version()
        self.passes.add(_graph_task_id())  # one id per backward pass
        self.recorder.unpack(tid)
        self._sample()
        if tid is not None:
            self.unpacked.add(tid)
            block = self.checkpoint_packs.get(id(p))
            if block is not None:
                self.recomputes.append((len(self.recorder.kinds) - 1, block))
        if p.rec is None:  # kept: a parameter, or smaller than min_bytes
            assert p.tensor is not None, "a kept tensor is never let go"
            if self.frame.state is not None:  # a placed parameter's storage is fetched first (R14)
                self.frame.state.at_unpack(-1, p.tensor)
            return p.tensor
        assert p.rec.host is not None, "a profiled tensor is on the host until unpacked"
        out = rebuild(p, self.backend.copy_in_now(p.rec.host, self.devices[p.rec.tid]))
        self._on_death(out.untyped_storage(), self._freed, tid)
        # a backward that records a graph (double backward) may save what it unpacked: the copy
        # is the same saved tensor (R2), as an executed step, which unpacks the storage itself, sees it
        self.recorder.ids.add(out, tid)
        self.ids.add(out, p.rec)
        self.recorder.hook_done()
        return out

    def unowned(self) -> dict[int, int]:
        """Trace id -> bytes of the storages alive though autograd let go of every handle."""
        out = {}
        for tid, (st, handles, nbytes, key) in self.owners.items():
            if st() is not None and all(h() is None for h in handles):
                out[tid] = 0 if key in self.frame.static_keys else nbytes  # a buffer is static already
        return out

    def carried_bytes(self) -> tuple[int, int]:
        """(count, bytes) of the handed-over untracked storages still alive (buffers: 0 bytes)."""
        alive = [(nbytes, key) for st, nbytes, key in self.carried if st() is not None]
        return len(alive), sum(0 if key in self.frame.static_keys else nbytes for nbytes, key in alive)

    def finish(self) -> None:
        unowned = self.unowned()
        carried, carried_bytes = self.carried_bytes()
        unowned_bytes = sum(unowned.values()) + carried_bytes
        if "unpack" not in self.recorder.kinds:  # a step without backward: no trace to learn from
            self.abort()
            return
        model = self.frame.model
        # counted in the static bytes: every gradient, or (R3, from their birth) those there before the step
        had = self.had if self.grads_born and self.had is not None else None
        grads = static_gradients(model, had) if model is not None else []
        born = born_gradient_bytes(model, had) if had is not None and model is not None else 0
        static = self.frame.static_bytes + unowned_bytes + self.frame.held[1] - born
        self.trace = self.recorder.finish(f"runtime-step-{self.frame.step}", self.device, static, "measured",
                                          exclude=frozenset(unowned), released=dict(self.released),
                                          freed=dict(self.freed), static_tensors=grads)
        self.trace = replace(self.trace, events=self._with_rebuilt(self.trace),
                             meta={**self.trace.meta, "unowned_bytes": unowned_bytes,
                                   "unowned_tensors": len(unowned) + carried, "backward_passes": len(self.passes),
                                   "held_bytes": self.frame.held[1], "recasts": self.recasts})
        remap = self.recorder.remap
        self.first_sight = {k + self.seen_before: v for k, v in remap.items()}
        self.producers = {remap[k]: v for k, v in self.producers.items() if k in remap}
        self.abort()

    def _with_rebuilt(self, trace: Trace) -> tuple[Any, ...]:
        """R9: the trace's events, with what each recompute rebuilds counted in the gap after the
        unpack of the block's inputs (the recompute and the block's backward run in it; the
        checkpoint holds the members there, outside the runtime's hooks); and what selective
        checkpoints held in each gap (the most at either end of it: they grow through forward and
        go in backward), as the runtime's hooks saw it between the gaps."""
        events = list(trace.events)
        if self.transients is not None:
            return tuple(events)  # the transient meter saw what the checkpoints held and rebuilt
        index = self.recorder.event_index
        held = self.held
        if any(held):
            most: dict[int, int] = {}
            for call, now in enumerate(held):
                j = index[call]
                most[j] = max(most.get(j, 0), now, held[call - 1] if call else 0)
            for j, n in most.items():
                if n and j < len(events):
                    e = events[j]
                    events[j] = replace(e, other_bytes=(e.other_bytes or 0) + n)
        measured = self.frame.blocks.rebuilt_peak if self.frame.blocks is not None else {}
        for call, block in self.recomputes:
            j = index[call + 1]  # the event whose gap follows that hook call
            if j < len(events):
                # what the recompute was measured to hold (its members and transients), else the
                # members' bytes by the trace it was planned on
                rebuilt = measured.get(block, self.frame.rebuilt.get(block, 0))
                e = events[j]
                events[j] = replace(e, other_bytes=(e.other_bytes or 0) + rebuilt)
        return tuple(events)

    def abort(self) -> None:
        if self.transients is not None:
            self.transients.__exit__(None, None, None)
            self.transients.close()
            self.transients = None
        if self.ops is not None:
            self.ops.__exit__(None, None, None)
            self.ops = None
        if self.modules is not None:
            self.modules.__exit__()
            self.modules = None
        self.exits.close()  # the blocks' meter
        for rec in self.records:  # every copy here was synchronous: the buffers are free to reuse
            if rec.host is not None:
                self.backend.pool.give(rec.host)
                rec.host = None
        self.records.clear()
        self.ids.clear()
        self.recorder.ids.clear()
        self.owners.clear()
        self.carried.clear()
        self.carried_keys.clear()
        self._drop_finalizers()

    def report(self, step_s: float) -> StepReport:
        unowned = int(self.trace.meta.get("unowned_bytes", 0)) if self.trace is not None else 0
        return StepReport(
            step=self.frame.step, mode="profile", step_s=step_s, stall_s=0.0, predicted_step_s=None,
            evicted_bytes=self.moved, prefetched_bytes=0, on_demand_bytes=self.moved,
            peak_device_bytes=None, budget_bytes=None, plan_followed=True, guard_evictions=0, kept_small=0,
            unowned_bytes=unowned, nothing_saved=not self.recorder.kinds,
            recomputed_blocks=self.frame.blocks.names if self.frame.blocks is not None else (),
            selective_blocks=self.frame.blocks.selective if self.frame.blocks is not None else (), new_shape=self.new_shape,
            collectives=CollectiveTally.of(self.transients.collectives if self.transients is not None else None),
        )

