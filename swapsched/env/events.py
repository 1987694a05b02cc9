"""A trace laid out per event: the tables both executors read, and where a tensor can be.

The simulator's hot loop (``simulator.py``) and the live runtime's hooks (``runtime/``) read only
these lists, computed once per trace (:func:`event_tables`), and record each tensor's place with
the same states: one set of rules, one set of tables, for both executors.
"""

from __future__ import annotations

from collections.abc import Sequence

from swapsched.trace import Trace

__all__ = ["EventTables", "event_tables", "NOT_YET", "RESIDENT", "OUT", "HOST", "IN", "WAITING", "FREED", "DROPPED"]

#: Where a tensor is; the runtime's records use the same values (one set of states for both executors).
NOT_YET, RESIDENT, OUT, HOST, IN, WAITING, FREED = range(7)
DROPPED = 7  # R9: the simulator's alone (in the runtime a checkpoint holds recomputed blocks, see runtime/recompute.py)


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
        # per event, the tensors each rule acts on there: tuples, the empty one shared, since a
        # layout per shape keeps its tables for the run and a list per event per table made the
        # cyclic garbage collector's full passes, which stall the training loop, come often
        fp, lu = trace.first_pack.tolist(), trace.last_unpack.tolist()
        self.alloc = _by_event(n, fp)
        self.free = _by_event(n, lu)
        self.alloc_bytes = [sum(self.bytes[k] for k in ks) for ks in self.alloc]
        # R2: the event after whose gap the program no longer holds each tensor
        self.release = _by_event(n, trace.release.tolist())
        # R2: tensors whose memory outlives their last unpack (the node that read them still runs)
        # are freed after the gap of this event instead
        freed = trace.freed.tolist()
        self.late = [f > u for f, u in zip(freed, lu, strict=True)]
        self.freed_late = _by_event(n, [f if late else -1 for f, late in zip(freed, self.late, strict=True)])
        # R9: the block each tensor is a member of (-1: none), and the blocks recomputed at each event
        self.segments = trace.segments
        self.member_of = [-1] * trace.n_tensors
        self.cheap = [False] * trace.n_tensors  # rebuilt by a selective recompute too
        for sg in self.segments:
            for k in sg.members:
                self.member_of[k] = sg.index
            for k in sg.cheap:
                self.cheap[k] = True
        self.recompute_at = _by_event(n, [sg.at for sg in self.segments])


def _by_event(n: int, event_of: Sequence[int]) -> list[tuple[int, ...]]:
    """Per event ``i`` < ``n``, the indices ``k`` (ascending) with ``event_of[k] == i`` (-1: none)."""
    out: list[tuple[int, ...]] = [()] * n
    for k, i in enumerate(event_of):
        if i >= 0:
            out[i] += (k,)
    return out


def event_tables(trace: Trace) -> EventTables:
    """The trace's lookup lists, computed once per trace (kept in ``trace.derived``)."""
    t = trace.derived.get("sim")
    if t is None:
        t = trace.derived["sim"] = EventTables(trace)
    return t
