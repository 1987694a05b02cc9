"""What a well-formed trace is (R1/R2 preconditions): the checks a trace file and a trace made in
memory both pass, and :class:`TraceError`, which names the field and the value."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from swapsched.errors import UserError
from swapsched.state import StateGroup, check_groups

__all__ = ["TIMINGS", "TraceError", "TraceFields", "validate_trace"]

TIMINGS = ("measured", "roofline")


class TraceError(UserError):
    """A trace file or trace object is malformed. The message names the file, field and value."""


class TraceFields(Protocol):
    """What :func:`validate_trace` reads of a trace (``swapsched.trace.Trace`` has it)."""

    @property
    def timing(self) -> str: ...
    @property
    def static_bytes(self) -> int: ...
    @property
    def tail_compute_s(self) -> float: ...
    @property
    def state(self) -> tuple[StateGroup, ...]: ...
    @property
    def tensors(self) -> Sequence[Any]: ...
    @property
    def events(self) -> Sequence[Any]: ...


def validate_trace(trace: TraceFields, source: str) -> None:
    """Structural checks shared by files and in-memory construction (R1/R2 preconditions)."""

    def fail(where: str, msg: str) -> None:
        raise TraceError(f"{source}: field {where}: {msg}")

    if trace.timing not in TIMINGS:
        fail("timing", f"expected one of {list(TIMINGS)}, got {trace.timing!r}")
    if trace.static_bytes < 0:
        fail("static_bytes", f"must be >= 0, got {trace.static_bytes!r}")
    if not (trace.tail_compute_s >= 0 and math.isfinite(trace.tail_compute_s)):
        fail("tail_compute_s", f"must be a finite number >= 0, got {trace.tail_compute_s!r}")
    if trace.state:
        wrong = check_groups(trace.state, len(trace.events), int(trace.static_bytes))
        if wrong:
            fail("state", wrong)
    world = getattr(trace, "world_size", 1)
    if not (isinstance(world, int) and world >= 1):
        fail("world_size", f"must be a positive integer, got {world!r}")
    if world > 1 and not (trace.state and all(g.gather_bytes > 0 for g in trace.state if g.params)):
        fail("world_size", f"a sharded trace ({world} ranks) records each unit's state and its all-gather bytes")
    n = len(trace.tensors)
    for k, t in enumerate(trace.tensors):
        if t.id != k:
            fail(f"tensors[{k}].id", f"tensor ids must be 0..n-1 in order, got {t.id!r}")
        if t.bytes < 0:
            fail(f"tensors[{k}].bytes", f"must be >= 0, got {t.bytes!r}")
        if t.released_at is not None and not 0 <= t.released_at < len(trace.events):
            fail(f"tensors[{k}].released_at", f"must be an event index in [0, {len(trace.events)}), got {t.released_at!r}")
        if t.freed_at is not None and not 0 <= t.freed_at < len(trace.events):
            fail(f"tensors[{k}].freed_at", f"must be an event index in [0, {len(trace.events)}), got {t.freed_at!r}")
    packed = [False] * n
    unpacked = [False] * n
    for i, e in enumerate(trace.events):
        if e.kind not in ("pack", "unpack"):
            fail(f"events[{i}].kind", f"expected 'pack' or 'unpack', got {e.kind!r}")
        if not 0 <= e.tensor < n:
            fail(f"events[{i}].tensor", f"tensor id {e.tensor!r} out of range: the trace has {n} tensors")
        if not (e.compute_s >= 0 and math.isfinite(e.compute_s)):
            fail(f"events[{i}].compute_s", f"must be a finite number >= 0, got {e.compute_s!r}")
        if e.other_bytes is not None and e.other_bytes < 0:
            fail(f"events[{i}].other_bytes", f"must be >= 0, got {e.other_bytes!r}")
        if e.kind == "pack":
            packed[e.tensor] = True
        else:
            if not packed[e.tensor]:
                fail(f"events[{i}]", f"unpack of tensor {e.tensor} before its pack")
            unpacked[e.tensor] = True
    for k in range(n):
        if not packed[k]:
            fail(f"tensors[{k}]", "never packed: every tensor needs a pack event")
        if not unpacked[k]:
            fail(f"tensors[{k}]", "never unpacked: every saved tensor needs an unpack event")
