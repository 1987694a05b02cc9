"""The Trace on disk: versioned JSON (``.json`` or ``.json.gz``), DESIGN.md "File formats".

:func:`load_trace` validates everything and raises :class:`~swapsched.trace.TraceError` naming
the file, the field and the offending value; :func:`save_trace` writes what it reads back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swapsched.jsonfile import Fields, open_json, write_json
from swapsched.state import StateGroup
from swapsched.trace import TIMINGS, Event, TensorInfo, Trace, TraceError, validate_trace

__all__ = ["FORMAT", "VERSION", "READS", "load_trace", "save_trace", "trace_from_dict", "trace_to_dict"]

FORMAT = "swapsched.trace"
#: 2 adds ``state`` (R13: parameters, gradients and optimizer state per group); a version-1 file
#: still loads, with no state: everything in ``static_bytes``, as it meant then. 3 adds
#: ``world_size`` and each group's ``gather_bytes`` and ``reduce_bytes`` (a sharded step,
#: swapsched/sharding.py); a version-2 file loads as one device's step. 4 adds a group's
#: ``frozen`` (R13: parameters that do not train); a version-3 file's groups all train. A
#: group's optional ``tensors`` (its parameter tensors, a copy each) reads as 1 where absent.
VERSION = 4
READS = (1, 2, 3, 4)
_GROUP_FIELDS = ("params", "param_bytes", "grad_bytes", "optim_bytes", "forward_at", "forward_end", "backward_at", "grad_at")


def trace_to_dict(trace: Trace) -> dict[str, Any]:
    """``trace`` as the file format's JSON object."""
    def ev(e: Event) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": e.kind, "tensor": e.tensor, "compute_s": e.compute_s}
        if e.flops is not None:
            d["flops"] = e.flops
        if e.other_bytes is not None:
            d["other_bytes"] = e.other_bytes
        return d

    return {
        "format": FORMAT,
        "version": VERSION,
        "name": trace.name,
        "timing": trace.timing,
        "device": trace.device,
        "static_bytes": int(trace.static_bytes),
        "tail_compute_s": float(trace.tail_compute_s),
        "meta": trace.meta,
        "tensors": [_tensor_dict(t) for t in trace.tensors],
        "events": [ev(e) for e in trace.events],
        "state": [{"name": g.name, **{k: int(getattr(g, k)) for k in _GROUP_FIELDS},
                   **({"gather_bytes": g.gather_bytes, "reduce_bytes": g.reduce_bytes} if trace.world_size > 1 else {}),
                   **({"frozen": True} if g.frozen else {}), **({"tensors": g.tensors} if g.tensors != 1 else {})}
                  for g in trace.state],
        "world_size": trace.world_size,
    }


