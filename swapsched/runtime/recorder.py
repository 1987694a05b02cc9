"""What the saved-tensor hooks record of a step: the Trace's events, tensors and timing.

:class:`TraceRecorder` numbers each saved tensor at its first pack, records every pack and unpack
with the compute gap before it (the host clock, or CUDA events read after the step), and builds
the Trace; :class:`OpNames` names the aten op behind each saved tensor, :class:`ModulePath` the
module it was saved in. ``profiler.profile`` and the runtime's profiling steps both record with
these.

Identity (R2): one tensor per storage, keyed by the address of the C++ ``StorageImpl``
(``untyped_storage()._cdata``), which is unique while the storage lives even on ``meta``, where data
pointers are all zero. An address can be reused once its storage dies, so each key is forgotten by a
``weakref.finalize`` on the storage (see :class:`StorageIds`); nothing is kept alive for identity.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import FlopCounterMode

from swapsched.errors import UserError
from swapsched.runtime.casts import Recast
from swapsched.runtime.mode_time import ModeTime
from swapsched.runtime.transients import OTHER_MEASURED, TransientMeter
from swapsched.trace import GRADIENTS_BORN, Event, TensorInfo, Trace

__all__ = ["ProfileError", "TraceRecorder", "OpNames", "ModulePath", "StorageIds", "is_parameter",
           "storage_key"]


class ProfileError(UserError):
    """The step could not be profiled (no saved tensors, or two passes disagree)."""


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage; valid on every device including ``meta`` (R2)."""
    return t.untyped_storage()._cdata


