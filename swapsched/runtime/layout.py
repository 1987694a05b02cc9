"""One adopted plan laid out for the executing hooks: :class:`PlanLayout`, and :func:`lay_out`,
which makes one from a plan on its trace with the step time the simulator predicts for it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from swapsched.env.events import event_tables
from swapsched.env.result import SimResult
from swapsched.env.simulator import simulate
from swapsched.env.state_parts import born_gradients_held, host_gradients_coming, state_split
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.runtime.shapes import first_bytes, structure
from swapsched.trace import Trace

__all__ = ["PlanLayout", "lay_out"]


@dataclass(frozen=True)
class PlanLayout:
    """One adopted plan as the executing hooks read it: the trace it follows, the plan per event
    (as the simulator lays it out, R5), the expected event codes (a pack's tensor id, an unpack's
    complement ``~id``), whether anything happens after each event (a free, a swap-out, a
    prefetch), and the profiling's order of first sight -> trace id."""

    trace: Trace
    plan: SwapPlan
    predicted_s: float | None
    out_at: list[tuple[int, ...]]
    prefetch_at: list[tuple[int, ...]]
    expected_codes: list[int]
    work_at: list[bool]
    first_sight: dict[int, int]
    # the trace was predicted from its family's profiled sizes (runtime/shapes.py), not profiled
    # (its first plan borrowed from a size near it)
    predicted: bool = False
    # the budget this shape runs under: a relative budget resolved against this shape's own
    # activation peak, a byte budget as given (DESIGN.md, "Budgets"); None only in hand-made layouts
    budget_bytes: int | None = None
    # the simulator's device peak of this plan on this trace (R3, the guard's evictions included):
    # what an unhooked step reports, nothing being watched there
    predicted_peak_bytes: int | None = None

    @cached_property
    def step_static_bytes(self) -> int:
        """What the device holds all step beside the saved tensors: the trace's static bytes, less
        the training state the plan moves off the device between uses (R14), and the gradients
        the step makes (R3: each from its birth, in ``other_held``)."""
        if not self.trace.state:
            return int(self.trace.static_bytes)
        return int(self.trace.fixed_bytes) + state_split(self.trace.state, self.plan.placement(),
                                                         born=self.trace.state_gradients_born)[0]

    @cached_property
    def other_held(self) -> list[int]:
        """Per gap, what it holds beyond the saved tensors (R3): the trace's other bytes, the
        gradients the step makes that the plan's placement keeps on the device (R13), and the
        room of those it copies to the host until they are made (R4 with R14)."""
        other = self.trace.other_bytes
        if self.trace.state:
            n = self.trace.n_events
            where = [self.plan.placement().get(g.name, "device") for g in self.trace.state]
            other = other + host_gradients_coming(self.trace.state, where, n)[:n]
            if self.trace.state_gradients_born:
                other = other + born_gradients_held(self.trace.state, where, n)[:n]
        return [int(b) for b in other]

    @property
    def shape_key(self) -> int:
        """The bytes of the step's first saved tensor: what a step shows of its shape first."""
        return first_bytes(self.trace)

    @property
    def plan_source(self) -> str:
        """Whose plan this is: ``"borrowed"`` from a size near it, ``"learned"`` (the quick
        planner's), or ``"searched"`` (the policy's, or one given)."""
        meta = self.plan.meta
        return "borrowed" if "borrowed_from" in meta else "learned" if meta.get("planned_by") == "quick" else "searched"

    @cached_property
    def family(self) -> tuple[tuple[bool, int], ...]:
        """``shapes.structure`` of the trace, computed once: layouts of one family share it."""
        return structure(self.trace)


def lay_out(trace: Trace, plan: SwapPlan, hardware: Hardware, budget: int, simulated: SimResult | None = None, *,
            first_sight: dict[int, int], predicted: bool = False, family: Any = None) -> PlanLayout:
    """``plan`` on ``trace`` laid out for the hooks, with its predicted step time under ``budget``
    (``simulated``: the simulator's result of ``plan`` on ``trace`` already at hand). Predictions
    simulate the runtime's guard too (R4, guard): a plan that leaves no room runs with the guard's
    evictions. ``family``: the trace's structure where the caller knows it (a size predicted from it)."""
    res = simulated or simulate(trace, plan, hardware, budget, validate=False, guard=True)
    out_at, prefetch_at = plan.by_event(trace.n_events)  # as the simulator lays it out (R5)
    tb = event_tables(trace)
    out = PlanLayout(
        trace, plan, None if res.oom else res.iteration_s, out_at, prefetch_at,
        expected_codes=[~t if u else t for t, u in zip(tb.tensor, tb.is_unpack, strict=False)],
        work_at=[bool(f or o or p) for f, o, p in zip(tb.free, out_at, prefetch_at, strict=False)],
        first_sight=first_sight, predicted=predicted, budget_bytes=budget,
        predicted_peak_bytes=None if res.oom else int(res.peak_bytes))
    if family is not None:
        out.__dict__["family"] = family  # PlanLayout.family, shared: kin compares it by identity first
    return out