def _tensor_dict(t: TensorInfo) -> dict[str, Any]:
    d: dict[str, Any] = {"id": t.id, "bytes": t.bytes, "shape": list(t.shape), "dtype": t.dtype, "op": t.op,
                         "module": t.module}
    if t.released_at is not None:
        d["released_at"] = t.released_at
    if t.freed_at is not None:
        d["freed_at"] = t.freed_at
    return d


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` to ``path`` (``.json``, or ``.json.gz`` compressed)."""
    return write_json(trace_to_dict(trace), path)


def trace_from_dict(data: Any, source: str = "<dict>") -> Trace:
    """The trace in ``data`` (the file format's JSON object), every field checked; errors name
    ``source``, the field and the value."""
    f = Fields(source, TraceError)
    if not isinstance(data, dict):
        raise TraceError(f"{source}: expected a JSON object at the top level, got {type(data).__name__}")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise TraceError(f"{source}: field format: expected {FORMAT!r}, got {fmt!r} (is this a swapsched trace?)")
    ver = data.get("version")
    if ver not in READS:
        raise TraceError(f"{source}: field version: this swapsched reads versions {', '.join(map(str, READS))}, got {ver!r}")
    name = f.get(data, "name", "name", str)
    timing = f.get(data, "timing", "timing", str)
    if timing not in TIMINGS:
        f.fail("timing", f"expected one of {list(TIMINGS)}, got {timing!r}")
    device = f.get(data, "device", "device", str)
    static = f.number(data, "static_bytes", "static_bytes", integer=True)
    tail = f.number(data, "tail_compute_s", "tail_compute_s")
    meta = f.get(data, "meta", "meta", dict, optional=True) or {}
    raw_tensors = f.get(data, "tensors", "tensors", list)
    tensors = []
    for k, t in enumerate(raw_tensors):
        w = f"tensors[{k}]"
        tid = f.number(t, "id", f"{w}.id", integer=True)
        if tid != k:
            f.fail(f"{w}.id", f"tensor ids must be 0..n-1 in order, got {tid!r} at position {k}")
        shape = f.get(t, "shape", f"{w}.shape", list, optional=True) or []
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            f.fail(f"{w}.shape", f"expected a list of non-negative integers, got {shape!r}")
        tensors.append(
            TensorInfo(
                id=tid,
                bytes=f.number(t, "bytes", f"{w}.bytes", integer=True),
                shape=tuple(shape),
                dtype=f.get(t, "dtype", f"{w}.dtype", str, optional=True) or "",
                op=f.get(t, "op", f"{w}.op", str, optional=True) or "",
                module=f.get(t, "module", f"{w}.module", str, optional=True) or "",
                released_at=f.number(t, "released_at", f"{w}.released_at", optional=True, integer=True),
                freed_at=f.number(t, "freed_at", f"{w}.freed_at", optional=True, integer=True),
            )
        )
    raw_events = f.get(data, "events", "events", list)
    events = []
    for i, e in enumerate(raw_events):
        w = f"events[{i}]"
        kind = f.get(e, "kind", f"{w}.kind", str)
        if kind not in ("pack", "unpack"):
            f.fail(f"{w}.kind", f"expected 'pack' or 'unpack', got {kind!r}")
        events.append(
            Event(
                kind=kind,
                tensor=f.number(e, "tensor", f"{w}.tensor", integer=True),
                compute_s=float(f.number(e, "compute_s", f"{w}.compute_s")),
                flops=f.number(e, "flops", f"{w}.flops", optional=True),
                other_bytes=f.number(e, "other_bytes", f"{w}.other_bytes", optional=True, integer=True),
            )
        )
    state = []
    for k, g in enumerate(f.get(data, "state", "state", list, optional=True) or [] if ver >= 2 else []):
        w = f"state[{k}]"
        sharded = {x: f.number(g, x, f"{w}.{x}", integer=True, optional=True) or 0
                   for x in ("gather_bytes", "reduce_bytes")} if ver >= 3 else {}
        frozen = f.get(g, "frozen", f"{w}.frozen", bool, optional=True) if ver >= 4 else None
        copies = f.number(g, "tensors", f"{w}.tensors", integer=True, optional=True)  # its parameter tensors
        state.append(StateGroup(name=f.get(g, "name", f"{w}.name", str),
                                **{x: f.number(g, x, f"{w}.{x}", integer=True) for x in _GROUP_FIELDS}, **sharded,
                                frozen=bool(frozen), tensors=1 if copies is None else max(int(copies), 1)))
    world = f.number(data, "world_size", "world_size", integer=True, optional=True) if ver >= 3 else None
    trace = object.__new__(Trace)
    fields: dict[str, Any] = dict(
        name=name, timing=timing, device=device, static_bytes=static, tail_compute_s=float(tail),
        tensors=tuple(tensors), events=tuple(events), meta=meta, state=tuple(state), world_size=1 if world is None else world,
    )
    for attr, value in fields.items():
        object.__setattr__(trace, attr, value)
    object.__setattr__(trace, "derived", {})
    validate_trace(trace, source)
    return trace



def load_trace(path: str | Path) -> Trace:
    """Load and validate a trace file (``.json`` or ``.json.gz``)."""
    return trace_from_dict(open_json(path, TraceError), source=str(path))
