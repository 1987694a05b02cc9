"""The plans of a run's shapes: :class:`ShapePlans`.

A step whose first saved tensor has other bytes is another shape (a padded batch's length). Each
shape seen gets a :class:`~swapsched.runtime.layout.PlanLayout`, keyed by those bytes: one
profiled and planned, or one *predicted* from its family's profiled sizes (``shapes.py``), whose
first plan is borrowed from a size near it (the same events: its evictions apply as they are, R7)
or made by the quick planner where that is faster and planning on the loop's thread stays within
``PLANNING_SHARE`` of the run. The policy's own plan for such a shape is made on the planner
thread (``background.py``) and installed when ready. A shape's first executed step re-times its
trace when the shape comes again, and each executed step's gaps time its family's later predictions.

Everything here reads its arguments and the run's hardware, budgets and policies, never the
runtime: ``PolicyRuntime`` keeps the phases, R9's two stages and the re-timing of the current plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from swapsched.env.floors import analytic_floor
from swapsched.env.result import SimResult
from swapsched.env.simulator import simulate
from swapsched.errors import present
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.policy import Policy
from swapsched.runtime.background import BackgroundPlans
from swapsched.runtime.budgets import ShapeBudgets
from swapsched.runtime.layout import PlanLayout, lay_out
from swapsched.runtime.reports import StepReport
from swapsched.runtime.retime import timed_by_execution
from swapsched.runtime.shapes import FamilyFit, first_bytes, structure
from swapsched.trace import Trace

__all__ = ["ShapePlans", "PLANNING_SHARE", "QUICK_PLAN_GUESS_S", "later_shape_plan", "rank", "without_small"]

#: The share of the run's time that planning on the loop's thread may take (issue 36's 2%): a new
#: shape gets the quick planner's plan only while the run's planning stays within it
PLANNING_SHARE = 0.02
#: What a quick plan is expected to take before one has been timed (the learned greedy plan's
#: median on the held-out bench, 10 ms)
QUICK_PLAN_GUESS_S = 0.01
#: Families whose fits are kept before they are all dropped (the families' members changed:
#: re-timed, profiled again); and sizes per family whose executed gaps are kept (the oldest goes)
_FITS_KEPT = 8
_TIMED_SIZES_KEPT = 64

Family = tuple[tuple[bool, int], ...]  # shapes.structure of a trace


def rank(res: SimResult) -> tuple[bool, bool, float]:
    """How plans for one shape compare: fits first, then needs no guard evictions, then faster."""
    return res.oom, res.guard_evictions > 0, res.iteration_s


def later_shape_plan(policy: Policy, trace: Trace, budget: int, hardware: Hardware, min_bytes: int) -> SwapPlan:
    """``policy``'s plan for a later shape: swaps only (blocks are chosen on the first shape, R9's
    two stages, and later shapes run with those blocks as they are), less evictions under ``min_bytes``."""
    return without_small(policy.plan(trace.with_segments(lambda sg: False), budget, hardware), trace, min_bytes)


def without_small(plan: SwapPlan, trace: Trace, min_bytes: int) -> SwapPlan:
    """``plan`` less its evictions of tensors under ``min_bytes``: copying them costs more than it saves."""
    small = [e for e in plan.evictions if trace.tensors[e.tensor].bytes < min_bytes]
    if not small:
        return plan
    return SwapPlan(plan.trace, plan.policy, tuple(e for e in plan.evictions if e not in small),
                    {**plan.meta, "kept_small": len(small)})


class ShapePlans:
    """The layouts of a run's shapes, by the bytes of each shape's first saved tensor.

    ``hardware``: what plans are made and timed for (the runtime replaces it when it fits the
    host's costs); ``budgets``: the run's budget per shape; ``policy``: plans a shape on the
    planner thread (None: shapes only borrow); ``quick_policy``: plans a new shape on the loop's
    thread within ``PLANNING_SHARE``; ``min_bytes``: evictions of smaller tensors are dropped;
    ``background``: False plans a shape between steps, on the loop's thread, instead."""

    def __init__(self, hardware: Hardware, budgets: ShapeBudgets, policy: Policy | None = None,
                 quick_policy: Policy | None = None, *, min_bytes: int = 0, background: bool = True) -> None:
        self.hardware = hardware
        self.budgets = budgets
        self.policy = policy
        self.quick_policy = quick_policy
        self.min_bytes = int(min_bytes)
        self.background = bool(background)
        self.layouts: dict[int, PlanLayout] = {}
        self._jobs = BackgroundPlans()
        self._fits: dict[tuple[int, ...], FamilyFit] = {}  # ids of a family's profiled traces -> their fit
        # family -> size -> (gaps, tail) as the latest executed step of that size measured them:
        # they time the family's predicted sizes (see FamilyFit.at)
        self._executed_times: dict[Family, dict[int, tuple[np.ndarray, float]]] = {}
        # shape key -> (its layout, the report of its first executed step): re-timed on its next step
        self._untimed: dict[int, tuple[PlanLayout, StepReport]] = {}
        self._followed: dict[int, int] = {}  # shape key -> hooked steps in a row that followed its plan
        self._quick_s = QUICK_PLAN_GUESS_S  # the last quick plan's seconds: the next one's expected time
        self._run_s = 0.0  # every step's seconds so far, and the planning done on the loop's thread
        self._loop_planning_s = 0.0

    # ------------------------------------------------------------------ laying out and looking up
    def lay_out(self, trace: Trace, plan: SwapPlan, simulated: SimResult | None = None, *, first_sight: dict[int, int],
                predicted: bool = False, family: Any = None) -> PlanLayout:
        """``plan`` on ``trace`` laid out for the hooks under its shape's budget (see ``lay_out``)."""
        return lay_out(trace, plan, self.hardware, self.budgets.of(trace), simulated, first_sight=first_sight,
                       predicted=predicted, family=family)

    def keep(self, layout: PlanLayout) -> None:
        """``layout`` is its shape's from now."""
        self.layouts[layout.shape_key] = layout

    def get(self, key: int) -> PlanLayout | None:
        """The layout of the shape whose first saved tensor has ``key`` bytes, if any; a shape that
        has run once is re-timed from that step as it comes again (not before: with lengths drawn
        at random most shapes never come again, and re-timing one costs a simulation)."""
        layout = self.layouts.get(key)
        untimed = self._untimed.pop(key, None)
        if layout is not None and untimed is not None and untimed[0] is layout:
            layout = self.lay_out(timed_by_execution(layout.trace, [untimed[1]]), layout.plan,
                                  first_sight=layout.first_sight, predicted=layout.predicted, family=layout.family)
            self.keep(layout)
            # a borrowed plan kept because it met R8's floor as predicted may miss it as the step
            # ran: then the policy plans the shape after all (unless it is planning it already)
            if (self.background and self.policy is not None and layout.plan_source == "borrowed"
                    and key not in self._jobs and not self._at_floor(layout)):
                self.plan_later(layout)
        return layout

    def kin(self, trace: Trace, first_sight: dict[int, int], family: Any = None) -> list[PlanLayout]:
        """The layouts of ``trace``'s family: the same events, the same storages in order of first
        sight (``family``: ``structure(trace)``, where a layout has it already). Compared by
        identity first: a family's layouts share one structure and one order of first sight."""
        shape = family if family is not None else structure(trace)
        return [lay for lay in self.layouts.values()
                if (lay.family is shape or lay.family == shape)
                and (lay.first_sight is first_sight or lay.first_sight == first_sight)]

    def predict(self, like: PlanLayout, s: int) -> PlanLayout | None:
        """A layout for the step of ``like``'s family whose first saved tensor has ``s`` bytes,
        without profiling it: its trace predicted from the family's profiled sizes, and its first
        plan (:meth:`first_plan`). None where the family cannot predict it. A size that no plan
        can fit in the run's bytes is refused here (``BudgetError``), at the step's first saved
        tensor, before its memory is spent."""
        kin = self.kin(like.trace, like.first_sight, like.family)
        trace = self._family_fit([lay.trace for lay in kin if not lay.predicted]).at(s, self._executed_times.get(like.family))
        if trace is None:
            return None
        self.budgets.of(trace)  # a size no plan fits is refused here (BudgetError), before it is planned
        layout = self.lay_out(trace, *self.first_plan(trace, kin), first_sight=like.first_sight, predicted=True,
                              family=like.family)
        self.keep(layout)
        # the policy's own plan for this size, a better donor for sizes near it, unless the first
        # one already meets R8's floor here (a size that fits needs no plan): no plan is faster
        if self.background and self.policy is not None and not self._at_floor(layout):
            self.plan_later(layout)
        return layout

    def _at_floor(self, layout: PlanLayout) -> bool:
        """Whether ``layout``'s plan meets R8's floor on its trace: no plan is faster there."""
        return (layout.predicted_s is not None and layout.predicted_s
                <= analytic_floor(layout.trace, self.budgets.of(layout.trace), self.hardware) * (1 + 1e-9))

    def _family_fit(self, profiled: list[Trace]) -> FamilyFit:
        """The fit of these profiled traces, made once while they stay the family's (see FamilyFit)."""
        key = tuple(id(t) for t in profiled)
        fit = self._fits.get(key)
        if fit is None:
            if len(self._fits) >= _FITS_KEPT:
                self._fits.clear()
            fit = self._fits[key] = FamilyFit(profiled)  # it holds the traces: their ids stay theirs
        return fit

    # ------------------------------------------------------------------ a new shape's first plan
    def first_plan(self, trace: Trace, kin: list[PlanLayout]) -> tuple[SwapPlan, SimResult]:
        """A new shape's first plan, made on the loop's thread: the family's borrowed one, or the
        quick planner's where it simulates faster and planning on the loop's thread stays within
        ``PLANNING_SHARE`` of the run's time with it (the policy's search improves on either in
        the background)."""
        borrowed = self.borrowed(trace, kin)
        quick = self.quick_policy
        if quick is None or self._loop_planning_s + self._quick_s > PLANNING_SHARE * self._run_s:
            return borrowed
        t0 = time.perf_counter()
        budget = self.budgets.of(trace)
        plan = later_shape_plan(quick, trace, budget, self.hardware, self.min_bytes)
        res = simulate(trace, plan, self.hardware, budget, validate=False, guard=True)
        self._quick_s = time.perf_counter() - t0
        if rank(res) < rank(borrowed[1]):
            return SwapPlan(trace.name, plan.policy, plan.evictions, {**plan.meta, "planned_by": "quick"}), res
        return borrowed

    def borrowed(self, trace: Trace, kin: list[PlanLayout]) -> tuple[SwapPlan, SimResult]:
        """For ``trace``, the plan of one of its family's sizes (the same events: its evictions
        apply as they are, R7), with its simulated result: the nearest larger size's, which evicts
        no less, so its plan fits here under a budget in bytes (not always under a relative one,
        which shrinks with the size where the static bytes do not); where the simulator finds it
        needs the guard, the nearest two sizes' in turn, and the fastest of those tried. Each try
        is a simulation inside the step whose shape it is: one as a rule."""
        s = first_bytes(trace)
        near = sorted(kin, key=lambda lay: abs(lay.shape_key - s))[:2]
        larger = [lay for lay in kin if lay.shape_key >= s]
        if larger and (bigger := min(larger, key=lambda lay: lay.shape_key)) not in near:
            near.append(bigger)
        budget = self.budgets.of(trace)
        near.sort(key=lambda lay: (lay.shape_key < s, abs(lay.shape_key - s)))  # larger ones first, nearest first
        timed = []
        for lay in near:
            timed.append((simulate(trace, lay.plan.evictions, self.hardware, budget, validate=False, guard=True), lay))
            if not timed[-1][0].guard_evictions:
                break
        res, donor = min(timed, key=lambda x: (*rank(x[0]), x[1].shape_key))
        plan = SwapPlan(trace.name, donor.plan.policy, donor.plan.evictions, {**donor.plan.meta, "borrowed_from": donor.trace.name})
        return plan, res

    # ------------------------------------------------------------------ the policy's own plans
    def replan(self, layout: PlanLayout, trace: Trace) -> None:
        """The policy's own plan for ``layout``'s shape, on ``trace``: on the planner thread, or
        now, between steps, where planning is not in the background."""
        if self.background:
            self.plan_later(layout, trace)
        else:
            self.keep(self._policy_job(layout, trace)())

    def plan_later(self, layout: PlanLayout, trace: Trace | None = None) -> None:
        """Have the policy plan ``layout``'s shape (on ``trace``, default its own) on the planner
        thread, and lay the plan out there too; :meth:`install_ready` puts the new layout in place
        of ``layout`` once it is ready. The policy reads only its arguments (``plan(trace, budget,
        hardware)``) and the layout only the trace, the plan and these two, so both may run beside
        the training step; on a machine with few cores they take their time from it."""
        self._jobs.submit(layout.shape_key, layout, self._policy_job(layout, layout.trace if trace is None else trace))

    def _policy_job(self, layout: PlanLayout, trace: Trace) -> Callable[[], PlanLayout]:
        """The policy's plan for ``layout``'s shape on ``trace``, laid out: a job that reads only
        what it is given here (the run's budget and hardware as they are now), so it may run on
        the planner thread. It swaps only (:func:`later_shape_plan`)."""
        policy = present(self.policy, "the policy that plans a later shape")
        budget, hardware, min_bytes = self.budgets.of(trace), self.hardware, self.min_bytes
        first_sight, predicted, family = layout.first_sight, layout.predicted, layout.family

        def plan_and_lay_out() -> PlanLayout:
            plan = later_shape_plan(policy, trace, budget, hardware, min_bytes)
            return lay_out(trace, plan, hardware, budget, simulate(trace, plan, hardware, budget, validate=False, guard=True),
                           first_sight=first_sight, predicted=predicted, family=family)

        return plan_and_lay_out

    @property
    def planning(self) -> bool:
        """Whether plans are being made on the planner thread."""
        return bool(self._jobs)

    def install_ready(self, wait: bool = False) -> list[tuple[PlanLayout, PlanLayout]]:
        """Put every background layout that is ready (all of them, with ``wait``) in place of the
        layout it was made for (or that layout re-timed since), unless that layout has gone (a
        wrong prediction, new blocks); (the layout replaced, the new one) for each put in place."""
        installed = []
        for key, replaced, layout in self._jobs.ready(wait):  # a policy's error surfaces here
            current = self.layouts.get(key)
            # the layout the job was made for, or that layout re-timed because its shape came
            # again while the plan was being made (get() keeps the plan object): the shape still
            # runs the plan the job replaces. Dropping it there lost every plan of a shape that
            # came again within a search's time
            if current is replaced or (current is not None and current.plan is replaced.plan):
                self.layouts[key] = layout
                installed.append((current, layout))
        return installed

    def keep_sizes(self, profiled: list[tuple[Trace, dict[int, int]]], planned: PlanLayout) -> None:
        """The profiling steps (trace, order of first sight) of sizes other than the one planned
        (``planned``: a padded batch's first steps): each of the planned family's sizes gets a
        layout of its own, as a new shape profiled as it ran does, so that the family predicts from
        all of them. Other structures are left out, and sizes no plan fits (refused when they come)."""
        for trace, first_sight in reversed(profiled):  # the latest step of each size
            if (first_bytes(trace) in self.layouts or first_sight != planned.first_sight
                    or structure(trace) != planned.family or trace.min_feasible_bytes > self.budgets.or_zero(trace)):
                continue
            layout = self.lay_out(trace, *self.borrowed(trace, self.kin(trace, first_sight)), first_sight=first_sight)
            self.keep(layout)
            if self.policy is not None:
                self.replan(layout, trace)

    # ------------------------------------------------------------------ what executed steps measured
    def note_followed(self, layout: PlanLayout, followed: bool) -> None:
        """A hooked step ran ``layout``'s plan: ``followed`` as planned within the budget, or not."""
        if followed:
            self._followed[layout.shape_key] = self._followed.get(layout.shape_key, 0) + 1
        else:
            self._followed.pop(layout.shape_key, None)

    def followed(self, layout: PlanLayout) -> int:
        """Hooked steps in a row that ran ``layout``'s shape's plan as planned within the budget."""
        return self._followed.get(layout.shape_key, 0)

    def note_times(self, layout: PlanLayout, rep: StepReport) -> None:
        """Keep the gaps the step of ``layout``'s shape just measured, for its family's predictions."""
        if rep.gaps_s is None or len(rep.gaps_s) != layout.trace.n_events:
            return
        times = self._executed_times.setdefault(layout.family, {})
        times.pop(layout.shape_key, None)
        times[layout.shape_key] = (np.asarray(rep.gaps_s, dtype=np.float64), float(rep.tail_s or 0.0))
        if len(times) > _TIMED_SIZES_KEPT:  # the oldest size goes: a long run's sizes are timed by their latest steps
            del times[next(iter(times))]

    def note_other_shape(self, layout: PlanLayout, rep: StepReport) -> None:
        """A step of a shape other than the current one ran ``layout``. A predicted shape whose
        borrowed plan did not hold is replanned, on the trace as that step ran it; else the
        shape's first executed step re-times its trace when it comes again, so that its
        prediction follows the compute as it runs (the profiling steps' copies stretch the gaps)."""
        timed = rep.gaps_s is not None and len(rep.gaps_s) == layout.trace.n_events
        if layout.predicted and not rep.plan_followed and self.policy is not None:
            self.replan(layout, timed_by_execution(layout.trace, [rep]) if timed else layout.trace)
        elif timed and "timed_by_execution" not in layout.trace.meta:
            self._untimed[layout.shape_key] = (layout, rep)

    def note_step(self, step_s: float, planning_s: float) -> None:
        """A step ran for ``step_s``, and its planning on the loop's thread took ``planning_s``."""
        self._run_s += step_s
        self._loop_planning_s += planning_s

    def forget(self, key: int) -> None:
        """The shape's layout was wrong (its prediction diverged): it is profiled when it comes again."""
        self.layouts.pop(key, None)

    def clear(self) -> None:
        """The blocks checkpointed changed: every layout (and plan in the making) was laid out for
        steps that ran otherwise."""
        self.layouts.clear()
        self._jobs.clear()  # dropped when ready
        self._untimed.clear()

    def shutdown(self) -> None:
        """Stop the planner thread."""
        self._jobs.shutdown()
