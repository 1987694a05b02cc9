"""PolicyRuntime: execute a SwapPlan in real training through ``saved_tensors_hooks``.

    runtime = swapsched.SwapRuntime(budget="60%", policy="default")
    for batch in loader:
        with runtime.step():
            loss = loss_fn(model(batch)); loss.backward()
        optimizer.step(); optimizer.zero_grad()
    print(runtime.report())

What a run does, phase by phase, and which module holds each job: the package's docstring
(``swapsched/runtime/__init__.py``). This module is ``PolicyRuntime``, the runtime to which
``swapsched.SwapRuntime`` gives policies by name: profile, plan, execute, re-time, one phase after
another (see :class:`Phase`); R9's two stages and ``use_plan`` are ``two_stages.py``'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Literal, overload

import torch

from swapsched.budget import BudgetError
from swapsched.env.result import SimResult
from swapsched.env.state_parts import as_held
from swapsched.errors import UserError, internal_assert, present
from swapsched.hardware import HOST_COSTS, Hardware
from swapsched.plan import SwapPlan, carry_evictions
from swapsched.policy import Policy
from swapsched.runtime.accounting import StepExecution
from swapsched.runtime.backends import Backend, resolve_backend, runtime_devices
from swapsched.runtime.budgets import ShapeBudgets
from swapsched.runtime.disk_store import with_disk
from swapsched.runtime.execute_step import ExecuteStep
from swapsched.runtime.frame import GradientsKept, Phase, SavedTensorHooks, StepFrame
from swapsched.runtime.layout import PlanLayout
from swapsched.runtime.plans import ShapePlans, without_small
from swapsched.runtime.profile_step import ProfileStep
from swapsched.runtime.profiler import static_bytes_of
from swapsched.runtime.recompute import BlockCheckpoints
from swapsched.runtime.recorder import storage_key
from swapsched.runtime.replicas import every_rank, note_the_other_ranks, on_every_rank
from swapsched.runtime.reports import Divergence, DivergenceError, RunSummary, RunTally, StepReport
from swapsched.runtime.retime import ExecutedSteps
from swapsched.runtime.shapes import with_family_other
from swapsched.runtime.state_mover import StateMover
from swapsched.runtime.state_plans import RuntimeState
from swapsched.runtime.two_stages import TwoStages
from swapsched.trace import Trace

__all__ = ["PolicyRuntime", "Phase", "StepReport", "RunSummary", "Divergence", "DivergenceError"]


#: Executed steps of a shape that follow a plan moving nothing, before its steps run unhooked
UNHOOK_AFTER = 2


class PolicyRuntime(TwoStages):
    """Executes a swap plan in real training; see the module docstring.

    ``budget``: ``"60%"`` of the profiled activation peak, or bytes (``"6GiB"``). ``policy``: the object that plans
    (anything with ``plan(trace, budget, hardware) -> SwapPlan``; names such as ``"default"`` are resolved by
    ``swapsched.SwapRuntime`` or ``swapsched.get_policy``, one layer up); ``None`` plans nothing: every tensor stays until a
    plan is given with ``use_plan``. ``hardware``: the profile the policy plans for (default: ``cpu-emulated`` on the CPU
    backend, ``h100-pcie5`` on CUDA; best: one written by ``swapsched calibrate``). ``backend``: ``"cuda"``, ``"cpu"`` or
    ``None`` (CUDA when available). ``bandwidth``: throttle of the CPU backend's copy engines, bytes/s; without ``hardware``
    the plan is made for that link. ``min_bytes``: saved tensors smaller than this always stay (the plan's evictions of them
    are dropped before it runs, which can leave the guard work to do; by default nothing is dropped, since policies already
    weigh each copy's latency). ``model``/``optimizer``: counted in ``static_bytes`` (parameters, gradients, optimizer
    state), so that budgets cover the whole device; without them the budget covers the saved activations alone. With both
    and a byte budget no plan of the activations alone meets, the policy places the training state too and the runtime moves
    it (R13-R17, ``state_mover.py``): the user's ``optimizer.step()`` steps host-placed groups on the host. With ``model``
    the profiling steps also record each saved tensor's module, so the policy may recompute blocks (R9): a plan that does
    runs those blocks under ``torch.utils.checkpoint`` (see ``runtime/recompute.py``), profiles the steps again as they now
    run, and has the policy plan the swaps of what the blocks leave saved. ``profile_steps``: steps run under
    ``save_on_cpu`` semantics before planning; the trace takes each gap's median over them (the first step of a process pays
    one-off costs, allocator growth and kernel selection, that later steps do not). ``retime_steps``: on the CPU backend,
    executed steps re-time the trace after this many (the policy plans again on it; a plan given by ``use_plan`` stays),
    then at intervals that double (the prediction follows); with a ``hardware`` that has no host costs (the shipped
    profiles) they fit those too (``fitted_host_costs``); 0: keep the profiled timing. ``tune``: on the CPU backend, before
    the first re-timing two steps run the compute without hooks, timed and unbudgeted (report mode ``"timing"``: what the
    hooks cost, DESIGN R1), and the policy's plan on the re-timed steps is on trial against the plan before it: the faster
    measured one stays (False: neither). ``audit``: measure the memory really held, independently of the accounting, into
    ``report().measured_peak_bytes`` (on the CPU backend a finalizer per saved storage: slower). ``strict``: a step that
    leaves the profiled trace raises :class:`DivergenceError` where it leaves it, instead of finishing on demand and
    profiling again (``report().divergence`` says where either way). ``background_planning``: a shape after the first one
    planned runs at once on a plan borrowed from its family (the one the simulator times fastest on its trace), while the
    policy plans it on a thread; its plan is used from the first step that starts after it is ready (:meth:`wait_for_plans`
    waits for them). False: the policy plans it between steps. ``disk``: R19, a directory on a local drive where plans rest
    the optimizer state the ``host_budget`` cannot hold (``disk_budget`` bytes: ``with_disk``). Only what the runtime owns
    is evicted. Storages the profiling steps find alive after autograd let go of them (the caller's inputs and outputs,
    module buffers) stay resident; their bytes are counted once, in the trace's ``static_bytes``, and reported as
    ``unowned_bytes``. Autocast's casts of parameters are made again where backward reads them (R12, casts.py).
    """

    def __init__(self, budget: str | int = "60%", policy: Policy | None = None, hardware: Hardware | str | None = None,
                 backend: str | Backend | None = None, *, bandwidth: float | None = None, min_bytes: int = 0,
                 model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 profile_steps: int = 3, retime_steps: int = 3, audit: bool = False, strict: bool = False,
                 background_planning: bool = True, host_budget: str | int | None = None, unhook: bool = True,
                 quick_policy: Policy | None = None, disk: str | Path | None = None,
                 disk_budget: str | int | None = None, tune: bool = True):
        self.strict, self.tune = bool(strict), bool(tune)
        self.unhook = bool(unhook)  # a plan that moves nothing may run without hooks (may_unhook)
        # the budget in bytes per shape (budgets.py); "device" (CUDA) is resolved at the first step
        budgets = ShapeBudgets(budget)  # malformed: fails here
        if policy is not None and not isinstance(policy, Policy):
            raise UserError(f"policy must be an object with plan(trace, budget, hardware), got {policy!r}; "
                            "for a name such as 'default' use swapsched.SwapRuntime or swapsched.get_policy(name)")
        # a planner fast enough for the loop's thread (the learned parts' greedy plan): a new shape
        # starts on its plan where it beats the borrowed one and fits the planning share
        if quick_policy is not None and not isinstance(quick_policy, Policy):
            raise UserError(f"quick_policy must be an object with plan(trace, budget, hardware), got {quick_policy!r}")
        if profile_steps < 1:
            raise UserError(f"profile_steps must be at least 1, got {profile_steps}")
        if retime_steps < 0:
            raise UserError(f"retime_steps must be 0 (off) or more, got {retime_steps}")
        # every argument checked before the backend starts its copy engines
        name = backend.name if isinstance(backend, Backend) else resolve_backend(backend)
        if budgets.device and name != "cuda":
            raise UserError("budget='device' is the CUDA device's own capacity; on the CPU backend give bytes "
                            "('6GiB') or a share of the step's activation peak ('60%')")
        hw, self.backend = runtime_devices(name, backend if isinstance(backend, Backend) else None, hardware, bandwidth,
                                           host_budget)
        if disk_budget is not None and disk is None:
            raise UserError("disk_budget= is the room on the drive given as disk='/path/on/nvme': give both")
        hw = hw if disk is None else with_disk(hw, disk, disk_budget)
        # the layouts per shape, each shape's first plan, and the policy's plans made on a thread
        # while steps run on a plan borrowed at once from the family (plans.py)
        self.plans = ShapePlans(hw, budgets, policy, quick_policy, min_bytes=min_bytes, background=background_planning)
        self.profile_steps = int(profile_steps)
        self._profiled = 0
        self._agreed = False  # the first plan's refusal was shared with every rank (replicas.on_every_rank)
        self._profiles: list[tuple[Trace, dict[int, int]]] = []  # (trace, its order of first sight)
        self.retime_steps = int(retime_steps)
        # executed steps re-time the trace; on uncalibrated hardware (no host costs) they fit those too
        self._executed = ExecutedSteps(self.retime_steps, hw, self.backend.emulated and not any(getattr(hw, k) for k in HOST_COSTS))
        self._policy_planned = False  # the plan is the policy's (re-planned after re-timing), not use_plan's
        # parameters, gradients, optimizer state: in absolute budgets when the model is given
        self.static_bytes = static_bytes_of(model, optimizer) if model is not None else 0
        self.model = model
        # R13-R17: whether the state moves, its trace, and the mover of each plan (state_plans.py)
        self.state = RuntimeState(model, optimizer, self.backend, self.plans.budgets, disk)
        # R9: the blocks the plan recomputes run under torch.utils.checkpoint (the model's own
        # modules are wrapped, so only with a model); block -> the bytes its recompute rebuilds
        self.blocks = BlockCheckpoints(model) if model is not None else None
        self._rebuilt: dict[str, int] = {}
        # storages already in static_bytes that a step may pack (BatchNorm saves its running stats)
        self._static_keys = frozenset(storage_key(b) for b in model.buffers()) if model is not None else frozenset()
        self.audit = bool(audit)
        self.trace: Trace | None = None
        self._unwrapped_trace: Trace | None = None  # the last trace profiled with no block checkpointed
        self._unwrapped_first_sight: dict[int, int] = {}  # and its order of first sight
        self.first_sight: dict[int, int] = {}
        self.plan: SwapPlan | None = None
        # the adopted plan laid out for the hooks, and one per shape seen (keyed by the bytes of the
        # step's first saved tensor): a step of a shape profiled before executes that shape's plan
        self.layout: PlanLayout | None = None
        self._hooks: SavedTensorHooks | None = None  # the running step's (see take_hooks_off)
        # use_plan's plan that recomputes and swaps: (the trace it was made on, the plan) until the
        # steps with its blocks checkpointed are profiled and its swaps carried onto them
        self._given: tuple[Trace, SwapPlan] | None = None
        self._grads = GradientsKept(model)  # see note_grads
        self.predicted_s: float | None = None
        self.steps = 0
        self._report: StepReport | None = None
        self._tally = RunTally()
        self._closed = False
        self._exec: StepExecution | None = None
        # the executing plan's trace was re-timed from executed steps (the trace's meta counts them)
        self._retimed = False
        self._timing = False  # this step runs the plan's compute without hooks, timed (ExecutedSteps.times_compute)

    # ------------------------------------------------------------------ what the plans hold
    @property
    def policy(self) -> Policy | None:
        """What plans (``plan(trace, budget, hardware) -> SwapPlan``); None plans nothing."""
        return self.plans.policy

    @property
    def hardware(self) -> Hardware:
        """The profile plans are made and timed for (host costs fitted from executed steps, where fitted)."""
        return self.plans.hardware

    @property
    def layouts(self) -> dict[int, PlanLayout]:
        """The layout of each shape seen, by the bytes of its first saved tensor."""
        return self.plans.layouts

    @property
    def min_bytes(self) -> int:
        """Saved tensors smaller than this always stay on the device."""
        return self.plans.min_bytes

    @property
    def budget_spec(self) -> str | int | float:
        """The budget as given (``"device"`` resolved into bytes at the first step)."""
        return self.plans.budgets.spec

    @property
    def budget_bytes(self) -> int | None:
        """The current shape's budget in bytes (a relative one: of its own activation peak); None before a trace."""
        return self.plans.budgets.bytes

    # ------------------------------------------------------------------ the public surface
    @contextlib.contextmanager
    def step(self) -> Iterator[PolicyRuntime]:
        """One training step (forward and backward) under the runtime."""
        if self._exec is not None or self._closed:
            raise UserError("runtime.step() is already active; steps cannot nest" if self._exec is not None else
                            "this runtime is closed (its copy engines are stopped); make a new SwapRuntime")
        # timed on the device: what is queued before it (the optimizer's step) finishes first
        self.backend.synchronize()
        self.backend.take_device_stall_s()  # waits of an earlier, aborted step do not count
        self.state.optimizer_stepped(profiling=self.phase is Phase.PROFILE)  # R15: its time, before any plan
        self.steps += 1
        if self.plans.budgets.device:  # the device's capacity less what the process holds beyond the model
            total, held = self.backend.memory()
            self.plans.budgets.resolve_device(total, max(0, held - self.static_bytes), self.static_bytes)
        if self.state.gradients_at_start(self.trace is not None and self.trace.state_gradients_born):  # R3: no longer born
            self._gradients_static()
        t_install = time.perf_counter()
        if self.plans.planning:
            self._install_plans()  # laying out the plans made in the background counts as planning too
        installing_s = time.perf_counter() - t_install
        if self.phase is Phase.PROFILE:
            self.state.profile_with_state_on_host(self.static_bytes, self.hardware.host_budget_bytes)
        self._timing = self.phase is Phase.RETIME and self._times_compute()
        frame = StepFrame(backend=self.backend, hardware=self.hardware, model=self.model, static_bytes=self.static_bytes,
                          static_keys=self._static_keys, min_bytes=self.min_bytes, strict=self.strict, audit=self.audit,
                          step=self.steps, blocks=self.blocks, rebuilt=dict(self._rebuilt), held=self.state.held_by_others(),
                          # a real device marks its gaps until re-timed once (the emulated one's clock is free)
                          device_timed=not self.backend.emulated and self.retime_steps > 0 and self.trace is not None
                          and not self._retimed, layout=self._step_layout(), host=self, state=self.mover,
                          gradients_born=self.state.counts_gradients_from_birth)
        ex: StepExecution = ProfileStep(frame) if self.phase is Phase.PROFILE else ExecuteStep(frame)
        self._exec = ex
        mover = self.mover
        t0 = time.perf_counter()
        try:
            if mover is not None:
                mover.on_bytes = ex.state_bytes  # before its first fetch (begin_step issues it)
                mover.room = getattr(ex, "state_room", None)  # an executing step's budget; a profiling step has none
                mover.timer = ex.recorder.timer if isinstance(ex, ProfileStep) else None
                mover.begin_step()
            with SavedTensorHooks(ex.pack, ex.unpack, self.state.refuse_compiled) as self._hooks:
                yield self
            ex.finish()
        except BaseException as exc:
            ex.abort()  # leave no held buffers; the next step starts clean
            note_the_other_ranks(exc, self.state.distributed, self.steps)
            raise
        finally:
            self._exec = None
            if mover is not None:  # every parameter, gradient and state where the user can read it
                mover.on_bytes = mover.room = None
                mover.end_step()
        self.backend.synchronize()
        step_s = time.perf_counter() - t0
        rep = ex.report(step_s)
        if self._timing and (rep.unhooked or mover is not None):  # R1: unbudgeted (the emulated device's memory is the host's)
            rep = replace(rep, mode="timing", predicted_step_s=None, peak_device_bytes=None, plan_followed=False)
        if mover is not None and self.trace is not None:
            rep = replace(rep, state=mover.report(self.trace.state))
        self._report = replace(rep, run=self._tally.add(rep, budget_bytes=self.budget_bytes, budget_spec=self.budget_spec, shapes=len(self.layouts)))
        t_after = time.perf_counter()
        self._after_step(ex)
        self._report = replace(self._report, planning_s=installing_s + ex.planning_s + time.perf_counter() - t_after)
        self.plans.note_step(step_s, self._report.planning_s)

    # ------------------------------------------------------------------ what a running step asks (frame.StepHost)
    def layout_of_shape(self, first_bytes: int, like: PlanLayout) -> PlanLayout | None:
        return self.plans.get(first_bytes) or self.plans.predict(like, first_bytes)

    def may_unhook(self, layout: PlanLayout) -> bool:
        """Whether a step of ``layout``'s shape may run without hooks once its first saved tensor
        confirms the shape: its plan moves nothing and is not on trial, the trace was re-timed once (later re-timing
        only follows the host's costs, which such a step does not pay), nobody asked to watch
        (``audit``, ``strict``, ``unhook=False``: what measures the hooks themselves), it saves no cast of a weight (R12:
        unhooked, autograd would hold each to backward), and ``UNHOOK_AFTER`` steps of the shape ran it as planned."""
        return (self._timing and self.mover is None) or (self.unhook and not self.audit and not self.strict and (self._retimed or not self.retime_steps) and not
                layout.plan.evictions and not layout.plan.state and not layout.trace.meta.get("recasts")
                and self.plans.followed(layout) >= UNHOOK_AFTER and self._tried is None)

    def take_hooks_off(self) -> None:
        """Take the step's hooks off (from inside its first pack: they are the innermost ones)."""
        present(self._hooks, "the running step's hooks").off()

    def _after_step(self, ex: StepExecution) -> None:
        """The after-step work of the kind of step ``ex`` was (one method per kind)."""
        rep = present(self._report, "the report of the step that just ran")
        if isinstance(ex, ExecuteStep) and ex.profile is None:
            if not rep.unhooked:
                self.plans.note_followed(ex.layout, rep.plan_followed and rep.guard_evictions == 0 and not ex.diverged)
            if not ex.diverged and rep.mode == "execute":
                self.plans.note_times(ex.layout, rep)
        if isinstance(ex, ProfileStep):
            if ex.trace is not None:
                self.first_sight = ex.first_sight
            self._after_profile(ex)
        elif not isinstance(ex, ExecuteStep):
            internal_assert(False, f"a step of kind {type(ex).__name__}")
        elif ex.profile is not None:
            if ex.profile.trace is not None:
                self.first_sight = ex.profile.first_sight
            self._after_new_shape(ex.profile)
        elif ex.diverged:
            self._after_divergence(ex)
        elif ex.layout is not self.layout and not self._timing:  # another shape's plan: it re-times nothing of this one
            self.plans.note_other_shape(ex.layout, rep)
        elif self.phase is Phase.RETIME:
            self._after_retime_step()

    @property
    def phase(self) -> Phase:
        """What the next step does (see :class:`Phase`)."""
        if self.layout is None:
            return Phase.PROFILE
        if self.retime_steps and (self.backend.emulated or not self._retimed):
            return Phase.RETIME
        return Phase.EXECUTE

    # ------------------------------------------------------------------ after a step, per phase
    def _after_profile(self, ex: ProfileStep) -> None:
        """A profiling step: once ``profile_steps`` are in, plan on their median trace."""
        if ex.trace is None:  # nothing was unpacked (no backward): nothing learned, profile again
            return
        self._profiled += 1
        self._profiles.append((ex.trace, dict(self.first_sight)))
        if self.blocks is not None:
            self.blocks.record_producers(ex.trace, ex.producers)
        if self._profiled < self.profile_steps:
            return
        profiled, self._profiles = self._profiles, []
        if self._agreed:
            self._plan_profiled(profiled)
            return
        # the run's first plan: a refusal on one rank is the same refusal on every rank (R18)
        self._agreed = True
        on_every_rank(self.state.distributed, lambda: self._plan_profiled(profiled))

    def _after_new_shape(self, profiled: ProfileStep) -> None:
        """A shape no plan was made for, profiled in the step that showed it: planned now, from this one profile
        (the first steps' one-off costs are paid), and kept with the other shapes' plans."""
        if profiled.trace is None:
            return
        trace = self.state.with_state(profiled.trace)
        kin = self.plans.kin(trace, self.first_sight)
        # its other bytes were sampled, not measured (R3): at least what its family measured
        trace = with_family_other(trace, [lay.trace for lay in kin])
        try:
            self.plans.budgets.of(trace)
        except BudgetError:
            # refused: the step ran on the host (profiling), so only its gradients are left of it; put back, the model,
            # the optimizer (it has not stepped) and this runtime are as if the step had never come
            self._grads.restore()
            raise
        self._grads.drop()
        self._executed.forget()
        if not (kin and self.plans.background and self.policy is not None):
            self._plan_from(trace)
            return
        # at once, the family's plan the simulator times fastest here; the policy's on a thread
        self._take_trace(trace)
        self._adopt(*self.plans.first_plan(trace, kin))
        self.plans.plan_later(present(self.layout, "the layout just adopted"))

    def _after_divergence(self, ex: ExecuteStep) -> None:
        """The step left its trace: the next step is profiled and planned again."""
        if ex.layout.predicted:  # the prediction was wrong: that size is profiled when it comes again
            self.plans.forget(ex.layout.shape_key)
        self._profile_again(steps=1)

    def _after_retime_step(self) -> None:
        """At each re-timing (``ExecutedSteps``): the gaps and host costs as the steps ran; the policy may plan again."""
        if (due := self._executed.add(present(self._report, "the last step's report"), present(self.trace, "the trace"))) is None:
            return
        retimed, fitted = due
        if fitted is not None:
            self.plans.hardware = fitted
        if self._keep_the_faster():
            return
        if not self._retimed and self._policy_planned:
            self._plan_again_on(retimed)
        else:
            # the plan stays (use_plan's always does); its prediction follows the compute and host costs as they ran
            self.trace, self._retimed = retimed, True
            self._adopt(present(self.plan, "the executing plan"))

    @overload
    def report(self, all_ranks: Literal[False] = False) -> StepReport: ...
    @overload
    def report(self, all_ranks: Literal[True]) -> tuple[StepReport, ...]: ...
    def report(self, all_ranks: bool = False) -> StepReport | tuple[StepReport, ...]:
        """The last step's report. ``all_ranks``: every rank's, in rank order, on every rank (R18;
        a collective: every rank calls it)."""
        if self._report is None:
            raise UserError("no step has run yet; wrap a training step in `with runtime.step():`")
        rep = replace(self._report, optimizer_step_s=self.state.optimizer_step_s())  # the user's, since the step
        return every_rank(rep) if all_ranks else rep

    def close(self) -> None:
        """Stop the copy engines, put the moved state back on the device where it has room (on CUDA, what does not fit
        stays on the host, with a warning), and unwrap checkpointed blocks. ``with`` closes itself."""
        self._closed = True
        self.plans.shutdown()
        self.state.close()
        if self.blocks is not None:
            self.blocks.remove()
        self.backend.shutdown()

    def __enter__(self) -> PolicyRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ planning
    def note_grads(self) -> None:
        """Before a new shape's step reaches backward: the gradients as they are, back if it is refused."""
        self._grads.keep()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer that steps the model, where it exists only after the runtime is made
        (a trainer creates it as training starts): its state counts in ``static_bytes`` and may
        move (R13). Only before a plan is made."""
        self.static_bytes = self.state.attach(optimizer, planned=self.plan is not None)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer that steps the model (its state counts, and may move: R13)."""
        return self.state.optimizer

    @property
    def mover(self) -> StateMover | None:
        """What moves the training state where the adopted plan places it (``state_mover.py``)."""
        return self.state.mover

    def _take_trace(self, trace: Trace, retimed: bool = False) -> None:
        """``trace`` (profiled, or ``retimed`` by executed steps) is the one plans are made on
        from now, with the run's budget checked against it."""
        self.plans.budgets.take(trace)  # a refusal changes nothing
        self.trace, self._retimed = trace, retimed
        if self.blocks is None or not self.blocks.names:
            self._unwrapped_trace, self._unwrapped_first_sight = trace, dict(self.first_sight)

    def _plan_from(self, trace: Trace, retimed: bool = False) -> None:
        """Plan on ``trace`` (profiled, or ``retimed`` by executed steps) and adopt the plan."""
        try:
            self._take_trace(trace, retimed)
        except BudgetError as exc:
            self._refuse_given_blocks(exc)
            raise
        planned_on = self._planned_on(trace)
        if self._given is not None:  # use_plan's plan, its blocks now checkpointed: its swaps carried over
            before, given = self._given
            self._given = None
            plan = SwapPlan.of(trace, given.policy, carry_evictions(given, before, trace), carried_from=given.trace)
            self._adopt(without_small(plan, trace, self.min_bytes))
            return
        plan = (SwapPlan.of(trace, "keep-all", []) if self.policy is None  # nothing plans: every tensor stays until use_plan()
                else self.policy.plan(planned_on, present(self.budget_bytes, "the run's budget"), self.hardware))
        self._policy_planned = True
        if plan.recompute or plan.selective:
            self._recompute(plan, planned_on)
            return
        self._adopt(without_small(plan, trace, self.min_bytes))

    def _adopt(self, plan: SwapPlan, simulated: SimResult | None = None) -> None:
        """Check ``plan`` (R7), predict its step time, and lay it out per event for the hooks."""
        internal_assert(not (plan.recompute or plan.selective), "a plan that recomputes goes through _recompute (R9's two stages)")
        trace = present(self.trace, "the trace a plan is adopted on")
        plan.validate(trace)
        if plan.state and plan.host_step != "after-backward":  # the user's optimizer.step() runs the host steps
            plan, simulated = replace(plan, host_step="after-backward"), None
        plan = as_held(plan, trace.state, self.hardware)  # R11, R19: as the simulator runs it
        self.state.place(plan, trace)
        self.layout = self.plans.lay_out(trace, plan, simulated, first_sight=self.first_sight)
        self.plan, self.predicted_s = plan, self.layout.predicted_s
        self.plans.keep(self.layout)

    def wait_for_plans(self) -> None:
        """Wait for the plans being made in the background, and use them from the next step on."""
        self._install_plans(wait=True)

    def _install_plans(self, wait: bool = False) -> None:
        """The plans made in the background that are ready (all of them, with ``wait``) in place
        of the layouts they were made for; the current shape's later steps follow its new plan."""
        for replaced, layout in self.plans.install_ready(wait):
            if self.layout is replaced:
                self.layout, self.plan, self.predicted_s, self.trace = layout, layout.plan, layout.predicted_s, layout.trace

