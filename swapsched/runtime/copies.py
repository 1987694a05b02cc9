"""The executing step's copies and its room under the budget: :class:`CopyingStep`.

What a step executing a plan holds on the device, and the copies that move it: swap-outs in
flight, swap-ins, prefetches waiting for room (R6), R4's wait for room before each gap (the
swap-outs in flight first, then the guard), the guard's MIN rule on the spot, the host budget
(R11), and the end of the step, when every copy is waited for and every host buffer goes back
to the pool. ``execute_step.ExecuteStep`` drives it from the hooks, following the plan's events.

The accounting is the memory really held, not the plan's view of it: a saved storage (and a
swap-in buffer) counts from its first pack (its allocation) until a finalizer on the storage
says it died. So an evicted tensor leaves the budget only once its swap-out completed *and* the
program let go of it (R2's release), and a tensor last used at an unpack only once autograd's
node that read it is done with it; until then, R4's waits and the guard see it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from swapsched.budget import format_bytes
from swapsched.env.events import HOST, IN, OUT, RESIDENT
from swapsched.errors import internal_assert, present
from swapsched.runtime.accounting import StepExecution
from swapsched.runtime.backends import CopyError, Ticket
from swapsched.runtime.stash import Record, flat_bytes

if TYPE_CHECKING:
    from swapsched.runtime.frame import StepFrame
    from swapsched.trace import Trace

__all__ = ["CopyingStep"]


class CopyingStep(StepExecution):
    """The copies and the room of an executing step (module docstring). ``trace``, ``budget``
    and ``room`` are the followed layout's, set by the step that follows it; ``i`` is the next
    event, which the guard's MIN rule counts next uses from."""

    # slots: the hooks read and write these at every saved-tensor event
    __slots__ = ("trace", "budget", "room", "keys", "by_tid", "i", "outs", "waiting", "ins", "deaths", "host_held",
                 "host_skipped")

    trace: Trace
    budget: int
    room: int

    def __init__(self, frame: StepFrame):
        super().__init__(frame)
        # live storage key -> record. A resident record's handles keep its storage alive; an
        # evicted one gets a weakref.finalize as the runtime lets go of it, and a freed one is
        # forgotten at its last use, so no key ever outlives its storage (R2; see StorageIds).
        # Parameters (and storages the trace does not track) map to UNTRACKED for the step.
        self.keys: dict[int, Record] = {}
        self.by_tid: dict[int, Record] = {}
        self.i = 0
        self.outs: deque[Record] = deque()  # swap-outs in flight, in issue order
        self.waiting: deque[Record] = deque()  # prefetches waiting for room (R6)
        self.ins: list[Record] = []
        # bytes of device storages of ours that died: finalizers append (maybe on a copy thread),
        # the step's thread subtracts them from the accounting
        self.deaths: deque[int] = deque()
        # R11: host bytes of this step's swapped tensors (held until the step ends), beside the
        # state the mover keeps on the host and its disk's staging (R19): they share the host budget
        state = frame.state
        self.host_held = 0 if state is None else state.host_bytes() + state.staging_bytes()
        self.host_skipped = 0

    def _count_deaths(self) -> None:
        """Take the storages that died since the last look out of the accounting."""
        deaths = self.deaths
        while deaths:
            self.used -= deaths.popleft()

    def _drain(self) -> None:
        self._count_deaths()
        outs = self.outs
        # every record in outs has its ticket (the hot path: no check per retired copy)
        while outs and self.backend.done(outs[0].out):  # type: ignore[arg-type]
            self._retire_out(self.outs.popleft())
        if self.waiting:
            self._admit()

    def _retire_out(self, rec: Record) -> None:
        t = rec.out
        assert t is not None, "a retired swap-out has its ticket"
        if t.error is not None:
            raise CopyError(f"swap-out of tensor {rec.tid} ({format_bytes(rec.nbytes)}) failed: {t.error}") from t.error
        t.src = None  # complete, or compute waits for it: the device storage may go (see backends.py)
        if rec.state == OUT:
            rec.state = HOST
        # no accounting here: the bytes go when the storage dies (see ExecuteStep's docstring)

    def _admit(self) -> None:
        room = self.budget - self.static
        while self.waiting and self.used + self.waiting[0].nbytes <= room:
            rec = self.waiting.popleft()
            self._start_in(rec)
            self.prefetched += rec.nbytes

    def _start_in(self, rec: Record) -> None:
        self._account(rec.nbytes)
        assert rec.host is not None, "an evicted tensor has its host copy"
        rec.inn = self.backend.copy_in(rec.host, rec.out)
        st = rec.inn.dst.untyped_storage()
        self._on_death(st, self.deaths.append, rec.nbytes)
        if self.audit:
            self._watch(st)
        self.copies += 1
        rec.state = IN
        self.ins.append(rec)

    def _room_for_next(self, need: int) -> None:
        """R4 before the gap: the next gap produces ``need`` bytes of new saved tensors (by the
        trace); compute waits here, while nothing of it exists yet, for room under the budget."""
        self._drain()
        if self.used + need > self.room:
            self._make_room(need, None)

    def _make_room(self, need: int, now_tid: int | None) -> None:
        # a diverged step makes room too: the plan no longer describes it, but the budget still
        # holds, by the swap-outs in flight and then the guard
        while self.used + need > self.budget - self.static:  # the state's bytes may change it (below)
            if self.deaths:
                self._count_deaths()
                continue
            if self.outs:
                t0 = time.perf_counter()
                first = self.outs[0]
                out = first.out
                assert out is not None, "a swap-out in flight has its ticket"
                self.waits += not self.backend.done(out)
                # the compute that follows waits for the swap-out, not the host (a stream wait on
                # CUDA, so the device's queue does not drain; its stall is timed on the device).
                # Dropping the source then is safe: only compute, queued after the wait, can reuse
                # its memory, and a swap-in of it waits for the swap-out on its own stream (R6)
                self._wait(first, out, use=True)
                self.stall_s += time.perf_counter() - t0
                self._retire_out(self.outs.popleft())
                continue
            state = self.frame.state
            if state is not None:  # R4 waits for the state's copies out as for swap-outs (R14)
                t0 = time.perf_counter()
                landed = state.land_gradient()
                self.stall_s += time.perf_counter() - t0
                if landed:
                    continue
            if not self._guard_evict(now_tid):
                return  # nothing left to move: over budget, reported, never a crash

    def _guard_evict(self, now_tid: int | None) -> bool:
        """MIN rule on the spot: evict the tensor on the device whose next use is farthest. That
        may be one prefetched too early (IN): its host copy is still whole, so it goes back to
        HOST with no copy, once its swap-in has landed."""
        fu = self.trace.first_unpack
        cands = [r for r in self.records if r.tid != now_tid and r.nbytes >= self.frame.min_bytes and fu[r.tid] > self.i
                 and ((r.state == RESIDENT and self._host_room(r.nbytes)
                       and (r.flat is not None or any(h.tensor is not None for h in r.live_handles())))
                      or (r.state == IN and r.host is not None))]
        if not cands:
            return False
        rec = max(cands, key=lambda r: fu[r.tid])
        if rec.state == IN:
            self._undo_in(rec)
        else:
            self._issue_out(rec)
        self.guard += 1
        return True

    def _undo_in(self, rec: Record) -> None:
        """Take back a prefetch not yet used: wait for its copy (the ticket holds the device
        buffer until then), then drop the ticket, the buffer's one owner, so it dies and its
        finalizer takes its bytes out of the accounting (see _start_in)."""
        internal_assert(rec.host is not None, f"a prefetch taken back (tensor {rec.tid}) has its host copy")
        t0 = time.perf_counter()
        self._wait(rec, present(rec.inn, f"the swap-in of a prefetch taken back (tensor {rec.tid})"))
        self.stall_s += time.perf_counter() - t0
        rec.inn = None
        rec.state = HOST
        self.ins.remove(rec)
        self._count_deaths()

    def _host_room(self, nbytes: int) -> bool:
        """R11: whether the host budget has room for ``nbytes`` more this step (the pool holds a
        swapped tensor's buffer until the step ends)."""
        limit = self.frame.hardware.host_budget_bytes
        return limit is None or self.host_held + self._host_bytes(nbytes) <= limit

    def _host_bytes(self, nbytes: int) -> int:
        pool = getattr(self.backend, "pool", None)
        return pool.held_bytes(nbytes) if pool is not None else nbytes

    def _issue_out(self, rec: Record) -> None:
        self.host_held += self._host_bytes(rec.nbytes)
        flat = rec.flat
        if flat is None:
            flat = flat_bytes(next(h.tensor for h in rec.live_handles() if h.tensor is not None))
        # from now on nothing of ours but the ticket keeps the storage alive: forget its key when it dies
        self._on_death(flat.untyped_storage(), self.keys.pop, rec.key, None)
        rec.out = self.backend.copy_out(flat)
        self.copies += 1
        rec.host = rec.out.dst
        rec.state = OUT
        # the ticket now holds the device storage until the copy completes; the stashes let go
        rec.flat = None
        for h in rec.live_handles():
            h.let_go()
        self.outs.append(rec)
        self.evicted += rec.nbytes


    def _wait(self, rec: Record, t: Ticket, use: bool = False) -> None:
        """Wait for one of ``rec``'s copies; a copy that failed or hung names its tensor."""
        try:
            (self.backend.wait_for_use if use else self.backend.wait_host)(t)
        except CopyError as exc:
            kind = "swap-out" if t is rec.out else "swap-in"
            raise CopyError(f"{kind} of tensor {rec.tid} ({format_bytes(rec.nbytes)}) {exc}") from exc

    def _settle(self) -> None:
        """Wait for every copy in flight, return host buffers to the pool, drop every stash.

        Never raises (it also runs while an exception unwinds the step). A copy that failed is
        complete, so its buffers may be reused; one that never completed may still write its host
        buffer, which is then dropped instead of pooled, and the backend starts fresh engines."""
        stuck: set[int] = set()
        pending = [(rec, rec.out) for rec in self.outs if rec.out is not None]  # every swap-out in flight has one
        pending += [(rec, rec.inn) for rec in self.ins if rec.inn is not None]  # None: released at its use
        for rec, t in pending:
            try:
                self.backend.wait_host(t)
            except CopyError:
                if not self.backend.done(t):
                    stuck.add(id(rec))
        if stuck:
            self.backend.recover()
        pool = self.backend.pool
        for rec in self.records:
            if rec.host is not None:
                (pool.discard if id(rec) in stuck else pool.give)(rec.host)
                rec.host = None
            rec.flat = None
            rec.out = rec.inn = None
            for h in rec.live_handles():
                h.let_go()
        self.outs.clear()
        self.waiting.clear()
        self.ins.clear()
        self.records.clear()
        self.keys.clear()
        self.by_tid.clear()
        self._count_deaths()  # what died since the last hook (a storage still alive stays counted)
        self._drop_finalizers()
        self.exits.close()  # the blocks' meter