class StorageIds:
    """Maps live storages to values; an entry disappears when its storage dies, so a new storage
    that reuses the address is never mistaken for the old one (R2)."""

    def __init__(self) -> None:
        self._map: dict[int, Any] = {}
        self._finalizers: list[weakref.finalize] = []

    def get(self, t: torch.Tensor) -> Any:
        return self._map.get(storage_key(t))

    def __contains__(self, key: int) -> bool:
        """Whether the storage with this key (``storage_key``) has an entry."""
        return key in self._map

    def add(self, t: torch.Tensor, value: Any) -> None:
        st = t.untyped_storage()
        key = st._cdata
        self._map[key] = value
        self._finalizers.append(weakref.finalize(st, self._map.pop, key, None))

    def clear(self) -> None:
        """Forget every entry, and the finalizers on storages that outlive the map."""
        self._map.clear()
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one: a leaf that requires grad, or an ``nn.Parameter`` (a frozen
    one too: a LoRA model's base weight, R13), directly or through ``_base``. (Autocast's cast of
    one is not: it is packed as a ``casts.Recast``, R12.)"""
    base = t._base
    if isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter):
        return True
    if t.is_leaf:
        return t.requires_grad
    return base is not None and base.is_leaf and base.requires_grad


class OpNames(TorchDispatchMode):
    """Names the aten op that saved each tensor, and (given ``modules``) which op call made each
    storage, counted as selective checkpointing counts them.

    Autograd saves an op's *inputs* before it dispatches the op and its *outputs* after, and a
    dispatch mode runs below autograd. So a packed tensor that is an output of the op dispatched
    last was saved by that op; any other packed tensor is an input of the op dispatched next.

    ``producers`` maps a storage key to the op call that allocated it, once per module running
    then: ``(module path, op, n)``, the op's ``n``-th call within that module's forward. That is
    how ``torch.utils.checkpoint``'s selective policy knows an op call (per op, ignoring
    ``SAC_IGNORED_OPS``), so the runtime can tell a checkpointed block which calls to save (R9,
    selective; runtime/recompute.py). An op whose output shares an input's storage (a view, an
    in-place op) made nothing: the storage keeps its producer. ``paused``: the runtime's own
    hooks are copying, and their ops are not the model's.
    """

    def __init__(self, modules: ModulePath | None = None) -> None:
        super().__init__()
        self.last = ""
        self.last_outputs: set[int] = set()
        self.waiting: list[Callable[[str], None]] = []
        self.modules = modules
        self.producers: dict[int, tuple[tuple[str, Any, int], ...]] = {}
        self.calls: dict[tuple[int, Any], int] = {}  # (module invocation, op) -> calls so far
        self.paused = False
        self.timer: ModeTime | None = None  # charged with this mode's own time around each op (mode_time.py)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if self.paused:
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter()
        name = func.overloadpacket.__name__
        for assign in self.waiting:
            assign(name)
        self.waiting.clear()
        t1 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        t2 = time.perf_counter()
        self.last = name
        flat = out if isinstance(out, (tuple, list)) else (out,)
        self.last_outputs = {storage_key(x) for x in flat if isinstance(x, torch.Tensor)}
        if self.modules is not None and self.modules.stack and func not in SAC_IGNORED_OPS:
            self._count(self.modules, func, args, kwargs)
        if self.timer is not None:
            self.timer.own_s += (t1 - t0) + (time.perf_counter() - t2)
            self.timer.entries += 1
        return out

    def _count(self, modules: ModulePath, func: Any, args: Any, kwargs: Any) -> None:
        calls = self.calls
        keys = []
        for path, invocation in zip(modules.stack, modules.invocations, strict=True):
            n = calls.get((invocation, func), 0)
            calls[(invocation, func)] = n + 1
            keys.append((path, func, n))
        made = self.last_outputs - {storage_key(x) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
        for key in made:
            self.producers[key] = tuple(keys)

    def name_saver(self, t: torch.Tensor, assign: Callable[[str], None]) -> None:
        if storage_key(t) in self.last_outputs:
            assign(self.last)
        else:
            self.waiting.append(assign)


class ModulePath:
    """Tracks the module path of the forward code running now (global module hooks), and a
    number for each module call (``invocations``, parallel to ``stack``)."""

    def __init__(self, model: nn.Module):
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.invocations: list[int] = []
        self._calls = 0

    def __enter__(self) -> ModulePath:
        reg = torch.nn.modules.module
        self._handles = [reg.register_module_forward_pre_hook(self._enter), reg.register_module_forward_hook(self._leave)]
        return self

    # both hooks must return None: a value returned would replace the module's input or output
    def _enter(self, module: nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(id(module), type(module).__name__))
        self._calls += 1
        self.invocations.append(self._calls)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()
            self.invocations.pop()

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""


class TraceRecorder:
    """Turns a stream of pack/unpack hook calls into trace events (shared with the live runtime).

    ``pack`` returns the trace tensor id for a saved tensor, or ``None`` for a parameter. Gap
    times come from ``clock``: ``"cpu"`` (perf_counter, hook cost excluded, and ``timer``'s: the
    profiling modes' own time, mode_time.py), ``"cuda"`` (one event recorded per hook, resolved
    in :meth:`finish`), or ``None`` (no timing: meta).
    """

    def __init__(self, clock: str | None, ops: OpNames | None = None, flops: FlopCounterMode | None = None,
                 modules: ModulePath | None = None, transients: TransientMeter | None = None,
                 timer: ModeTime | None = None):
        self.clock, self.ops, self.flops, self.modules = clock, ops, flops, modules
        self.transients = transients  # R3's other bytes, measured (finish puts them on the events)
        self.ids = StorageIds()
        self.tensors: list[TensorInfo] = []
        self.op_names: list[str] = []
        self.kinds: list[str] = []
        self.tensor_of: list[int] = []
        self.gaps: list[float] = []
        self.flop_marks: list[float] = []
        self.cuda_entry: list[Any] = []  # one event as each hook starts ...
        self.cuda_exit: list[Any] = []  # ... and one as it ends: gap i = entry[i] - exit[i-1]
        self.hook_s = 0.0
        self._last = 0.0
        self.timer = timer
        self._modes_last = 0.0  # timer.total_s() at _last

    def _modes_since(self) -> float:
        """The profiling modes' seconds since the last hook ended (or the clock started)."""
        return 0.0 if self.timer is None else self.timer.total_s() - self._modes_last

    def start(self, since: float | None = None) -> None:
        """Start the clock; ``since``: the host time the step began, where the recording starts
        later than that (on the host clock only)."""
        if self.clock == "cuda":
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
            self.cuda_exit.append(self._start_event)
        self._last = time.perf_counter() if since is None else since
        self._modes_last = 0.0 if self.timer is None else self.timer.total_s()

    def _mark(self, t0: float) -> None:
        if self.clock == "cpu":
            self.gaps.append(max(t0 - self._last - self._modes_since(), 0.0))
        elif self.clock == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.cuda_entry.append(ev)
        if self.flops is not None:
            self.flop_marks.append(float(self.flops.get_total_flops()))

    def pack(self, t: torch.Tensor) -> int | None:
        t0 = time.perf_counter()
        if is_parameter(t):
            return None
        tid = self.ids.get(t)
        if tid is None:
            tid = len(self.tensors)
            self.ids.add(t, tid)
            self.tensors.append(
                TensorInfo(
                    id=tid, bytes=int(t.untyped_storage().nbytes()), shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                    module=self.modules.current if self.modules else "",
                )
            )
            self.op_names.append("")
            if self.ops is not None:
                self.ops.name_saver(t, partial(self.op_names.__setitem__, tid))
            if self.transients is not None:
                self.transients.saved(t, tid)
        self._mark(t0)
        self.kinds.append("pack")
        self.tensor_of.append(tid)
        self._end_hook(t0)
        return tid

    def unpack(self, tid: int | None) -> None:
        if tid is None:
            return
        t0 = time.perf_counter()
        self._mark(t0)
        self.kinds.append("unpack")
        self.tensor_of.append(tid)
        self._end_hook(t0)

    def _end_hook(self, t0: float) -> None:
        self._hook_t0, self._hook_s_before = t0, self.hook_s
        self.hook_done()

    def hook_done(self) -> None:
        """The hook's work ends now: what a caller does in its hook after ``pack``/``unpack`` (a
        synchronous copy, say) is hook time, not compute, and is left out of the next gap."""
        self._last = time.perf_counter()
        self._modes_last = 0.0 if self.timer is None else self.timer.total_s()
        if self.clock == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            if len(self.cuda_exit) > len(self.cuda_entry):
                self.cuda_exit[-1] = ev
            else:
                self.cuda_exit.append(ev)
        self.hook_s = self._hook_s_before + (self._last - self._hook_t0)

    def finish(self, name: str, device: str, static: int, timing: str, exclude: frozenset[int] = frozenset(),
               released: dict[int, int] | None = None, freed: dict[int, int] | None = None,
               static_tensors: Iterable[torch.Tensor] = ()) -> Trace:
        """Build the Trace. Tensors never unpacked, and those in ``exclude`` (ids in order of first
        sight: storages the runtime found held by someone else), are dropped; their gaps merge into
        the next event's. ``released``: id -> the hook call before which the program let go of the
        tensor, which becomes its ``released_at`` (R2); ``freed``: id -> the hook call before which
        its last unpacked copy died, which becomes its ``freed_at`` (R2). With a transient meter,
        each event's ``other_bytes`` (R3) is the most its gap held beyond the trace's tensors and
        ``static_tensors`` (those counted in ``static``: parameters' gradients)."""
        end = time.perf_counter()
        n = len(self.kinds)
        if self.clock == "cuda":
            end_ev = torch.cuda.Event(enable_timing=True)
            end_ev.record()
            torch.cuda.synchronize()
            gaps = [a.elapsed_time(b) / 1e3 for a, b in zip(self.cuda_exit[:n], self.cuda_entry, strict=False)]
            tail = self.cuda_exit[n].elapsed_time(end_ev) / 1e3
        elif self.clock == "cpu":
            gaps, tail = self.gaps, max(end - self._last - self._modes_since(), 0.0)
        else:
            gaps, tail = [0.0] * n, 0.0
        total_flops = float(self.flops.get_total_flops()) if self.flops is not None else None
        marks_f = [0.0, *self.flop_marks] if self.flops is not None else None
        unpacked = {self.tensor_of[i] for i in range(n) if self.kinds[i] == "unpack"}
        keep = sorted(unpacked - exclude)
        remap = {old: new for new, old in enumerate(keep)}
        self.remap = remap  # order of first sight -> trace tensor id (the live runtime replays it)
        events: list[Event] = []
        new_index = [0] * (n + 1)  # recorded hook call -> trace event (a dropped one merges into the next)
        carry_s, carry_f = 0.0, 0.0
        for i in range(n):
            new_index[i] = len(events)
            g = gaps[i]
            f = (marks_f[i + 1] - marks_f[i]) if marks_f else None
            if self.tensor_of[i] not in remap:
                carry_s += g
                carry_f += f or 0.0
                continue
            events.append(Event(self.kinds[i], remap[self.tensor_of[i]], g + carry_s,
                                None if f is None else f + carry_f))
            carry_s, carry_f = 0.0, 0.0
        new_index[n] = len(events)
        self.event_index = new_index  # recorded hook call -> its trace event (the runtime places rebuilt bytes by it)
        if self.transients is not None and events:
            per_call = self.transients.per_call(n, saved=set(keep) | exclude, static=static_tensors)
            other = [0] * len(events)
            for call, held in enumerate(per_call[:n]):  # a dropped call's gap merged into the next event's
                j = min(new_index[call], len(events) - 1)  # (after the last event: the tail's, below)
                other[j] = max(other[j], held)
            # R3: the compute after the last event counts in the last gap, where the tensor that
            # event unpacked is resident, and R2 frees it at that last unpack: the tail holds
            # what it measured, less that tensor
            last = events[-1]
            credit = self.tensors[keep[last.tensor]].bytes if last.kind == "unpack" else 0
            other[-1] = max(other[-1], per_call[n] - credit)
            events = [replace(e, other_bytes=o) for e, o in zip(events, other, strict=True)]
        born: dict[int, int] = {}  # R3: trace event -> bytes of the gradients born in its gap
        if self.transients is not None and self.transients.grads_born and events:
            for call, nbytes in self.transients.births:
                j = min(new_index[min(call, n)], len(events) - 1)
                born[j] = born.get(j, 0) + nbytes

        def event_of(calls: dict[int, int] | None, old: int) -> int | None:
            # died in the gap before hook call r: held through the gap of the event r became
            if not calls or old not in calls:
                return None
            return min(new_index[calls[old]], len(events) - 1)

        tensors = tuple(replace(self.tensors[old], id=new, op=self.op_names[old], released_at=event_of(released, old),
                                freed_at=event_of(freed, old))
                        for new, old in enumerate(keep))
        if not events:
            raise ProfileError(f"{name}: the step saved no tensors for backward; there is nothing to swap")
        tail_flops = (total_flops - marks_f[-1] + carry_f) if marks_f and total_flops is not None else 0.0
        return Trace(
            name=name, timing=timing, device=device, static_bytes=int(static), tail_compute_s=float(tail + carry_s),
            tensors=tensors, events=tuple(events),
            meta={"tail_flops": tail_flops, "hook_s_per_event": self.hook_s / max(n, 1), "dropped_never_unpacked": len(self.tensors) - len(unpacked),
                  # R3: whether each gap's other bytes were measured (a whole step under the
                  # transient meter) or only sampled (a step handed over mid-step): shapes.py
                  # predicts other sizes' other bytes from measured traces only
                  OTHER_MEASURED: self.transients is not None,
                  **({GRADIENTS_BORN: sorted([j, b] for j, b in born.items())}
                     if self.transients is not None and self.transients.grads_born else {})},
        )

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> Any:
            recast = Recast.of(t)  # R12: a parameter's compute copy is made again at unpack
            if recast is not None:
                return recast
            tid = self.pack(t)
            return (tid, t)

        def unpack(packed: Any) -> torch.Tensor:
            if type(packed) is Recast:
                return packed.make()
            tid, t = packed
            self.unpack(tid)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
