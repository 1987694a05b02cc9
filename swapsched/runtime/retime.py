"""Re-timing a trace from the steps that ran it, and the host's costs from the same steps.

The profiling steps give the first trace; on the emulated device (compute timed by the host clock)
executed steps measure each gap again without the profiling's copies, and their time in the hooks
gives what the runtime costs the host. ``PolicyRuntime`` (``runtime/swapper.py``) calls these between steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from swapsched.errors import UserError
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.trace import Trace

if TYPE_CHECKING:
    from swapsched.runtime.reports import StepReport

__all__ = ["timed_by_execution", "median_trace", "fitted_host_costs", "state_hook_per_tensor", "ExecutedSteps", "RETIME_EVERY_MOST"]

#: Executed steps whose hook times the host's costs are fitted from (the latest ones)
HOST_STEPS_KEPT = 64
#: The most executed steps between two re-timings of one trace: the interval doubles from
#: ``retime_steps`` after each (a re-timing simulates the plan again: 1.9 ms on gpt small, a tenth
#: of its step, which every third step paid, RESULTS session 31), and a new trace starts it over
RETIME_EVERY_MOST = 96
#: Steps of the plan's compute run without hooks before the first re-timing (R1, "hooked gaps")
UNHOOKED_STEPS = 2


class ExecutedSteps:
    """The executed steps of the current trace, kept to re-time it after ``every`` of them, then
    at intervals that double up to ``RETIME_EVERY_MOST``.

    ``given``: the hardware as given; ``fit_host``: fit the host's costs onto it from the latest
    ``HOST_STEPS_KEPT`` steps (uncalibrated hardware on the emulated device)."""

    def __init__(self, every: int, given: Hardware, fit_host: bool) -> None:
        self.first = self.every = every
        self.given, self.fit_host = given, fit_host
        self._steps: list[StepReport] = []  # not yet used to re-time the trace
        self._host: deque[StepReport] = deque(maxlen=HOST_STEPS_KEPT)
        self.retimings = 0
        # the fastest step of those the last re-timing used, and as it would have run without hooks
        self.fastest_s: float | None = None
        self.fastest_unhooked_s: float | None = None
        # R1, "hooked gaps": a step of the plan's compute timed (``times_compute``), and what the
        # hooks cost the compute around them per event, found at the first re-timing after it.
        # ``per_copy``: timed with the state moving (hooks on, every activation kept): what the
        # compute lost was the activations' copies', charged per copy
        self.unhooked_s: list[float] = []
        self.hook_gap_s: float | None = None
        self.per_copy = False
        self.copy_gap_s = 0.0

    def times_compute(self, plan: SwapPlan | None, trace: Trace | None, allowed: bool) -> bool:
        """Whether the next step times ``plan``'s compute (R1, "hooked gaps"): without hooks, or
        with the state moving, every activation kept. ``UNHOOKED_STEPS`` steps just before the
        first re-timing (the first executed steps after profiling run slower), where the runtime
        may (``allowed``: on the emulated device, whose memory is the host's, with the model's
        blocks, none checkpointed yet, nothing watching the step), ``trace`` has blocks a plan
        could recompute instead (the plans that pass fewer events through the hooks and copy
        less), and the plan moves activations (one that moves nothing runs without hooks anyway)."""
        return (allowed and self.retimings == 0 and len(self.unhooked_s) < UNHOOKED_STEPS and len(self._steps) + 1 >= self.every
                and plan is not None and bool(plan.evictions) and trace is not None and bool(trace.segments))

    def add(self, rep: StepReport, trace: Trace) -> tuple[Trace, Hardware | None] | None:
        """``rep`` ran ``trace``. Every ``every`` steps: the trace re-timed from them, and the
        hardware with the host's costs fitted (None where they are neither fitted nor measured
        beside the hooks); else None. A step that timed the compute unhooked is kept for that."""
        if rep.mode == "timing":  # with the state moving, hooked: its compute is its gaps
            self.per_copy = rep.gaps_s is not None
            self.unhooked_s.append(rep.step_s if rep.gaps_s is None else sum(rep.gaps_s) + (rep.tail_s or 0.0))
            return None
        if rep.gaps_s is not None:
            self._steps.append(rep)
            self._host.append(rep)
        if len(self._steps) < self.every:
            return None
        retimed = timed_by_execution(trace, self._steps)
        if self.unhooked_s and self.hook_gap_s is None:  # the least of them: noise only adds
            lost = max(0.0, retimed.ideal_s - min(self.unhooked_s))
            self.hook_gap_s = lost / max(retimed.n_events, 1)
            copies = float(np.median([r.copies for r in self._steps]))
            self.copy_gap_s = lost / copies if self.per_copy and copies else 0.0
        # the fastest of these steps (noise and the first steps' one-off costs only add), and as it
        # would have run without hooks: less the hooks' own time and what they cost the compute
        self.fastest_s = min(r.measured_s for r in self._steps)
        self.fastest_unhooked_s = (min(r.measured_s - (r.hook_s or 0.0) for r in self._steps)
                                   - (self.hook_gap_s or 0.0) * trace.n_events)
        self._steps = []
        self.every = min(2 * self.every, max(RETIME_EVERY_MOST, self.first))
        self.retimings += 1
        fitted = fitted_host_costs(self.given, list(self._host), retimed.n_events) if self.fit_host else None
        if self.hook_gap_s:  # the gaps as the compute alone runs them; each hooked event (each copy) pays the rest
            retimed = retimed.with_timing([max(g - self.hook_gap_s, 0.0) for g in retimed.gaps.tolist()],
                                          retimed.tail_compute_s, hook_gap_s=self.hook_gap_s)
            base = fitted or self.given
            fitted = (replace(base, copy_issue_s=base.copy_issue_s + self.copy_gap_s) if self.per_copy
                      else replace(base, hook_cost_s=base.hook_cost_s + self.hook_gap_s))
        return retimed, fitted

    def forget(self) -> None:
        """Drop the steps kept: they ran another trace (their events differ), re-timed after
        ``first`` of its own."""
        self._steps = []
        self.every = self.first
        self._host.clear()


def timed_by_execution(trace: Trace, reports: list[StepReport]) -> Trace:
    """``trace`` with each gap (and the tail) the median over executed steps' gaps.

    Why the runtime re-times its trace: the profiling steps copy every saved tensor synchronously.
    On the emulated device those copies free and re-allocate process memory, so the compute
    measured around them runs slower (page faults, cold caches) than once the plan executes; on
    CUDA every hook waits for its copy, so the device idles while the host launches the next
    kernels, and a launch-bound model's compute is overestimated. Executed steps measure each gap
    between hooks with the hooks' own time left out: the host clock on the emulated device, CUDA
    timing events in the compute order on a GPU. The simulator adds ``hook_cost_s`` per event."""
    timed = [r for r in reports if r.gaps_s is not None and len(r.gaps_s) == trace.n_events]
    if not timed:
        raise UserError("timed_by_execution needs reports of whole executed steps with their gaps measured")
    return _median_timing(trace, [r.gaps_s for r in timed], [r.tail_s or 0.0 for r in timed], "timed_by_execution")


def fitted_host_costs(hardware: Hardware, reports: list[StepReport], n_events: int) -> Hardware:
    """``hardware`` with the host's costs of the runtime fitted to executed steps (R6/R8's host
    costs), so that predictions need no calibration step.

    Each step's time in the hooks, waits left out, is ``n_events * hook_cost_s + copies *
    copy_issue_s``: the events whose hooks issued no copy and waited for none give
    ``hook_cost_s``, and what the step spent beyond ``n_events`` of them, over its copies,
    ``copy_issue_s``. The state mover's host time (R13-R16), measured apart, is ``copy_issue_s``
    for each copy it issued and ``state_hook_s`` for each parameter tensor it moves (its hooks'
    bookkeeping). Each is the median over the steps, so the steps of one plan tell them apart. The per-byte cost stays as given (``calibrate`` measures it on copies
    of other sizes). (What a wait costs the compute after it is in the gaps the same steps
    re-time.)"""
    plain = [r.plain_hook_s / r.plain_events for r in reports if r.plain_events]
    if not plain:
        return hardware
    hook = float(np.median(plain))
    copies = [max((r.hook_s or 0.0) - hook * n_events, 0.0) / r.copies for r in reports if r.copies]
    issue = float(np.median(copies)) if copies else hardware.copy_issue_s
    state = state_hook_per_tensor(reports, issue)
    return replace(hardware, hook_cost_s=hook, copy_issue_s=issue, state_hook_s=hardware.state_hook_s if state is None else state)


def state_hook_per_tensor(reports: list[StepReport], copy_issue_s: float) -> float | None:
    """The state mover's host time per parameter tensor it moves, beyond ``copy_issue_s`` for
    each copy it issued (R13-R16's host cost, ``Hardware.state_hook_s``): the median over the
    steps that moved the state; None where none did."""
    state = [max(r.state_host_s - copy_issue_s * r.state_copies, 0.0) / r.state_tensors for r in reports
             if r.state_host_s is not None and r.state_tensors]
    return float(np.median(state)) if state else None


def median_trace(traces: list[Trace], most_other: bool = False) -> Trace:
    """The last trace, with each gap's median over the traces that saw the same events with the
    same bytes (a profiling step of another shape times other compute). ``most_other`` (FSDP2's
    shards, R18): each gap's other bytes (R3) the most any of them after the first held there:
    a step that reduces its gradients holds more than one accumulating without sync (FSDP2's
    reduce-scatter buffers), and a plan must fit both; the first pays one-off costs (FSDP2's
    lazy initialization, the allocator's growth) that later steps do not."""
    last = traces[-1]
    shape = ([(e.kind, e.tensor) for e in last.events], last.tensor_bytes.tolist())
    same = [t for t in traces if ([(e.kind, e.tensor) for e in t.events], t.tensor_bytes.tolist()) == shape]
    if len(same) < 2:
        return last
    later = (same[1:] if len(same) > 2 else same[-1:]) if most_other else same[-1:]
    other = [max((b for b in (t.events[i].other_bytes for t in later) if b is not None), default=None)
             for i in range(last.n_events)]
    most = replace(last, events=tuple(replace(e, other_bytes=o) for e, o in zip(last.events, other, strict=True)))
    return _median_timing(most, [t.gaps for t in same], [t.tail_compute_s for t in same], "median_of_steps")


def _median_timing(trace: Trace, gaps: list, tails: list[float], meta_key: str) -> Trace:
    """``trace`` with each gap and the tail the median over several timings of the same events;
    ``meta[meta_key]`` says how many."""
    median = np.median(np.array(gaps, dtype=np.float64), axis=0)
    return trace.with_timing(median.tolist(), float(np.median(tails)), **{meta_key: len(tails)})
