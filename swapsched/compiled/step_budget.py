"""The step's budget across its compiled graphs (R10, *Budgets across graphs*).

A user's budget is the training step's, not each graph's: a model with a graph break compiles
to several graphs, and their forwards run one after another, each holding what its plan keeps
(saved tensors, unoffloadable bytes) until its backward, which runs after every later graph's.
So while graph *p* of the step runs, the device holds the static bytes of every graph, what each
earlier forward run keeps, and graph *p*'s own activations::

    step peak = statics + max over runs p of ( sum of held[q] for the runs q before p  +  peak[p] )

Seen from an earlier graph, every later run (forward and backward) happens in the gap before its
own first unpack: a graph planned knowing what runs after it is planned on its trace with those
bytes added to that gap's non-saved bytes (R3, :func:`with_nested`), so its plan keeps room for
them. The step's smallest feasible budget follows from the last run back (:func:`smallest_step`).

A relative budget (``"60%"``) is that share of the step's activation peak with nothing evicted
(the same formula with no-swap figures); a byte budget less the graphs' static bytes is the
step's activation budget. A graph that runs several times before the backward (per-block compile
of identical blocks) counts once per run.

Everything here is arithmetic on :class:`GraphMemory` records; planning is the backend's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from swapsched.budget import parse_budget
from swapsched.plan import SwapPlan
from swapsched.trace import Trace

__all__ = ["GraphMemory", "graph_memory", "held_after_forward", "is_relative", "activation_budget", "step_peak",
           "with_nested", "nested_min", "smallest_step"]


@dataclass(frozen=True)
class GraphMemory:
    """What one graph weighs in its step, in bytes above its own static bytes (but ``static``).
    ``peak`` and ``held`` are its plan's (the no-swap figures before it is planned)."""

    static: int  # the parameters and buffers its forward reads (the trace's static bytes)
    peak: int  # its activation peak under its plan, as simulated
    held: int  # what it holds from its forward's end to its backward under its plan
    peak_no_swap: int
    held_no_swap: int
    min_peak: int  # the least any plan can hold at its own worst gap (the trace's smallest feasible budget)


def held_after_forward(trace: Trace, evicted: frozenset[int] | set[int] = frozenset()) -> int:
    """Saved bytes a plan keeps after the forward, plus what no plan can move (held bytes)."""
    kept = int(trace.tensor_bytes.sum()) - sum(int(trace.tensor_bytes[k]) for k in evicted)
    held = int(trace.other_bytes[trace.backward_start]) if trace.backward_start < trace.n_events else 0
    return kept + held


def graph_memory(trace: Trace, plan: SwapPlan | None = None, planned_peak: int | None = None) -> GraphMemory:
    """A graph's record; without ``plan`` its planned figures are the no-swap ones."""
    static = int(trace.static_bytes)
    peak_no_swap = int(trace.peak_bytes_no_swap) - static
    held_no_swap = held_after_forward(trace)
    if plan is None:
        peak, held = peak_no_swap, held_no_swap
    else:
        # a recomputed block's members are gone after the forward too (R9): what the plan keeps
        gone = set(plan.evicted) | {k for s in trace.segments if s.name in plan.recompute for k in s.members}
        gone |= {k for s in trace.segments if s.name in plan.selective for k in s.cheap}
        peak = (planned_peak if planned_peak is not None else int(trace.peak_bytes_no_swap)) - static
        held = held_after_forward(trace, gone)
    return GraphMemory(static, peak, held, peak_no_swap, held_no_swap, int(trace.min_feasible_bytes) - static)


def is_relative(spec: str | int | float) -> bool:
    return isinstance(spec, str) and spec.strip().endswith("%")


def step_peak(runs: Sequence[int], graphs: Mapping[int, GraphMemory], *, no_swap: bool = False) -> int:
    """The step's activation peak (module docstring) over ``runs``, the graphs' forward runs in order."""
    before, out = 0, 0
    for i in runs:
        g = graphs[i]
        out = max(out, before + (g.peak_no_swap if no_swap else g.peak))
        before += g.held_no_swap if no_swap else g.held
    return out


def activation_budget(spec: str | int | float, runs: Sequence[int], graphs: Mapping[int, GraphMemory]) -> int:
    """The step's budget above the static bytes of its graphs."""
    if is_relative(spec):
        pct = float(str(spec).strip()[:-1])
        return int(math.floor(step_peak(runs, graphs, no_swap=True) * pct / 100.0))
    return parse_budget(spec) - sum(graphs[i].static for i in dict.fromkeys(runs))


def with_nested(trace: Trace, nested: int) -> Trace:
    """``trace`` with ``nested`` bytes more held in the gap before its first unpack, where the
    step's later graphs run (module docstring). Its blocks (R9) are kept as they are."""
    if nested <= 0 or trace.backward_start >= trace.n_events:
        return trace
    bs = trace.backward_start
    events = list(trace.events)
    events[bs] = replace(events[bs], other_bytes=int(trace.other_bytes[bs]) + int(nested))
    out = replace(trace, events=tuple(events))
    out.__dict__["segments"] = trace.segments  # only a gap's non-saved bytes changed
    return out


def nested_min(trace: Trace, nested: int) -> int:
    """The least activation bytes any plan of ``trace`` needs with ``nested`` bytes run inside it."""
    if trace.backward_start >= trace.n_events:  # nothing saved: it holds only its own peak, then the rest
        return max(int(trace.min_feasible_bytes - trace.static_bytes), int(nested))
    return int(with_nested(trace, nested).min_feasible_bytes - trace.static_bytes)


def smallest_step(runs: Sequence[int], traces: Mapping[int, Trace]) -> tuple[int, int]:
    """The smallest budget any split can meet over ``runs`` (whole-device bytes, statics
    included), and the graph that needs most of its own: from the last run back, each run needs
    its own smallest feasible budget with what runs after it nested (:func:`with_nested`)."""
    need = 0
    for i in reversed(runs):
        need = nested_min(traces[i], need)
    statics = sum(int(traces[i].static_bytes) for i in dict.fromkeys(runs))
    worst = max(dict.fromkeys(runs), key=lambda i: traces[i].min_feasible_bytes - traces[i].static_bytes)
    return need + statics, worst
