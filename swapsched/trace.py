"""The Trace: one measured training step, as the saved-tensor hooks saw it (DESIGN.md, R1/R2).

A trace is an ordered list of events (``pack`` in forward, ``unpack`` in backward), the compute
time in the gap before each event, every saved tensor's size and provenance, and the memory that
cannot be swapped (``static_bytes``: parameters, gradients, optimizer state). It is the only thing
policies and the simulator know about a model.

On disk it is versioned JSON (``trace_file.py``); a trace made in memory is checked as a file is
(:func:`validate_trace`), and a bad one raises :class:`TraceError` naming the field and the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from swapsched.segments import Segment, rebuilt_selectively, recompute_transient, segment_of
from swapsched.state import MEASURED_OPTIMIZER_RATES, StateGroup, module_of
from swapsched.trace_check import TIMINGS, TraceError, validate_trace

if TYPE_CHECKING:
    from swapsched.hardware import Hardware

__all__ = ["TensorInfo", "Event", "Trace", "TraceError", "validate_trace", "TIMINGS", "GRADIENTS_BORN",
           "STATE_GRADIENTS_BORN"]

#: R3, gradients from their birth: the meta key listing, as ``[event, bytes]`` pairs, the
#: gradients born in each event's gap, which its other bytes count from there on (a trace that
#: counts them as the training state's, static all step, has none)
GRADIENTS_BORN = "gradients_born"
#: R3 with R13: true where the step began with no gradient (``Trace.state_gradients_born``)
STATE_GRADIENTS_BORN = "state_gradients_born"


@dataclass(frozen=True)
class TensorInfo:
    """One saved tensor (one storage, R2)."""

    id: int
    bytes: int
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    op: str = ""  # the aten op whose backward saved it (the op that packed it first)
    module: str = ""  # module path active when it was first packed
    # R2: the event through whose gap the program itself (not autograd) still holds the storage;
    # a swap-out frees the bytes only after it. Measured by the live runtime's profiling steps;
    # None: through the last forward pack (where the program hands it to autograd a last time)
    released_at: int | None = None
    # R2: the event through whose gap the storage lives after its last unpack (autograd's node that
    # read it frees it once it has run, and a node reads all its saved tensors before it runs);
    # None: freed at its last unpack
    freed_at: int | None = None


@dataclass(frozen=True)
class Event:
    """One saved-tensor hook call. ``compute_s`` is the compute in the gap just before it (R1)."""

    kind: str  # "pack" | "unpack"
    tensor: int
    compute_s: float
    flops: float | None = None
    other_bytes: int | None = None  # non-saved device memory live during the gap before it (R3)


#: Trace's cached tables that depend only on its structure (the events' kinds and tensors, the
#: tensors' modules, ops and R2 fields), not on bytes or times: Trace.resized shares them
_STRUCTURAL = ("event_kind_is_unpack", "event_tensor", "first_pack", "first_unpack", "last_unpack",
               "last_forward_pack", "release", "freed", "backward_start", "_segment_structure")


@dataclass(frozen=True)
class Trace:
    """One training step: tensors, events and static memory (DESIGN.md "Trace")."""

    name: str
    timing: str
    device: str
    static_bytes: int
    tail_compute_s: float
    tensors: tuple[TensorInfo, ...]
    events: tuple[Event, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    #: The training state per group (R13, swapsched/state.py): parameters, gradients and
    #: optimizer state with their times of use. Their bytes are inside ``static_bytes`` (what no
    #: activation plan moves); a state plan may move them. Empty: a trace of format version 1, or
    #: profiled without an optimizer: everything static.
    state: tuple[StateGroup, ...] = ()
    #: Ranks of a sharded step (FSDP2 / ZeRO-3, ``swapsched/sharding.py``): this trace is one
    #: rank's, its state groups the rank's shards of each unit; ranks are symmetric. 1: one device.
    world_size: int = 1
    #: Tables derived from this (immutable) trace by the layers above, computed once: the
    #: simulator's event tables under "sim", the env's decision tables under ("env", hardware).
    #: Never serialized, never compared.
    derived: dict[Any, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_trace(self, source="<trace object>")

    # ---------------------------------------------------------------- derived tables (cached)
    @property
    def fixed_bytes(self) -> int:
        """What no plan moves: ``static_bytes`` less the state's bytes (buffers, frozen parameters)."""
        return int(self.static_bytes) - sum(g.bytes for g in self.state)

    @property
    def n_tensors(self) -> int:
        return len(self.tensors)

    @property
    def n_events(self) -> int:
        return len(self.events)

    @cached_property
    def tensor_bytes(self) -> np.ndarray:
        return np.array([t.bytes for t in self.tensors], dtype=np.int64)

    @cached_property
    def event_kind_is_unpack(self) -> np.ndarray:
        return np.array([e.kind == "unpack" for e in self.events], dtype=bool)

    @cached_property
    def event_tensor(self) -> np.ndarray:
        return np.array([e.tensor for e in self.events], dtype=np.int64)

    @cached_property
    def gaps(self) -> np.ndarray:
        """Compute time before each event, seconds (R1)."""
        return np.array([e.compute_s for e in self.events], dtype=np.float64)

    @cached_property
    def other_bytes(self) -> np.ndarray:
        return np.array([e.other_bytes or 0 for e in self.events], dtype=np.int64)

    @cached_property
    def event_times(self) -> np.ndarray:
        """Ideal time of each event (no stalls, R1): the sum of the gaps up to and including its own."""
        return np.cumsum(self.gaps)

    @cached_property
    def ideal_s(self) -> float:
        """Ideal step time with infinite memory (R1)."""
        return float(self.gaps.sum() + self.tail_compute_s)

    @cached_property
    def first_pack(self) -> np.ndarray:
        return self._first_event("pack")

    @cached_property
    def first_unpack(self) -> np.ndarray:
        return self._first_event("unpack")

    @cached_property
    def last_unpack(self) -> np.ndarray:
        out = np.full(self.n_tensors, -1, dtype=np.int64)
        for i, e in enumerate(self.events):
            if e.kind == "unpack":
                out[e.tensor] = i
        return out

    @cached_property
    def last_forward_pack(self) -> np.ndarray:
        """The last pack of each tensor before its first unpack: the earliest event at which
        evicting it actually frees it (every forward reference has been handed to autograd)."""
        out = self.first_pack.copy()
        fu = self.first_unpack
        for i, e in enumerate(self.events):
            if e.kind == "pack" and i < fu[e.tensor]:
                out[e.tensor] = i
        return out

    @cached_property
    def release(self) -> np.ndarray:
        """Per tensor, the event through whose gap the program holds it (R2): ``released_at``
        where the trace measured it, else the last forward pack."""
        return self._measured_or(self.last_forward_pack, "released_at")

    @cached_property
    def freed(self) -> np.ndarray:
        """Per tensor, the event through whose gap it occupies memory after its last use (R2):
        ``freed_at`` where the trace measured it, else its last unpack."""
        return self._measured_or(self.last_unpack, "freed_at")

    def _measured_or(self, default: np.ndarray, field: str) -> np.ndarray:
        """Per tensor, the event a profile measured in ``field``, never before ``default``'s."""
        out = default.copy()
        for t in self.tensors:
            e = getattr(t, field)
            if e is not None:
                out[t.id] = max(int(e), int(out[t.id]))
        return out

    @cached_property
    def segments(self) -> tuple[Segment, ...]:
        """The recomputable blocks (R9), in forward order. A block qualifies when a recompute can
        stand in for its members: each is packed only before ``at`` (nothing saves it again after
        backward starts on it), and the anchor is still needed at ``at`` (so a checkpoint holds it)."""
        out: list[Segment] = []
        other, first = self.other_bytes, self.first_pack
        for name, anchor, members, at, fwd, cheap, cheap_fwd in self._segment_structure:
            flops = [f for f in (self.events[i].flops for i in fwd) if f is not None]
            out.append(Segment(len(out), name, anchor, members, at, float(sum(self.events[i].compute_s for i in fwd)),
                               int(sum(self.tensors[k].bytes for k in members)),
                               float(sum(flops)) if fwd and len(flops) == len(fwd) else None,
                               cheap, float(sum(self.events[i].compute_s for i in cheap_fwd)),
                               int(sum(self.tensors[k].bytes for k in cheap)),
                               recompute_transient({k: (int(first[k]), self.tensors[k].bytes) for k in members}, fwd, other)))
        return tuple(out)

    @cached_property
    def _segment_structure(self) -> tuple[tuple[str, int, tuple[int, ...], int, list[int], tuple[int, ...], list[int]], ...]:
        """Per block of :attr:`segments`: its name, anchor, members, ``at``, the events of its
        forward packs, its cheap members and their forward packs. Structure only (no bytes, no
        times): a resized trace shares it."""
        # container -> element index -> its tensors
        elements: dict[str, dict[int, list[int]]] = {}
        for t in self.tensors:
            where = segment_of(t.module)
            if where is not None and self.first_pack[t.id] >= 0 and self.first_unpack[t.id] >= 0:
                elements.setdefault(where[0], {}).setdefault(where[1], []).append(t.id)
        groups: dict[str, list[int]] = {}
        for container, by_index in elements.items():
            prefix = f"{container}." if container else ""
            idx = sorted(by_index)
            if np.median([len(by_index[i]) for i in idx]) > 1:
                for i in idx:  # blocks of several layers: one checkpoint each
                    groups[f"{prefix}{i}"] = by_index[i]
                continue
            # single layers (a Sequential of convs and activations): consecutive runs of about
            # sqrt(n) layers, as torch.utils.checkpoint.checkpoint_sequential would cut them
            size = max(2, round(math.sqrt(len(idx))))
            for c in range(0, len(idx), size):
                run = idx[c:c + size]
                groups[f"{prefix}{run[0]}-{run[-1]}"] = [k for i in run for k in by_index[i]]
        last_pack = np.full(self.n_tensors, -1, dtype=np.int64)
        for i, e in enumerate(self.events):
            if e.kind == "pack":
                last_pack[e.tensor] = i
        out = []
        bstart = self.backward_start
        for name, ids in sorted(groups.items(), key=lambda kv: min(int(self.first_pack[k]) for k in kv[1])):
            ids.sort(key=lambda k: (int(self.first_pack[k]), k))
            anchor, members = ids[0], tuple(ids[1:])
            if not members:
                continue
            at = int(min(self.first_unpack[k] for k in members))
            if any(last_pack[k] >= at for k in members) or self.last_unpack[anchor] < at:
                continue
            mine = set(ids)
            fwd = [i for i, e in enumerate(self.events[:bstart]) if e.kind == "pack" and e.tensor in mine]
            cheap = tuple(k for k in members if rebuilt_selectively(self.tensors[k].op))
            out.append((name, anchor, members, at, fwd, cheap, [i for i in fwd if self.events[i].tensor in cheap]))
        return tuple(out)

    def with_segments(self, keep: Callable[[Segment], bool], *, selective: bool = True) -> Trace:
        """A copy of this trace whose recomputable blocks are only those ``keep`` accepts
        (re-indexed in order), and with ``selective=False`` none of them selectively: what a planner
        may recompute where an executor cannot run it all."""
        out = replace(self)
        blocks = [s if selective else replace(s, cheap=(), cheap_forward_s=0.0, cheap_bytes=0)
                  for s in self.segments if keep(s)]
        # ``segments`` is a cached property: the copy's cache is set before anything reads it
        out.__dict__["segments"] = tuple(replace(sg, index=i) for i, sg in enumerate(blocks))
        return out

    def resized(self, tensor_bytes: Sequence[int], gaps: Sequence[float], other_bytes: Sequence[int | None], *,
                tail_compute_s: float, static_bytes: int, name: str, meta: dict[str, Any]) -> Trace:
        """This trace's structure (the same events of the same tensors, with their shapes, ops,
        modules and R2 fields) at other sizes and times: a member of its family
        (runtime/shapes.py). The tables that depend on the structure alone are shared, not
        computed again, so a run that meets a new size every step pays only for the sizes. Its
        blocks are those its modules give (R9): a :meth:`with_segments` restriction is not kept."""
        # only the sizes and times are new, so only they are checked (the structure was validated
        # with this trace); and the records are built without the frozen dataclasses' per-field
        # setattr: the live runtime does this on the training loop's thread for every new size
        if not (len(tensor_bytes) == self.n_tensors and len(gaps) == len(other_bytes) == self.n_events):
            raise TraceError(f"{name}: resized with {len(tensor_bytes)} sizes and {len(gaps)} gaps for "
                             f"{self.n_tensors} tensors and {self.n_events} events")
        sizes, times = np.asarray(tensor_bytes), np.asarray(gaps, dtype=np.float64)
        if ((sizes < 0).any() or not np.isfinite(times).all() or (times < 0).any()
                or not (tail_compute_s >= 0 and math.isfinite(tail_compute_s)) or static_bytes < 0):
            raise TraceError(f"{name}: resized to negative bytes or to times that are negative or not finite")
        tensors = tuple(_record(TensorInfo, {**t.__dict__, "bytes": int(b)})
                        for t, b in zip(self.tensors, tensor_bytes, strict=True))
        events = tuple(_record(Event, {"kind": e.kind, "tensor": e.tensor, "compute_s": float(g), "flops": e.flops,
                                       "other_bytes": o})
                       for e, g, o in zip(self.events, gaps, other_bytes, strict=True))
        out = _record(Trace, {"name": name, "timing": self.timing, "device": self.device,
                              "static_bytes": int(static_bytes), "tail_compute_s": float(tail_compute_s),
                              "tensors": tensors, "events": events, "meta": meta, "state": self.state, "derived": {}})
        for key in _STRUCTURAL:
            if key in self.__dict__:
                out.__dict__[key] = self.__dict__[key]
        return out

    @cached_property
    def backward_start(self) -> int:
        """Index of the first unpack: events before it are forward, the rest backward."""
        idx = np.flatnonzero(self.event_kind_is_unpack)
        return int(idx[0]) if idx.size else self.n_events

    def _first_event(self, kind: str) -> np.ndarray:
        out = np.full(self.n_tensors, -1, dtype=np.int64)
        for i, e in enumerate(self.events):
            if e.kind == kind and out[e.tensor] < 0:
                out[e.tensor] = i
        return out

    @cached_property
    def resident_bytes_no_swap(self) -> np.ndarray:
        """Saved bytes resident during the gap before each event with nothing evicted (R2):
        a tensor counts from the gap of its first pack through the gap of its last unpack."""
        delta = np.zeros(self.n_events + 1, dtype=np.int64)
        np.add.at(delta, self.first_pack, self.tensor_bytes)
        np.add.at(delta, self.freed + 1, -self.tensor_bytes)
        return np.cumsum(delta)[:-1]

    @cached_property
    def must_resident_bytes(self) -> np.ndarray:
        """Saved bytes that every plan must hold during the gap before each event (R4/R7): a tensor
        from the gap of its first pack through the gap of its release (the program still holds it
        there, so evicting it frees nothing in a real step; R2), and from its first unpack through
        its last."""
        delta = np.zeros(self.n_events + 1, dtype=np.int64)
        b = self.tensor_bytes
        np.add.at(delta, self.first_pack, b)
        np.add.at(delta, np.minimum(self.release, self.first_unpack - 1) + 1, -b)
        np.add.at(delta, self.first_unpack, b)
        np.add.at(delta, self.freed + 1, -b)
        return np.cumsum(delta)[:-1]

    @cached_property
    def unsharded_in_use_bytes(self) -> np.ndarray:
        """R18: what a sharded step holds unsharded during the gap before each event, whatever
        the plan, counted as :attr:`state_in_use_bytes` counts a group: a unit's unsharded
        parameters while forward and backward compute with it, and its unsharded gradient while
        backward makes it (``env/collectives.py`` adds the all-gathers issued ahead and the
        reduce-scatters' time); zeros on one device."""
        if self.world_size == 1:
            return np.zeros(self.n_events, dtype=np.int64)
        return self._in_use(lambda g: g.gather_bytes, lambda g: g.gather_bytes + g.reduce_bytes)

    def _in_use(self, forward: Callable[[StateGroup], int], backward: Callable[[StateGroup], int]) -> np.ndarray:
        """Per gap, each group's ``forward(g)`` bytes over the gaps forward computes with it
        (``forward_at..forward_end``) and its ``backward(g)`` bytes from the gap after its
        ``backward_at`` until its gradient completes."""
        n = self.n_events
        delta = np.zeros(n + 2, dtype=np.int64)
        for g in self.state:
            delta[g.forward_at] += forward(g)
            delta[g.forward_end + 1] -= forward(g)
            start = min(g.backward_at + 1, n)
            delta[start] += backward(g)
            delta[max(g.grad_at, start)] -= backward(g)
        return np.cumsum(delta)[:n]

    @cached_property
    def peak_bytes_no_swap(self) -> int:
        """Device peak with nothing evicted: static + max over gaps of (other + resident saved,
        + a sharded step's unsharded bytes in use, R18, - the state's gradients unborn, R3)."""
        if self.n_events == 0:
            return int(self.static_bytes)
        return int(self.static_bytes + (self.other_bytes + self.resident_bytes_no_swap + self.unsharded_in_use_bytes
                                        - self.state_gradients_unborn_bytes).max())

    @cached_property
    def gradients_born_so_far(self) -> np.ndarray:
        """R3: per event, the bytes of the gradients born in its gap and before
        (:data:`GRADIENTS_BORN`), which its other bytes count; zeros where gradients are static."""
        delta = np.zeros(self.n_events, dtype=np.int64)
        for event, nbytes in self.meta.get(GRADIENTS_BORN, ()):
            delta[min(int(event), self.n_events - 1)] += int(nbytes)
        return np.cumsum(delta)

    @property
    def state_gradients_born(self) -> bool:
        """R3 with R13 (:data:`STATE_GRADIENTS_BORN`): each gradient on the device from its group's
        ``backward_at``, not static all step; never in a sharded step (R18)."""
        return bool(self.state) and self.world_size == 1 and bool(self.meta.get(STATE_GRADIENTS_BORN, False))

    @cached_property
    def state_gradients_unborn_bytes(self) -> np.ndarray:
        """Per gap, the state's gradients the static bytes count but the step has not made yet (R3)."""
        unborn = np.zeros(self.n_events, dtype=np.int64)
        for g in self.state if self.state_gradients_born else ():
            unborn[: g.backward_at] += g.grad_bytes  # made at its end (state_parts.born_gradients_held)
        return unborn

    @cached_property
    def saved_bytes_peak(self) -> int:
        """Peak of saved-tensor bytes alone with nothing evicted."""
        return int(self.resident_bytes_no_swap.max()) if self.n_events else 0

    @cached_property
    def min_feasible_bytes(self) -> int:
        """The smallest budget any plan can meet: what must be resident at the worst gap (R4/R7, R3)."""
        if self.n_events == 0:
            return int(self.static_bytes)
        return int(self.static_bytes + (self.other_bytes + self.must_resident_bytes + self.unsharded_in_use_bytes
                                        - self.state_gradients_unborn_bytes).max())

    @cached_property
    def state_in_use_bytes(self) -> np.ndarray:
        """R13: state bytes every plan holds during the gap before each event, the state movable:
        a group's parameter while forward computes with it (gaps ``forward_at..forward_end``) and
        while backward does (from ``backward_at`` to its gradient's completion), and its
        gradient from ``backward_at`` until it completes (it is made on the device)."""
        return self._in_use(lambda g: g.param_bytes, lambda g: g.param_bytes + g.grad_bytes)

    @cached_property
    def min_feasible_bytes_movable(self) -> int:
        """The smallest budget any plan can meet with the state movable (R13): what must be
        resident at the worst gap, the state's part counted by :attr:`state_in_use_bytes`.
        Equal to :attr:`min_feasible_bytes` for a trace that records no state."""
        if not self.state:
            return self.min_feasible_bytes
        if self.n_events == 0:
            return self.fixed_bytes
        return int(self.fixed_bytes + (self.other_bytes + self.must_resident_bytes + self.state_in_use_bytes
                                       + self.unsharded_in_use_bytes).max())

    @property
    def forward_compute_s(self) -> float:
        return float(self.gaps[: self.backward_start].sum())

    @property
    def backward_compute_s(self) -> float:
        return float(self.gaps[self.backward_start :].sum() + self.tail_compute_s)

    def group_events(self, group: str) -> tuple[int, int, int, int]:
        """``(forward_at, forward_end, backward_at, grad_at)`` of state group ``group``
        (swapsched/state.py) from the saved tensors its modules packed; a group with none of its
        own is read in the first gap and its gradient completes at the tail."""
        module = module_of(group)  # a frozen group's modules are its trainable twin's
        ids = [t.id for t in self.tensors if t.module == module or t.module.startswith(module + ".")]
        fp, fu, lu = self.first_pack, self.first_unpack, self.last_unpack
        n = self.n_events
        if not ids or n == 0:
            return 0, 0, min(self.backward_start, max(n - 1, 0)), n
        return (min(int(fp[k]) for k in ids), max(int(self.last_forward_pack[k]) for k in ids),
                min(int(fu[k]) for k in ids), min(max(int(lu[k]) for k in ids) + 1, n))

    def with_timing(self, gaps: Sequence[float], tail_s: float, **meta: Any) -> Trace:
        """This trace with each event's gap and the tail replaced (the same events, re-measured),
        ``meta`` added."""
        if len(gaps) != self.n_events:
            raise TraceError(f"trace {self.name!r}: {len(gaps)} gaps for {self.n_events} events")
        events = tuple(replace(e, compute_s=float(g)) for e, g in zip(self.events, gaps, strict=True))
        return replace(self, events=events, tail_compute_s=float(tail_s), meta={**self.meta, **meta})

    def retimed(self, hardware: Hardware) -> Trace:
        """This trace with every gap re-timed by roofline for ``hardware``.

        A gap's time is ``max(flops / peak, traffic / memory_bytes_per_s)``, where ``peak`` is the
        hardware's matmul peak in the step's ``meta["compute_dtype"]`` (fp32 if absent) and traffic is
        a lower bound on the bytes the gap's compute touches: a pack gap writes the tensors it
        produces and reads them once (2 x bytes of tensors first packed there); an unpack gap
        reads the tensor and writes its gradient (2 x bytes). The tail after the last event is
        ``meta["tail_flops"] / peak`` (the profiler records those FLOPs; 0 if absent).
        """
        peak = hardware.peak_flops_for(str(self.meta.get("compute_dtype", "float32")))
        if any(e.flops is None for e in self.events):
            raise TraceError(
                f"trace {self.name!r}: retiming needs 'flops' on every event; re-profile with "
                "swapsched profile (it counts FLOPs per gap)"
            )
        fp = self.first_pack
        new_events = []
        for i, e in enumerate(self.events):
            if e.kind == "pack":
                traffic = 2.0 * self.tensors[e.tensor].bytes if fp[e.tensor] == i else 0.0
            else:
                traffic = 2.0 * self.tensors[e.tensor].bytes
            t = max(float(e.flops or 0.0) / peak, traffic / hardware.memory_bytes_per_s)
            new_events.append(replace(e, compute_s=t))
        tail = float(self.meta.get("tail_flops", 0.0)) / peak
        return replace(
            self,
            timing="roofline",
            device=hardware.name,
            tail_compute_s=tail,
            events=tuple(new_events),
            # the optimizer's measured rates (R15) are the profiling machine's, like its gaps
            meta={**{k: v for k, v in self.meta.items() if k != MEASURED_OPTIMIZER_RATES}, "retimed_from": self.device},
        )

_R = TypeVar("_R")


def _record(cls: type[_R], fields: dict[str, Any]) -> _R:
    """An instance of the frozen dataclass ``cls`` with exactly ``fields`` (every field), built
    without its ``__init__``: for records whose values are already checked (``Trace.resized``)."""
    out = object.__new__(cls)
    out.__dict__.update(fields)
    return out
