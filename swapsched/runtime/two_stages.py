"""R9's two stages, and a plan the user gives (``use_plan``), in the live runtime: a plan that
recomputes blocks runs them under ``torch.utils.checkpoint`` from the next step on, and the steps
are profiled again (each block then saves only its inputs); on that trace the policy plans the
swaps of what stays saved (``PolicyRuntime._plan_from``), or a given plan's swaps are carried over
(``plan.carry_evictions``).

:class:`TwoStages` is the part of :class:`~swapsched.runtime.swapper.PolicyRuntime` that does
this; the runtime supplies what it reads.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from swapsched.budget import BudgetError, format_bytes
from swapsched.errors import UserError, present
from swapsched.plan import SwapPlan
from swapsched.runtime.layout import lay_out
from swapsched.runtime.plans import without_small
from swapsched.runtime.retime import median_trace
from swapsched.trace import Trace

if TYPE_CHECKING:
    from swapsched.env.result import SimResult
    from swapsched.hardware import Hardware
    from swapsched.policy import Policy
    from swapsched.runtime.backends import Backend
    from swapsched.runtime.plans import ShapePlans
    from swapsched.runtime.recompute import BlockCheckpoints
    from swapsched.runtime.retime import ExecutedSteps
    from swapsched.runtime.state_plans import RuntimeState

__all__ = ["TwoStages", "KEEP_SLOWER"]

#: How much slower than the plan before it the policy's plan on the re-timed trace may measure
#: before the plan before comes back (``TwoStages._keep_the_faster``): the rounds' noise on this
#: machine is a few percent
KEEP_SLOWER = 0.03
#: The budget of a step that times the compute with the state moving (``_step_layout``): none
UNBUDGETED = 1 << 62


class TwoStages:
    """R9's two stages and ``use_plan`` (module docstring)."""

    trace: Trace | None
    plan: SwapPlan | None
    layout: Any
    predicted_s: float | None
    first_sight: dict[int, int]
    plans: ShapePlans
    blocks: BlockCheckpoints | None
    profile_steps: int
    retime_steps: int
    tune: bool  # measure before committing: the compute without hooks, and the policy's re-plan on trial
    unhook: bool
    audit: bool
    strict: bool
    backend: Backend
    _profiled: int
    _profiles: list[tuple[Trace, dict[int, int]]]
    _executed: ExecutedSteps
    _policy_planned: bool
    _retimed: bool
    _rebuilt: dict[str, int]
    _unwrapped_trace: Trace | None
    _unwrapped_first_sight: dict[int, int]
    _given: tuple[Trace, SwapPlan] | None
    _tried: tuple[SwapPlan, float] | None = None  # the plan before the policy planned again, and its fastest step
    _no_selective = False  # a selectively checkpointed plan lost its trial: the policy plans without (``_keep_the_faster``)
    _timing: bool
    state: RuntimeState
    @property
    def policy(self) -> Policy | None:
        raise NotImplementedError

    @property
    def hardware(self) -> Hardware:
        raise NotImplementedError

    @property
    def min_bytes(self) -> int:
        raise NotImplementedError

    @property
    def budget_bytes(self) -> int | None:
        raise NotImplementedError

    def _planned_on(self, trace: Trace) -> Trace:
        """What the policy may plan on (``BlockCheckpoints.planned_on``; no block without a model;
        none selectively once such a plan lost its trial, ``_keep_the_faster``)."""
        if self.blocks is None:
            return trace.with_segments(lambda sg: False)
        planned = self.blocks.planned_on(trace)
        return planned.with_segments(lambda sg: True, selective=False) if self._no_selective else planned

    def _adopt(self, plan: SwapPlan, simulated: SimResult | None = None) -> None:
        raise NotImplementedError

    def _plan_from(self, trace: Trace, retimed: bool = False) -> None:
        raise NotImplementedError

    def use_plan(self, plan: SwapPlan, budget: str | int | None = None) -> None:
        """Execute ``plan`` from the next step on, instead of the policy's (the trace must exist:
        run the profiling steps first), optionally under another ``budget``. Checked against R7
        and the trace."""
        if self.trace is None:
            raise UserError("use_plan() needs the profiled trace: run the profiling steps first")
        if budget is not None:
            # a malformed budget fails here, not after profiling; checked on the steps as they run with
            # no block checkpointed, which every plan is made on
            self.plans.budgets.respecify(budget, self._unwrapped_trace or self.trace)
        if plan.recompute or plan.selective:
            # R9's two stages for a plan given whole: its blocks are checkpointed, the steps are
            # profiled again, and its swaps are carried onto what they then save (carry_evictions)
            self._given = (self._unwrapped_trace or self.trace, plan) if plan.evictions else None
            if self.blocks is not None:
                self.blocks.remove()  # the plan is made on the steps as they run with no block checkpointed
            self._recompute(plan, self._planned_on(self._unwrapped_trace or self.trace))
        else:
            self._given = None
            if self.blocks is not None and self.blocks.names and self._unwrapped_trace is not None:
                # a swap plan for the steps as they run with no block checkpointed (the plan before
                # recomputed blocks)
                self._unwrap()
            self._adopt(plan)
        self._policy_planned = False

    def _recompute(self, plan: SwapPlan, trace: Trace) -> None:
        """R9, in two stages. Here: checkpoint ``plan``'s blocks from the next step on, and profile
        again, since the steps then save other tensors (each block only its inputs). On that trace
        (``_plan_from``) the policy plans the swaps of what stays saved, and the runtime executes them."""
        blocks = (*plan.recompute, *plan.selective)
        if self.blocks is None:
            raise UserError(f"plan {plan.policy!r} recomputes {len(blocks)} block(s) (R9): give the runtime "
                            "the model (SwapRuntime(model=...)) so that it can run them under torch.utils.checkpoint")
        plan.validate(trace)
        saved = self.blocks.selective_saves(trace, plan)
        self._rebuilt = self.blocks.rebuilt_bytes(trace, plan)
        self._checkpoint_blocks(blocks, saved)

    def _refuse_given_blocks(self, refusal: BudgetError) -> None:
        """Where the budget is refused on the steps as they run with use_plan's blocks
        checkpointed (its plan was made on an estimate of what they hold, R9), refuse it naming
        them; nothing where the policy's own plan checkpointed them, or none are."""
        if self._policy_planned or self.blocks is None or not self.blocks.names:
            return
        raise BudgetError(f"the plan given to use_plan recomputes {', '.join(self.blocks.names)}: profiled with them "
                          f"checkpointed, the step cannot meet its budget ({refusal}); give use_plan a plan that "
                          "recomputes other blocks, or a larger budget") from refusal

    def _plan_profiled(self, profiled: list[tuple[Trace, dict[int, int]]]) -> None:
        """Plan on the median of the profiling steps' traces, or profile again with the blocks
        checkpointed whole (R9's first stage) where the budget needs them."""
        trace = self.state.with_state(median_trace([trace for trace, _ in profiled], most_other=self.state.sharded))
        if self.blocks is not None and self.blocks.fell_short(trace, self.budget_bytes):
            self._checkpoint_blocks(self.blocks.names, {})  # whole, and profiled again
            return
        if self._recompute_overran(trace):
            return
        self._plan_from(trace)
        if self.layout is not None:  # else R9's first stage: the steps are profiled again, blocks checkpointed
            self.plans.keep_sizes(profiled[:-1], self.layout)

    def _recompute_overran(self, trace: Trace) -> bool:
        """R9's second stage: the steps as they run with the policy's blocks checkpointed whole
        (``trace``) hold more than the budget at their fullest (a recompute holds what its forward
        does not save, R3, and the plan was made on an estimate of it). Then the blocks run their
        own forward again, and the policy plans swaps alone on the steps as they ran before: the
        run goes on under its budget, said once by a warning."""
        blocks, unwrapped, budget = self.blocks, self._unwrapped_trace, self.budget_bytes
        if (blocks is None or not blocks.names or unwrapped is None or budget is None or self.policy is None
                or self._given is not None or trace.min_feasible_bytes_movable <= budget):
            return False
        warnings.warn(f"recomputing {', '.join(blocks.names)} needs {format_bytes(trace.min_feasible_bytes_movable)} "
                      f"at least, above the budget of {format_bytes(budget)}: swapping instead", RuntimeWarning,
                      stacklevel=4)
        self._unwrap()
        plan = self.policy.plan(unwrapped.with_segments(lambda sg: False), budget, self.hardware)
        self._policy_planned = True
        self._adopt(without_small(plan, unwrapped, self.min_bytes))
        return True

    def _times_compute(self) -> bool:
        """Whether the next step times the plan's compute (``ExecutedSteps.times_compute``): on the
        emulated device, tuning, nothing watching, with the model's blocks, none checkpointed yet.
        Without the hooks; with the state moving (its mover needs them), with the plan's state
        and every activation kept (``_step_layout``)."""
        return self._executed.times_compute(self.plan, self.trace, self.backend.emulated and self.tune and self.unhook and not (
            self.audit or self.strict or self.blocks is None or self.blocks.names))

    def _step_layout(self) -> Any:
        """The layout the next step follows: the plan's; in a step that times the compute with the
        state moving (R1, "hooked gaps"), its state placed as planned and every activation kept,
        unbudgeted (the emulated device's memory is the host's), so that the gaps are the
        compute without the activations' copies."""
        if not (self._timing and self.state.mover is not None):
            return self.layout
        trace, plan = present(self.trace, "the plan's trace"), present(self.plan, "the plan")
        return lay_out(trace, replace(plan, evictions=()), self.hardware, UNBUDGETED, first_sight=self.first_sight)

    @property
    def settled(self) -> bool:
        """Whether the steps now run the plan the runtime keeps: re-timed from executed steps (the
        policy planned again on them, or its plan stayed), with no plan on trial against the one
        before (``_keep_the_faster``); without re-timing (``retime_steps=0``), planned."""
        return self.layout is not None and (self._retimed or not self.retime_steps) and self._tried is None

    def _plan_again_on(self, retimed: Trace) -> None:
        """At a re-timing of a plan the policy made before any: it plans again on the compute as it
        ran. At the run's first re-timing the plan before is kept with its measured step, for the
        new plan's steps to be measured against (``_keep_the_faster``)."""
        before, measured = self.plan, self._executed.fastest_s
        self._plan_from(retimed, retimed=True)
        # (a plan before that recomputes ran on other steps: R9's, not comparable this way)
        if (self.tune and self._executed.retimings == 1 and before is not None and measured is not None and self.plan != before
                and not (before.recompute or before.selective)):
            self._tried = (before, measured)
            self._executed.forget()  # on trial after as many steps as the first plan was (not the doubled interval)

    def _keep_the_faster(self) -> bool:
        """At a re-timing after the policy planned again on the compute as it ran (``_tried``: the
        plan before, with its measured step): where the new plan's steps (R9's blocks checkpointed
        and its swaps planned on what they save, if it recomputes) take longer than the plan before
        took by more than ``KEEP_SLOWER``, the plan before is back, with no block checkpointed.
        True where it is. *Why:* the simulator can rank two plans wrongly (a recompute's live cost
        beyond its forward's: RESULTS session 31); what both measured is the answer."""
        tried, self._tried = self._tried, None
        plan, ran = self.plan, self._executed
        if tried is None or plan is None or ran.fastest_s is None or ran.fastest_unhooked_s is None:
            return False
        before, before_s = tried
        # a plan that moves nothing runs without hooks from its next steps on (may_unhook)
        now_s = ran.fastest_unhooked_s if not (plan.evictions or plan.state) else ran.fastest_s
        if now_s <= before_s * (1 + KEEP_SLOWER) or plan == before:
            return False
        selective = self.blocks is not None and bool(self.blocks.selective)
        if self.blocks is not None and self.blocks.names:
            self._unwrap()  # the trace as the plan before ran, re-timed
        self._policy_planned, self._retimed = False, True  # kept: later re-timings only follow its prediction
        self._adopt(before)
        if selective and not self._no_selective and self.policy is not None:
            # selective checkpointing's dispatch mode costs every op of its blocks, forward and
            # recompute, beyond what the trace's gaps say (bert small at 50%: planned at 13 ms,
            # ran at 24-26); its plan lost: the policy plans once more without it, on trial alike
            self._no_selective = True
            self._plan_from(present(self.trace, "the trace as the plan before ran"), retimed=True)
            if self.plan != before:
                self._tried = (before, before_s)
                self._executed.forget()
        return True

    def _unwrap(self) -> None:
        """The checkpointed blocks run their own forward again, and the trace of the steps as they
        ran with none checkpointed is back (what was laid out, and the steps kept re-timed, were
        for blocks checkpointed)."""
        present(self.blocks, "the model's blocks").remove()
        self.plans.clear()
        self._executed.forget()
        self.trace = present(self._unwrapped_trace, "the trace with no block checkpointed")
        self.first_sight = dict(self._unwrapped_first_sight)

    def _checkpoint_blocks(self, names: tuple[str, ...], saved: dict[str, frozenset[Any]]) -> None:
        """Checkpoint the blocks ``names`` (``saved``: those selectively) from the next step on,
        which is profiled again: plans and layouts made before are for steps that ran otherwise."""
        present(self.blocks, "the model's blocks").install(names, saved)
        self._plan_again()

    def _gradients_static(self) -> None:
        """R3: from this step on the gradients count as static (a step began with them). The
        profiling steps before it counted them from their birth: they go, and profiling goes on
        (a family mixing both would predict sizes wrongly); a plan made on them is for steps that
        held less: the steps are profiled again."""
        if self.trace is None:
            self._profiles = []
        else:
            self._plan_again()

    def _plan_again(self) -> None:
        """Every layout (and plan in the making) is for steps that ran otherwise: drop them, and
        profile the next steps."""
        self.plans.clear()
        self._profile_again(steps=self.profile_steps)

    def _profile_again(self, steps: int) -> None:
        """The next ``steps`` steps are profiled, and the policy plans after them: what was planned
        is for steps that ran otherwise (new blocks checkpointed, a step that left its trace)."""
        self.trace = self.plan = self.layout = self.predicted_s = None
        self._profiled = self.profile_steps - steps
        self._profiles = []
        self._executed.forget()
