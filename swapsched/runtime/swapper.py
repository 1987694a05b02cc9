"""SwapRuntime: execute a SwapPlan in real training through ``saved_tensors_hooks``.

    runtime = swapsched.SwapRuntime(budget="60%", policy="default")
    for batch in loader:
        with runtime.step():
            loss = loss_fn(model(batch)); loss.backward()
        optimizer.step(); optimizer.zero_grad()
    print(runtime.report())

Step 1 is profiled into a Trace (``timing: measured``) while every saved tensor goes to the host
and comes back on demand (PyTorch's ``save_on_cpu`` semantics, so the profiling step fits any
feasible budget); the policy then plans once (on the CPU backend, once more after the first
executed steps have re-timed the trace: ``timed_by_execution``). Later steps execute the plan by
the rules the simulator uses (R4-R7): at each hook call *i* (an event of the trace) the runtime (a)
makes the unpacked tensor resident, waiting for its swap-in or copying it on demand, (b) frees
tensors whose last use is *i*, (c) issues the swap-outs planned at *i*, (d) issues the prefetches
planned at *i*, which wait in issue order for room under the budget.

Each step's events are checked against the trace. When they diverge (other shapes, other control
flow) the step finishes on demand (nothing new is evicted, everything evicted comes back when
unpacked) and the next step is profiled and planned again. A guard evicts on the spot, by the MIN
rule, when the accounted device memory would exceed the budget despite the plan.

Stashes: ``_Packed`` is what autograd keeps per pack (the runtime only holds weak references to
it): the record and, while the record is resident, the original tensor (which keeps the storage
alive, and whose detached alias is what unpacking a kept tensor returns). ``_Record`` is one
saved storage (R2). When it is evicted, its swap-out
ticket holds the device storage (a flat ``uint8`` view) until the copy completes, each handle keeps
only its view's geometry (dtype, size, stride, offset), and the record keeps the host buffer; after
a swap-in the record holds the new device storage and unpacks rebuild the views on it.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from swapsched.budget import BudgetError, check_budget, format_bytes, parse_budget, smallest_feasible
from swapsched.env.simulator import FREED, HOST, IN, OUT, RESIDENT, event_tables, simulate
from swapsched.errors import UserError
from swapsched.hardware import HOST_COSTS, Hardware, default_hardware, load_hardware
from swapsched.plan import SwapPlan
from swapsched.policy import Policy
from swapsched.runtime.backends import Backend, CopyError, CpuBackend, Ticket, make_backend, resolve_backend
from swapsched.runtime.profiler import (
    ModulePath,
    StorageIds,
    TraceRecorder,
    is_cached_cast,
    is_parameter,
    static_bytes_of,
    storage_key,
)
from swapsched.runtime.recompute import BlockCheckpoints
from swapsched.runtime.reports import Divergence, DivergenceError, PlanLayout, RunSummary, RunTally, StepReport
from swapsched.runtime.retime import fitted_host_costs, median_trace, timed_by_execution
from swapsched.runtime.shapes import predicted_trace, structure
from swapsched.trace import Trace

__all__ = ["SwapRuntime", "StepReport", "RunSummary", "Divergence", "DivergenceError"]

# one set of locations for the simulator and the runtime (the runtime never has NOT_YET or WAITING)


# the autograd engine's id of the backward pass running now (a private API, present since torch
# 2.0; where it is missing every pass counts as one, and only a budget error loses its reason)
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: 0)


class _Record:
    """One saved storage (R2). Plain slots: one is made per saved tensor, on the hot path."""

    __slots__ = ("tid", "nbytes", "key", "flat", "host", "state", "out", "inn", "handles")

    def __init__(self, tid: int, nbytes: int, key: int = 0, host: torch.Tensor | None = None, state: int = RESIDENT):
        self.tid, self.nbytes, self.key = tid, nbytes, key  # key: the storage's identity
        self.flat: torch.Tensor | None = None  # uint8 view of the device storage after a swap-in
        self.host, self.state = host, state
        self.out: Ticket | None = None
        self.inn: Ticket | None = None
        # weak references: autograd owns the handles and drops each once its node has run, which
        # is what frees a kept tensor as early as plain PyTorch would
        self.handles: list[weakref.ref[_Packed]] = []

    def live_handles(self) -> list[_Packed]:
        return [h for h in (r() for r in self.handles) if h is not None]


_UNTRACKED = _Record(-1, 0)  # the step's key map entry for parameters and storages the trace lacks


def _origin_died(packed: weakref.ref[_Packed], _dead: object) -> None:
    """The program's tensor died: read the version its storage ended with, and let the alias go."""
    p = packed()
    if p is not None and p.watch is not None:
        p.seen = p.watch._version
        p.watch = None


class _Packed:
    """What autograd keeps per pack: the record and, while it is resident, a detached alias.

    It also keeps autograd's own check on saved tensors, which saved-tensor hooks otherwise lose
    (``save_on_cpu`` computes silently with a value changed in place): the version counter at
    pack, compared at unpack with the last version the bytes could have reached (``check_version``).
    A swap-out copies the bytes while the program may still hold its tensor and change it, so a
    let-go alias is kept (``watch``) until the program's tensor dies: that tensor holds the same
    storage, so the alias costs no memory, and its version counter is the one the change bumps."""

    __slots__ = ("rec", "tensor", "geometry", "version", "seen", "watch", "origin", "__weakref__")

    def __init__(self, rec: _Record | None, t: torch.Tensor):
        # a detached alias: holding the tensor itself would tie it to its own grad_fn in a
        # reference cycle (the handle lives in that grad_fn) that only the cyclic GC frees;
        # autograd re-attaches the grad_fn when it unpacks (as with save_on_cpu's copies). The
        # alias shares the tensor's storage and its version counter.
        self.rec, self.tensor = rec, t.detach()
        self.version = self.seen = t._version
        self.watch: torch.Tensor | None = None
        # the callback holds this record weakly: a strong one would keep it alive past autograd
        self.origin = weakref.ref(t, partial(_origin_died, weakref.ref(self)))
        # (dtype, size, stride, storage offset, conj bit, neg bit): taken when the tensor reference
        # is dropped. The two bits are lazy views over the same bytes (a complex tensor's conj()),
        # so the raw storage alone would give back the unconjugated values.
        self.geometry: tuple[Any, ...] | None = None

    def let_go(self) -> None:
        """Drop the tensor reference, keeping what is needed to rebuild the view and to check it."""
        t = self.tensor
        if t is not None:
            self.geometry = (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.is_conj(), t.is_neg())
            self.seen = t._version
            self.tensor = None
            if self.origin() is not None:
                self.watch = t

    def check_version(self) -> None:
        """Refuse a saved tensor changed in place since its pack, as autograd does without hooks."""
        t = self.tensor if self.tensor is not None else self.watch
        now = t._version if t is not None else self.seen
        if now != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a saved tensor is at version {now}; expected version {self.version} instead. "
                "(swapsched keeps autograd's check; clone the tensor before changing it in place.)")


class SwapRuntime:
    """Executes a swap plan in real training; see the module docstring.

    ``budget``: ``"60%"`` of the profiled activation peak, or bytes (``"6GiB"``). ``policy``: the
    object that plans (anything with ``plan(trace, budget, hardware) -> SwapPlan``; names such as
    ``"default"`` are resolved by ``swapsched.SwapRuntime`` or ``swapsched.get_policy``, one layer up);
    ``None`` plans nothing: every tensor stays until a plan is given with ``use_plan``.
    ``hardware``: the profile the policy plans for (default: ``cpu-emulated`` on the CPU backend,
    ``h100-pcie5`` on CUDA; best: one written by ``swapsched calibrate``). ``backend``: ``"cuda"``,
    ``"cpu"`` or ``None`` (CUDA when available). ``bandwidth``: throttle of the CPU backend's copy
    engines, bytes/s; without ``hardware`` the plan is made for that link.
    ``min_bytes``: saved tensors smaller than this always stay (the plan's evictions of them are
    dropped before it runs, which can leave the guard work to do; by default nothing is dropped,
    since policies already weigh each copy's latency). ``model``/``optimizer``: counted in ``static_bytes`` (parameters,
    gradients, optimizer state), so that budgets cover the whole device; without them the budget
    covers the saved activations alone. With ``model`` the profiling steps also record each saved
    tensor's module, so the policy may recompute blocks (R9): a plan that does runs those blocks
    under ``torch.utils.checkpoint`` (see ``runtime/recompute.py``), profiles the steps again as
    they now run, and has the policy plan the swaps of what the blocks leave saved. ``profile_steps``: steps run under ``save_on_cpu``
    semantics before planning; the trace takes each gap's median over them (the first step of a
    process pays one-off costs, allocator growth and kernel selection, that later steps do not).
    ``retime_steps``: on the CPU backend, after this many executed steps the trace's gaps are
    re-measured from them, the policy plans again on them (a plan given by ``use_plan`` stays) and
    the prediction is redone; after every further this many steps the gaps are re-measured and the
    prediction follows (the plan stays). With a ``hardware`` that has no host costs (the shipped
    profiles), the host's costs are fitted from the executed steps at the same points
    (``fitted_host_costs``). 0: keep the profiled timing.
    ``audit``: measure the memory really held, independently of the accounting, into
    ``report().measured_peak_bytes`` (on the CPU backend a finalizer per saved storage: slower).
    ``strict``: a step that leaves the profiled trace raises :class:`DivergenceError` where it
    leaves it, instead of finishing on demand and profiling again (``report().divergence`` says
    where either way).

    Only what the runtime owns is evicted. Storages the profiling steps find alive after autograd
    let go of them (the caller's inputs and outputs, module buffers) and autocast's cached casts of
    parameters stay resident; their bytes are counted once, in the trace's ``static_bytes``, and
    reported as ``unowned_bytes``.
    """

    def __init__(self, budget: str | int = "60%", policy: Policy | None = None, hardware: Hardware | str | None = None,
                 backend: str | Backend | None = None, *, bandwidth: float | None = None, min_bytes: int = 0,
                 model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 profile_steps: int = 3, retime_steps: int = 3, audit: bool = False, strict: bool = False):
        self.strict = bool(strict)
        self.budget_spec = check_budget(budget)  # a malformed budget fails here, not after profiling
        if policy is not None and not isinstance(policy, Policy):
            raise UserError(f"policy must be an object with plan(trace, budget, hardware), got {policy!r}; "
                            "for a name such as 'default' use swapsched.SwapRuntime or swapsched.get_policy(name)")
        self.policy = policy
        name = backend.name if isinstance(backend, Backend) else resolve_backend(backend)
        if bandwidth is not None and not bandwidth > 0:
            raise UserError(f"bandwidth must be positive bytes/s, got {bandwidth!r}")
        if hardware is None:
            hw = load_hardware(default_hardware(name))
            if bandwidth is not None:  # plan for the link the copies really get
                hw = replace(hw, name=f"{hw.name}@{bandwidth:.3g}B/s", d2h_bytes_per_s=bandwidth, h2d_bytes_per_s=bandwidth)
        else:
            hw = load_hardware(hardware)  # e.g. a calibrated profile: used for planning as it is
        self.hardware = hw
        if isinstance(backend, Backend):
            self.backend = backend
        elif name == "cpu" and bandwidth is not None and hardware is not None:
            self.backend = CpuBackend(bandwidth, bandwidth, 0.0)  # the link alone; its latency was measured
        else:
            self.backend = make_backend(name, hw)
        self.min_bytes = int(min_bytes)
        if profile_steps < 1:
            raise UserError(f"profile_steps must be at least 1, got {profile_steps}")
        self.profile_steps = int(profile_steps)
        self._profiled = 0
        self._profiles: list[Trace] = []
        if retime_steps < 0:
            raise UserError(f"retime_steps must be 0 (off) or more, got {retime_steps}")
        self.retime_steps = int(retime_steps)
        self._executed: list[StepReport] = []  # executed steps not yet used to re-time the trace
        # uncalibrated hardware (no host costs): the runtime fits them from its executed steps
        self._given_hardware = self.hardware
        self._fit_host = self.backend.emulated and not any(getattr(hw, k) for k in HOST_COSTS)
        self._host_steps: deque[StepReport] = deque(maxlen=64)
        self._policy_planned = False  # the plan is the policy's (re-planned after re-timing), not use_plan's
        # parameters, gradients and optimizer state: counted in absolute budgets when the model is given
        self.static_bytes = static_bytes_of(model, optimizer) if model is not None else 0
        self.model = model
        # R9: the blocks the plan recomputes run under torch.utils.checkpoint (the model's own
        # modules are wrapped, so only with a model); block -> the bytes its recompute rebuilds
        self.blocks = BlockCheckpoints(model) if model is not None else None
        self._rebuilt: dict[str, int] = {}
        # storages already in static_bytes that a step may pack (BatchNorm saves its running stats)
        self._static_keys = frozenset(storage_key(b) for b in model.buffers()) if model is not None else frozenset()
        self.audit = bool(audit)
        self.trace: Trace | None = None
        self._unwrapped_trace: Trace | None = None  # the last trace profiled with no block checkpointed
        self.first_sight: dict[int, int] = {}
        self.plan: SwapPlan | None = None
        # the adopted plan laid out for the hooks, and one per shape seen (keyed by the bytes of the
        # step's first saved tensor): a step of a shape profiled before executes that shape's plan
        self.layout: PlanLayout | None = None
        self.layouts: dict[int, PlanLayout] = {}
        # a relative budget is resolved once, against the first profiled step, into bytes for the
        # whole run: a later step of another shape gets the same bytes, or a clear refusal
        self.budget_bytes: int | None = None
        self.predicted_s: float | None = None
        self.steps = 0
        self._report: StepReport | None = None
        self._tally = RunTally()
        self._closed = False
        self._exec: _StepExecution | None = None

    # ------------------------------------------------------------------ the public surface
    @contextlib.contextmanager
    def step(self) -> Iterator[SwapRuntime]:
        """One training step (forward and backward) under the runtime."""
        if self._exec is not None:
            raise UserError("runtime.step() is already active; steps cannot nest")
        if self._closed:
            raise UserError("this runtime is closed (its copy engines are stopped); make a new SwapRuntime")
        # the step is timed on the device: what is queued before it (the last optimizer step)
        # finishes first, and the step ends when the device has run it (below)
        self.backend.synchronize()
        self.backend.take_device_stall_s()  # waits of an earlier, aborted step do not count
        self.steps += 1
        if self.layout is None:
            ex: _StepExecution = _ProfileStep(self)
        else:
            ex = _ExecuteStep(self)
        self._exec = ex
        t0 = time.perf_counter()
        try:
            with torch.autograd.graph.saved_tensors_hooks(ex.pack, ex.unpack):
                yield self
            ex.finish()
        except BaseException:
            ex.abort()  # leave no held buffers; the next step starts clean
            raise
        finally:
            self._exec = None
        self.backend.synchronize()
        step_s = time.perf_counter() - t0
        rep = ex.report(step_s)
        self._report = replace(rep, run=self._tally.add(rep, self))
        profiled = ex if isinstance(ex, _ProfileStep) else ex.profile
        if profiled is not None:
            if profiled.trace is None:  # nothing was unpacked (no backward): nothing learned, profile again
                return
            if profiled is not ex:
                # a shape no plan was made for, profiled in the step that showed it: planned now,
                # from this one profile (the first steps' one-off costs are paid), and kept with
                # the other shapes' plans
                self._executed = []
                self._host_steps.clear()  # steps of another trace: their event counts differ
                self._plan_from(profiled.trace)
                return
            self._profiled += 1
            self._profiles.append(profiled.trace)
            if self._profiled >= self.profile_steps:
                self._plan_from(median_trace(self._profiles))
                self._profiles = []
        elif ex.diverged:
            if ex.layout.predicted:  # the prediction was wrong: that size is profiled when it comes again
                self.layouts.pop(ex.layout.shape_key, None)
            self.trace = self.plan = self.layout = None  # re-profile and re-plan on the next step
            self._profiled = self.profile_steps - 1
            self._profiles = []
            self._executed = []
            self._host_steps.clear()  # steps of another trace: their event counts differ
        elif ex.layout is not self.layout:
            # a step of another shape, under its own plan: it re-times nothing of the current one
            if ex.layout.predicted and not self._report.plan_followed and self.policy is not None:
                self._plan_predicted(ex.layout, self._report)
        elif self.retime_steps and (self.backend.emulated or not self.trace.meta.get("timed_by_execution")):
            if self._report.gaps_s is not None:
                self._executed.append(self._report)
                self._host_steps.append(self._report)
            if len(self._executed) >= self.retime_steps:
                first = not self.trace.meta.get("timed_by_execution")
                retimed = timed_by_execution(self.trace, self._executed)
                self._executed = []
                if self._fit_host:
                    self.hardware = fitted_host_costs(self._given_hardware, list(self._host_steps), retimed.n_events)
                if first and self._policy_planned:
                    self._plan_from(retimed)  # once: the policy plans again, on the compute as it runs
                else:
                    # the plan stays (a plan given by use_plan always does); its prediction follows
                    # the compute and the host's costs as the latest steps ran them
                    self.trace = retimed
                    self._adopt(self.plan)

    def report(self) -> StepReport:
        """The last step's report (also printed when ``verbose``)."""
        if self._report is None:
            raise UserError("no step has run yet; wrap a training step in `with runtime.step():`")
        return self._report

    def use_plan(self, plan: SwapPlan, budget: str | int | None = None) -> None:
        """Execute ``plan`` from the next step on, instead of the policy's (the trace must exist:
        run the profiling steps first), optionally under another ``budget``. Checked against R7
        and the trace."""
        if self.trace is None:
            raise UserError("use_plan() needs the profiled trace: run the profiling steps first")
        if budget is not None:
            self.budget_bytes = self._budget_for(check_budget(budget), self.trace)
            self.budget_spec = budget  # a malformed budget fails here, not after profiling
        if plan.recompute:
            if plan.evictions:
                raise UserError(f"plan {plan.policy!r} both recomputes and swaps: once its blocks run under checkpoint the "
                                "steps save other tensors, and the runtime's policy plans their swaps on them; give the "
                                "plan's recompute alone (SwapPlan(..., evictions=(), recompute=...))")
            if self.blocks is not None:
                self.blocks.remove()  # the plan is made on the steps as they run with no block checkpointed
            self._recompute(plan, self._planned_on(self._unwrapped_trace or self.trace))
        else:
            self._adopt(plan)
        self._policy_planned = False

    def close(self) -> None:
        """Stop the copy engines. ``with SwapRuntime(...) as runtime:`` closes itself."""
        self._closed = True
        if self.blocks is not None:
            self.blocks.remove()
        self.backend.shutdown()

    def _device_timed_step(self) -> bool:
        """Whether the next executed step marks its gaps on the device: on a real device, until
        the trace has been re-timed once (the marks cost a few microseconds a hook; on the
        emulated device the host clock times every step for free)."""
        return (not self.backend.emulated and self.retime_steps > 0 and self.trace is not None
                and not self.trace.meta.get("timed_by_execution"))

    def __enter__(self) -> SwapRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ planning
    def _budget_for(self, spec: str | int | float, trace: Trace, resolved: int | None = None) -> int:
        """``spec`` in bytes for this step's trace (``resolved``: the bytes it already stands for
        in this run); below what the step can meet, one error that names the runtime's budget and
        says why the step cannot go lower."""
        out = parse_budget(spec, trace, check_feasible=False) if resolved is None else resolved
        if out >= trace.min_feasible_bytes:
            return out
        need, pct = smallest_feasible(trace)
        passes = int(trace.meta.get("backward_passes", 1))
        if passes > 1:
            why = (f"; its {passes} backward passes read the same saved tensors (retain_graph=True or "
                   "create_graph=True), and each tensor stays on the device from its first unpack to its last")
        elif need >= trace.peak_bytes_no_swap:
            # one autograd node reads every saved tensor at once: nothing can be away when it runs
            why = ("; its backward reads every saved tensor at once, as a model compiled whole with "
                   "torch.compile does (one autograd node): compile its blocks separately so that tensors "
                   "can move between them")
        else:
            why = ""
        if resolved is not None:
            why += (f"; the budget stands for {format_bytes(resolved)}, resolved against the first profiled step, "
                    "and this step's shape needs more")
        raise BudgetError(f"the runtime's budget {spec!r} is below this training step's smallest "
                          f"feasible budget, {format_bytes(need)} ({need} bytes, {pct:.1f}% of its activation "
                          f"peak above static memory, transients included){why}; give at least that")

    def _planned_on(self, trace: Trace) -> Trace:
        """What the policy may plan on: with the blocks already checkpointed, ``trace`` is the steps
        as they run so (R9 done), and only swaps are planned; else the blocks the runtime can
        checkpoint (none without a model: no module was recorded)."""
        if self.blocks is None or self.blocks.names:
            return trace.with_segments(lambda sg: False)
        return self.blocks.executable(trace)

    def _plan_from(self, trace: Trace) -> None:
        self.trace = trace
        if self.blocks is None or not self.blocks.names:
            self._unwrapped_trace = trace
        self.budget_bytes = self._budget_for(self.budget_spec, trace, resolved=self.budget_bytes)
        planned_on = self._planned_on(trace)
        if self.policy is None:  # nothing plans: every tensor stays until use_plan()
            plan = SwapPlan.of(trace, "keep-all", [])
        else:
            plan = self.policy.plan(planned_on, self.budget_bytes, self.hardware)
        self._policy_planned = True
        if plan.recompute:
            self._recompute(plan, planned_on)
            return
        small = [e for e in plan.evictions if trace.tensors[e.tensor].bytes < self.min_bytes]
        if small:  # tiny tensors stay: copying them costs more than it saves
            plan = SwapPlan(plan.trace, plan.policy, tuple(e for e in plan.evictions if e not in small),
                            {**plan.meta, "kept_small": len(small)})
        self._adopt(plan)

    def _recompute(self, plan: SwapPlan, trace: Trace) -> None:
        """R9, in two stages. Here: checkpoint ``plan``'s blocks from the next step on, and profile
        again, since the steps then save other tensors (each block only its inputs). On that trace
        (``_plan_from``) the policy plans the swaps of what stays saved, and the runtime executes them."""
        if self.blocks is None:
            raise UserError(f"plan {plan.policy!r} recomputes {len(plan.recompute)} block(s) (R9): give the runtime "
                            "the model (SwapRuntime(model=...)) so that it can run them under torch.utils.checkpoint")
        plan.validate(trace)
        size = {sg.name: sg.bytes for sg in trace.segments}
        self._rebuilt = {name: size[name] for name in plan.recompute}
        self.blocks.install(plan.recompute)
        self.layouts.clear()  # laid out for steps that did not checkpoint the blocks
        self.trace = self.plan = self.layout = None
        self.predicted_s = None
        self._profiled = 0
        self._profiles = []
        self._executed = []
        self._host_steps.clear()

    def _adopt(self, plan: SwapPlan) -> None:
        """Check ``plan`` (R7), predict its step time, and lay it out per event for the hooks."""
        assert self.trace is not None and self.budget_bytes is not None
        assert not plan.recompute, "recompute goes through _recompute (R9's two stages)"
        plan.validate(self.trace)
        self.layout = self._layout(self.trace, plan, self.first_sight)
        self.plan, self.predicted_s = plan, self.layout.predicted_s
        self.layouts[self.layout.shape_key] = self.layout

    def _layout(self, trace: Trace, plan: SwapPlan, first_sight: dict[int, int], predicted: bool = False) -> PlanLayout:
        """``plan`` on ``trace`` laid out for the hooks, with its predicted step time."""
        assert self.budget_bytes is not None
        res = simulate(trace, plan, self.hardware, self.budget_bytes, validate=False)
        out_at, prefetch_at = plan.by_event(trace.n_events)  # as the simulator lays it out
        tb = event_tables(trace)
        return PlanLayout(
            trace, plan, None if res.oom else res.iteration_s, out_at, prefetch_at,
            expected_codes=[~t if u else t for t, u in zip(tb.tensor, tb.is_unpack, strict=False)],
            work_at=[bool(f or o or p) for f, o, p in zip(tb.free, out_at, prefetch_at, strict=False)],
            first_sight=dict(first_sight), predicted=predicted)

    def _predicted_layout(self, like: PlanLayout, s: int) -> PlanLayout | None:
        """A layout for the step of ``like``'s family whose first saved tensor has ``s`` bytes,
        without profiling it: its trace predicted from the family's profiled sizes, and the plan of
        a size near it (the same events: its evictions apply as they are), the one the simulator
        times fastest on the predicted trace among the nearest few. None where the family cannot
        predict it. A size that no plan can fit in the run's bytes is refused here, at the step's
        first saved tensor, before its memory is spent."""
        shape = structure(like.trace)
        kin = [lay for lay in self.layouts.values() if lay.first_sight == like.first_sight and structure(lay.trace) == shape]
        trace = predicted_trace([lay.trace for lay in kin if not lay.predicted], s)
        if trace is None:
            return None
        self._budget_for(self.budget_spec, trace, resolved=self.budget_bytes)
        # the nearest few sizes and the nearest larger one (a larger size evicts no less)
        near = sorted(kin, key=lambda lay: abs(lay.shape_key - s))[:4]
        larger = [lay for lay in kin if lay.shape_key >= s]
        if larger:
            near.append(min(larger, key=lambda lay: lay.shape_key))
        assert self.budget_bytes is not None
        timed = [(simulate(trace, lay.plan.evictions, self.hardware, self.budget_bytes, validate=False).iteration_s,
                  lay.shape_key, lay) for lay in near]
        donor = min(timed, key=lambda x: x[:2])[2]
        plan = SwapPlan(trace.name, donor.plan.policy, donor.plan.evictions, {**donor.plan.meta, "borrowed_from": donor.trace.name})
        layout = self._layout(trace, plan, like.first_sight, predicted=True)
        self.layouts[s] = layout
        return layout

    def _plan_predicted(self, layout: PlanLayout, rep: StepReport) -> None:
        """A predicted shape whose borrowed plan did not hold: the policy plans it, on the trace as
        that step ran it (its gaps re-timed where the host clock measured them)."""
        trace = layout.trace
        if rep.gaps_s is not None and len(rep.gaps_s) == trace.n_events:
            trace = timed_by_execution(trace, [rep])
        assert self.policy is not None and self.budget_bytes is not None
        plan = self.policy.plan(self._planned_on(trace), self.budget_bytes, self.hardware)
        if plan.recompute:  # the blocks are chosen on profiled shapes (R9's two stages); here only swaps
            return
        self.layouts[layout.shape_key] = self._layout(trace, plan, layout.first_sight, predicted=True)


class _StepExecution:
    """Common bookkeeping of one step: identities, accounting, counters, and the audit meter."""

    # slots: the hooks read and write these at every saved-tensor event
    __slots__ = ("rt", "backend", "records", "static", "used", "peak", "stall_s", "evicted", "prefetched",
                 "on_demand", "copies", "waits", "guard", "diverged", "divergence", "audit", "alive", "alive_peak", "dead_bytes",
                 "finalizers")

    def __init__(self, rt: SwapRuntime):
        self.rt = rt
        self.backend = rt.backend
        self.records: list[_Record] = []
        self.static = rt.static_bytes
        self.used = 0
        self.peak = 0
        self.stall_s = 0.0
        self.evicted = self.prefetched = self.on_demand = 0
        self.copies = self.waits = 0
        self.guard = 0
        self.diverged = False
        self.divergence: Divergence | None = None
        # every finalizer this step puts on a storage: detached when the step ends, so a storage
        # that outlives many steps (the caller's batch) does not collect one per step
        self.finalizers: list[weakref.finalize] = []
        # the audit meter: bytes of the saved storages alive now, kept by finalizers on the storages
        # themselves, so it sees what really holds memory whoever keeps it (never our accounting)
        self.audit = rt.audit and self.backend.emulated
        self.alive = self.alive_peak = 0
        # finalizers may run on a copy thread (the CPU backend drops a source there): they only
        # append here, and the step's thread does the arithmetic
        self.dead_bytes: deque[int] = deque()
        self.backend.reset_peak()

    def _account(self, delta: int) -> None:
        self.used += delta
        if self.static + self.used > self.peak:
            self.peak = self.static + self.used

    def _watch(self, storage: Any, nbytes: int) -> None:
        """Audit: count ``storage`` as alive until it dies."""
        dead = self.dead_bytes
        while dead:
            self.alive -= dead.popleft()
        self.alive += nbytes
        if self.alive > self.alive_peak:
            self.alive_peak = self.alive
        self._on_death(storage, dead.append, nbytes)

    def measured_peak(self) -> int | None:
        if not self.rt.audit:
            return None
        return self.rt.static_bytes + self.alive_peak if self.audit else self.backend.peak_bytes()

    @staticmethod
    def _rebuild(p: _Packed, flat: torch.Tensor) -> torch.Tensor:
        dtype, size, stride, offset, conj, neg = p.geometry
        out = torch.empty(0, dtype=dtype, device=flat.device).set_(flat.untyped_storage(), offset, size, stride)
        if neg:
            out = torch._neg_view(out)
        return out.conj() if conj else out

    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        self.records.clear()
        self._drop_finalizers()

    def _on_death(self, storage: Any, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` when ``storage`` dies during this step."""
        self.finalizers.append(weakref.finalize(storage, fn, *args))

    def _drop_finalizers(self) -> None:
        for f in self.finalizers:
            f.detach()
        self.finalizers.clear()

    def report(self, step_s: float) -> StepReport:
        raise NotImplementedError


class _ProfileStep(_StepExecution):
    """Step 1: record the trace; every saved tensor goes to the host at once and comes back on
    demand, synchronously inside the hook (the recorder excludes hook time from the gaps).

    It also finds the saved storages the runtime does not own: at the end of the step, a storage
    that is still alive although autograd dropped every handle to it is held by someone else (the
    caller's batch or output, a module buffer). Evicting it would free nothing, so the trace leaves
    it out and counts its bytes as static. A graph kept with ``retain_graph`` keeps its handles, so
    its storages are not judged."""

    __slots__ = ("ids", "recorder", "trace", "moved", "device", "owners", "cast_keys", "cast_bytes", "released",
                 "freed", "unpacked", "devices", "param_keys", "passes", "modules", "checkpoint_packs", "recomputes",
                 "new_shape", "seen_before")

    def __init__(self, rt: SwapRuntime, since: tuple[float, int] | None = None):
        super().__init__(rt)
        clock = self.backend.device_type  # the host clock, or events on the device's stream
        self.ids = StorageIds()  # live storage -> its record (R2)
        # with the model: each saved tensor's module, from which the trace finds its blocks (R9)
        self.modules = ModulePath(rt.model).__enter__() if rt.model is not None else None
        self.recorder = TraceRecorder(clock, modules=self.modules)
        # R9: id of each pack handle a block's checkpoint made (of its inputs) -> the block, and
        # (hook call, block) for each unpack of one: where backward recomputes the block
        self.checkpoint_packs: dict[int, str] = {}
        self.recomputes: list[tuple[int, str]] = []
        if rt.blocks is not None and rt.blocks.names:
            # what each recompute really holds, measured from inside it (storages of ours and of
            # the model's parameters and buffers are not new memory)
            static = {storage_key(x) for x in (*rt.model.parameters(), *rt.model.buffers())}
            rt.blocks.metered, rt.blocks.rebuilt_peak = True, {}
            rt.blocks.known = lambda key: key in static or key in self.ids
        # since: an executing step handed its hooks over (a shape not planned for) at this host
        # time, having seen this many storages first: the recording starts there
        self.recorder.start(since[0] if since else None)
        self.new_shape = since is not None
        self.seen_before = since[1] if since else 0
        self.trace: Trace | None = None
        self.moved = 0
        self.device = self.backend.device_type
        # trace id (order of first sight) -> (storage, handles autograd holds, bytes, key), all weak
        self.owners: dict[int, tuple[weakref.ref[Any], list[weakref.ref[_Packed]], int, int]] = {}
        self.cast_keys: set[int] = set()
        self.cast_bytes = 0
        # trace id -> the hook call before which its storage died: here the runtime holds no device
        # copy, so that is when the program itself let go of it (R2's release)
        self.released: dict[int, int] = {}
        # trace id -> the hook call before which its last unpacked copy died: when autograd's node
        # that read it let go (R2's free)
        self.freed: dict[int, int] = {}
        self.unpacked: set[int] = set()
        self.devices: dict[int, torch.device] = {}
        self.param_keys: set[int] = set()  # parameters live through the step: no finalizer needed
        self.passes: set[int] = set()  # the autograd graph tasks (backward passes) that unpacked

    def pack(self, t: torch.Tensor) -> Any:
        # a storage first seen as a parameter's stays one, whatever view of it comes later (a
        # double backward saves a transpose of an unpacked, detached weight): the executed steps
        # tell parameters by their storage too
        tid = None if t.untyped_storage()._cdata in self.param_keys else self.recorder.pack(t)
        if tid is None:
            self.param_keys.add(t.untyped_storage()._cdata)
            if is_cached_cast(t):  # stays like its parameter; its bytes are counted once, as static
                st = t.untyped_storage()
                if st._cdata not in self.cast_keys:
                    self.cast_keys.add(st._cdata)
                    self.cast_bytes += st.nbytes()
            # detached: the tensor itself would tie it to its own grad_fn in a reference cycle
            return ("keep", None, _Packed(None, t))
        st = t.untyped_storage()
        if st.nbytes() < self.rt.min_bytes:
            p = _Packed(None, t)
            self._own(tid, st, p)
            return ("keep", tid, p)
        rec = self.ids.get(t)
        if rec is None:
            flat = self._flat(t)
            rec = _Record(tid, flat.numel(), host=self.backend.copy_out_now(flat), state=HOST)
            self.devices[tid] = t.device  # it comes back to the tensor's own device
            self.ids.add(t, rec)
            self.records.append(rec)
            self.moved += rec.nbytes
            self.recorder.hook_done()  # the copy was hook time, not compute
        p = _Packed(rec, t)
        p.let_go()  # the device copy may go: unpack rebuilds from the host
        self._own(tid, st, p)
        blocks = self.rt.blocks
        if blocks is not None and blocks.entering is not None:
            self.checkpoint_packs[id(p)] = blocks.entering  # p lives in autograd's graph until its unpack
        return ("host", tid, p)

    def _own(self, tid: int, st: Any, p: _Packed) -> None:
        entry = self.owners.get(tid)
        if entry is None:
            self.owners[tid] = (weakref.ref(st), [weakref.ref(p)], st.nbytes(), st._cdata)
            self._on_death(st, self._died, tid)
        else:
            entry[1].append(weakref.ref(p))

    def _died(self, tid: int) -> None:
        """The packed storage died: before its first unpack the program let go of it (it was on
        the host already); after, autograd did (a kept tensor)."""
        if tid in self.unpacked:
            self._freed(tid)
        else:
            self.released.setdefault(tid, len(self.recorder.kinds))

    def _freed(self, tid: int) -> None:
        self.freed[tid] = max(self.freed.get(tid, 0), len(self.recorder.kinds))

    def unpack(self, packed: Any) -> torch.Tensor:
        kind, tid, p = packed
        p.check_version()
        self.passes.add(_graph_task_id())  # one id per backward pass
        self.recorder.unpack(tid)
        if tid is not None:
            self.unpacked.add(tid)
            block = self.checkpoint_packs.get(id(p))
            if block is not None:
                self.recomputes.append((len(self.recorder.kinds) - 1, block))
        if kind == "keep":
            return p.tensor
        out = self._rebuild(p, self.backend.copy_in_now(p.rec.host, self.devices[p.rec.tid]))
        self._on_death(out.untyped_storage(), self._freed, tid)
        # a backward that records a graph (double backward) may save what it unpacked: the copy
        # is the same saved tensor (R2), as an executed step, which unpacks the storage itself, sees it
        self.recorder.ids.add(out, tid)
        self.ids.add(out, p.rec)
        self.recorder.hook_done()
        return out

    def unowned(self) -> dict[int, int]:
        """Trace id -> bytes of the storages alive though autograd let go of every handle."""
        out = {}
        for tid, (st, handles, nbytes, key) in self.owners.items():
            if st() is not None and all(h() is None for h in handles):
                out[tid] = 0 if key in self.rt._static_keys else nbytes  # a buffer is static already
        return out

    def finish(self) -> None:
        unowned = self.unowned()
        static = self.rt.static_bytes + self.cast_bytes + sum(unowned.values())
        if "unpack" not in self.recorder.kinds:  # a step without backward: no trace to learn from
            self.abort()
            return
        self.trace = self.recorder.finish(f"runtime-step-{self.rt.steps}", self.device, static, "measured",
                                          exclude=frozenset(unowned), released=dict(self.released),
                                          freed=dict(self.freed))
        self.trace = replace(self.trace, events=self._with_rebuilt(self.trace),
                             meta={**self.trace.meta, "unowned_bytes": static - self.rt.static_bytes,
                                   "unowned_tensors": len(unowned), "backward_passes": len(self.passes)})
        self.rt.first_sight = {k + self.seen_before: v for k, v in self.recorder.remap.items()}
        self.abort()

    def _with_rebuilt(self, trace: Trace) -> tuple[Any, ...]:
        """R9: the trace's events, with what each recompute rebuilds counted in the gap after the
        unpack of the block's inputs (the recompute and the block's backward run in it; the
        checkpoint holds the members there, outside the runtime's hooks)."""
        events = list(trace.events)
        index = self.recorder.event_index
        measured = self.rt.blocks.rebuilt_peak if self.rt.blocks is not None else {}
        for call, block in self.recomputes:
            j = index[call + 1]  # the event whose gap follows that hook call
            if j < len(events):
                # what the recompute was measured to hold (its members and transients), else the
                # members' bytes by the trace it was planned on
                rebuilt = measured.get(block, self.rt._rebuilt.get(block, 0))
                e = events[j]
                events[j] = replace(e, other_bytes=(e.other_bytes or 0) + rebuilt)
        return tuple(events)

    def abort(self) -> None:
        if self.modules is not None:
            self.modules.__exit__()
            self.modules = None
        if self.rt.blocks is not None:
            self.rt.blocks.metered, self.rt.blocks.known = False, None
        for rec in self.records:  # every copy here was synchronous: the buffers are free to reuse
            if rec.host is not None:
                self.backend.pool.give(rec.host)
                rec.host = None
        self.records.clear()
        self.ids.clear()
        self.recorder.ids.clear()
        self.owners.clear()
        self._drop_finalizers()

    def report(self, step_s: float) -> StepReport:
        unowned = int(self.trace.meta.get("unowned_bytes", 0)) if self.trace is not None else 0
        return StepReport(
            step=self.rt.steps, mode="profile", step_s=step_s, stall_s=0.0, predicted_step_s=None,
            evicted_bytes=self.moved, prefetched_bytes=0, on_demand_bytes=self.moved,
            peak_device_bytes=None, budget_bytes=None, plan_followed=True, guard_evictions=0, kept_small=0,
            unowned_bytes=unowned, nothing_saved=not self.recorder.kinds,
            recomputed_blocks=self.rt.blocks.names if self.rt.blocks is not None else (), new_shape=self.new_shape,
        )


class _ExecuteStep(_StepExecution):
    """Steps 2..: execute the plan event by event (R4-R7).

    The accounting is the memory really held, not the plan's view of it: a saved storage (and a
    swap-in buffer) counts from its first pack (its allocation) until a finalizer on the storage
    says it died. So an evicted tensor leaves the budget only once its swap-out completed *and* the
    program let go of it (R2's release), and a tensor last used at an unpack only once autograd's
    node that read it is done with it; until then, R4's waits and the guard see it."""

    __slots__ = ("layout", "trace", "budget", "room", "out_at", "prefetch_at", "tensor_bytes", "frees", "expected",
                 "work", "keys", "by_tid", "i", "outs", "waiting", "ins", "n_seen", "first_sight", "gaps", "hook_s",
                 "last_exit", "tail_s", "deaths", "alloc", "other", "marks_in", "marks_out", "mark_start", "mark_end",
                 "scale", "profile", "started")

    def __init__(self, rt: SwapRuntime):
        super().__init__(rt)
        assert rt.layout is not None and rt.budget_bytes is not None
        self.budget = rt.budget_bytes
        self._load(rt.layout)
        # after a divergence: the largest ratio seen of a tensor's bytes to the trace's, by which
        # R4 scales the trace's next allocation (a batch of another size is one family, scaled)
        self.scale = 1.0
        # a step whose first saved tensor shows a shape no plan was made for is profiled instead
        # (it hands every hook call to this profiling step), and that shape is planned after it
        self.profile: _ProfileStep | None = None
        self.started = time.perf_counter()
        # live storage key -> record. A resident record's handles keep its storage alive; an
        # evicted one gets a weakref.finalize as the runtime lets go of it, and a freed one is
        # forgotten at its last use, so no key ever outlives its storage (R2; see StorageIds).
        # Parameters (and storages the trace does not track) map to _UNTRACKED for the step.
        self.keys: dict[int, _Record] = {}
        self.by_tid: dict[int, _Record] = {}
        self.i = 0
        self.outs: deque[_Record] = deque()  # swap-outs in flight, in issue order
        self.waiting: deque[_Record] = deque()  # prefetches waiting for room (R6)
        self.ins: list[_Record] = []
        # bytes of device storages of ours that died: finalizers append (maybe on a copy thread),
        # the step's thread subtracts them from the accounting
        self.deaths: deque[int] = deque()
        self.n_seen = 0
        # host clock per trace event: the compute gap before its hook, and the time in the hooks
        # (waits included; ``finish`` takes the stalls out). Meaningful on the CPU backend, where
        # compute is synchronous; the runtime re-times its trace from them (see SwapRuntime).
        self.gaps: list[float] = []
        self.hook_s = 0.0
        self.last_exit = time.perf_counter()
        self.tail_s = 0.0
        # on a real device, for the steps the runtime re-times its trace from: a mark in the
        # compute order as each hook starts and ends (CUDA timing events), read after the step
        # (R1's gaps as the device ran them, where the profiling steps' synchronous copies
        # stretched them). Entries are by event index: a hook that returns early (a parameter)
        # is overwritten by the event's own hook. None: not timed on the device.
        self.marks_in: list[Any] | None = None
        self.marks_out: list[Any] = []
        self.mark_start = self.mark_end = None
        if rt._device_timed_step():
            self.marks_in = [None] * self.trace.n_events
            self.mark_start = self.backend.mark()
        if self.audit and rt.blocks is not None and rt.blocks.names:
            # the audit meter also sees what recomputes make (R9): storages of ours, and the model's
            # parameters and buffers, are counted already or are static
            static = {storage_key(x) for x in (*rt.model.parameters(), *rt.model.buffers())}
            rt.blocks.metered, rt.blocks.watch = True, self._watch
            rt.blocks.known = lambda key: key in self.keys or key in static

    def _load(self, layout: PlanLayout) -> None:
        """Follow ``layout`` (at the step's start, or at its first saved tensor: another shape's)."""
        self.layout = layout
        self.trace = tr = layout.trace
        self.static = tr.static_bytes  # the model's, plus what the profiling found held by others
        self.room = self.budget - self.static  # for saved tensors
        self.out_at, self.prefetch_at = layout.out_at, layout.prefetch_at
        tb = event_tables(tr)  # the simulator's per-trace lists, shared
        self.tensor_bytes = tb.bytes
        self.frees = tb.free  # tensors whose last unpack is each event
        self.alloc = tb.alloc_bytes  # bytes of the tensors first packed at each event (made in its gap)
        # non-saved bytes live in each gap (R3): here what a recompute rebuilds, held by the
        # checkpoint where backward runs the block (R9; see _ProfileStep._with_rebuilt)
        self.other = tb.other
        # the hooks' hot path reads two flat lists: the expected event (tensor id for a pack, its
        # complement ~id for an unpack) and whether anything happens after it (a free, a planned
        # swap-out or prefetch). Diverging empties both, which turns every later check off.
        self.expected: list[int] | tuple[()] = layout.expected_codes
        self.work: list[bool] | tuple[()] = layout.work_at
        self.first_sight = layout.first_sight

    def _first_tensor(self, nbytes: int) -> bool:
        """The step's first saved tensor has ``nbytes`` where this layout expects other bytes: take
        the plan of the shape that has them, or profile this step. False when profiling."""
        layout = self.rt.layouts.get(nbytes) or self.rt._predicted_layout(self.layout, nbytes)
        # the same storage, in order of first sight, must be that shape's first event as well
        if layout is not None and layout.first_sight.get(self.n_seen, -1) == layout.trace.events[0].tensor:
            self._load(layout)
            if self.marks_in is not None:
                self.marks_in = [None] * self.trace.n_events
            return True
        self.profile = _ProfileStep(self.rt, since=(self.started, self.n_seen))
        return False

    # ------------------------------------------------------------------ memory (R4, R6)
    def _count_deaths(self) -> None:
        """Take the storages that died since the last look out of the accounting."""
        deaths = self.deaths
        while deaths:
            self.used -= deaths.popleft()

    def _drain(self) -> None:
        self._count_deaths()
        while self.outs and self.backend.done(self.outs[0].out):
            self._retire_out(self.outs.popleft())
        if self.waiting:
            self._admit()

    def _retire_out(self, rec: _Record) -> None:
        t = rec.out
        if t.error is not None:
            raise CopyError(f"swap-out of tensor {rec.tid} ({format_bytes(rec.nbytes)}) failed: {t.error}") from t.error
        t.src = None  # complete, or compute waits for it: the device storage may go (see backends.py)
        if rec.state == OUT:
            rec.state = HOST
        # no accounting here: the bytes go when the storage dies (see _ExecuteStep's docstring)

    def _admit(self) -> None:
        room = self.budget - self.static
        while self.waiting and self.used + self.waiting[0].nbytes <= room:
            rec = self.waiting.popleft()
            self._start_in(rec)
            self.prefetched += rec.nbytes

    def _start_in(self, rec: _Record) -> None:
        self._account(rec.nbytes)
        rec.inn = self.backend.copy_in(rec.host, rec.out)
        st = rec.inn.dst.untyped_storage()
        self._on_death(st, self.deaths.append, rec.nbytes)
        if self.audit:
            self._watch(st, rec.nbytes)
        self.copies += 1
        rec.state = IN
        self.ins.append(rec)

    def _room_for_next(self, need: int) -> None:
        """R4 before the gap: the next gap produces ``need`` bytes of new saved tensors (by the
        trace); compute waits here, while nothing of it exists yet, for room under the budget."""
        self._drain()
        if self.used + need > self.room:
            self._make_room(need, None)

    def _make_room(self, need: int, now_tid: int | None) -> None:
        # a diverged step makes room too: the plan no longer describes it, but the budget still
        # holds, by the swap-outs in flight and then the guard
        room = self.budget - self.static
        while self.used + need > room:
            if self.deaths:
                self._count_deaths()
                continue
            if self.outs:
                t0 = time.perf_counter()
                self.waits += not self.backend.done(self.outs[0].out)
                # the compute that follows waits for the swap-out, not the host (a stream wait on
                # CUDA, so the device's queue does not drain; its stall is timed on the device).
                # Dropping the source then is safe: only compute, queued after the wait, can reuse
                # its memory, and a swap-in of it waits for the swap-out on its own stream (R6)
                self._wait(self.outs[0], self.outs[0].out, use=True)
                self.stall_s += time.perf_counter() - t0
                self._retire_out(self.outs.popleft())
                continue
            if not self._guard_evict(now_tid):
                return  # nothing left to move: over budget, reported, never a crash

    def _guard_evict(self, now_tid: int | None) -> bool:
        """MIN rule on the spot: evict the tensor on the device whose next use is farthest. That
        may be one prefetched too early (IN): its host copy is still whole, so it goes back to
        HOST with no copy, once its swap-in has landed."""
        fu = self.trace.first_unpack
        cands = [r for r in self.records if r.tid != now_tid and r.nbytes >= self.rt.min_bytes and fu[r.tid] > self.i
                 and ((r.state == RESIDENT and (r.flat is not None or any(h.tensor is not None for h in r.live_handles())))
                      or (r.state == IN and r.host is not None))]
        if not cands:
            return False
        rec = max(cands, key=lambda r: fu[r.tid])
        if rec.state == IN:
            self._undo_in(rec)
        else:
            self._issue_out(rec)
        self.guard += 1
        return True

    def _undo_in(self, rec: _Record) -> None:
        """Take back a prefetch not yet used: wait for its copy (the ticket holds the device
        buffer until then), then drop the ticket, the buffer's one owner, so it dies and its
        finalizer takes its bytes out of the accounting (see _start_in)."""
        assert rec.inn is not None and rec.host is not None
        t0 = time.perf_counter()
        self._wait(rec, rec.inn)
        self.stall_s += time.perf_counter() - t0
        rec.inn = None
        rec.state = HOST
        self.ins.remove(rec)
        self._count_deaths()

    def _issue_out(self, rec: _Record) -> None:
        flat = rec.flat
        if flat is None:
            flat = self._flat(next(h.tensor for h in rec.live_handles() if h.tensor is not None))
        # from now on nothing of ours but the ticket keeps the storage alive: forget its key when it dies
        self._on_death(flat.untyped_storage(), self.keys.pop, rec.key, None)
        rec.out = self.backend.copy_out(flat)
        self.copies += 1
        rec.host = rec.out.dst
        rec.state = OUT
        # the ticket now holds the device storage until the copy completes; the stashes let go
        rec.flat = None
        for h in rec.live_handles():
            h.let_go()
        self.outs.append(rec)
        self.evicted += rec.nbytes

    # ------------------------------------------------------------------ hooks
    def _diverge(self, seen: str) -> None:
        """The step's events left the trace at event ``self.i`` (it did ``seen``): nothing more is
        planned, and what is evicted comes back on demand."""
        if self.divergence is None:
            i, ex = self.i, self.expected
            if i >= len(ex):
                expected = "the end of the step"
            elif ex[i] >= 0:
                expected = f"pack of tensor {ex[i]} ({format_bytes(int(self.tensor_bytes[ex[i]]))})"
            else:
                expected = f"unpack of tensor {~ex[i]}"
            self.divergence = Divergence(i, expected, seen)
            if self.rt.strict:
                raise DivergenceError(f"step {self.rt.steps} {self.divergence} (SwapRuntime(strict=True))")
        self.diverged = True
        # no more planned work; R4 keeps making room before each gap, from the trace's next
        # allocation scaled by what this step's tensors weigh against the trace's (self.scale)
        self.expected = self.work = ()
        self.waiting.clear()

    def pack(self, t: torch.Tensor) -> Any:
        # the hot path: every saved tensor of the step passes here, so lookups come first and
        # each rarer case costs only the branch that needs it
        if self.profile is not None:
            return self.profile.pack(t)
        t_in = time.perf_counter()
        if self.marks_in is not None and self.i < len(self.marks_in):
            self.marks_in[self.i] = self.backend.mark()
        st = t.untyped_storage()
        key = st._cdata
        rec = self.keys.get(key)
        i = self.i
        if rec is None:
            if is_parameter(t):  # parameters stay (counted in static_bytes), and get no trace id
                self.keys[key] = _UNTRACKED
                return _Packed(None, t)
            nbytes = st.nbytes()
            if self.audit:
                self._watch(st, nbytes)
            # ids in order of first sight, as the profiling step numbered them; a storage the
            # trace does not have (never unpacked there) is not tracked and just stays
            tid = self.first_sight.get(self.n_seen, -1)
            if i == 0 and tid >= 0 and self.tensor_bytes[tid] != nbytes:
                if not self._first_tensor(nbytes):  # a new shape: this step profiles it
                    return self.profile.pack(t)
                tid = self.first_sight.get(self.n_seen, -1)
            self.n_seen += 1
            if tid < 0:
                self.keys[key] = _UNTRACKED
                self._on_death(st, self.keys.pop, key, None)
                return _Packed(None, t)
            rec = _Record(tid, nbytes, key)
            self.keys[key] = rec
            self.records.append(rec)
            self.by_tid[tid] = rec
            ex = self.expected
            if i >= len(ex) or ex[i] != tid or self.tensor_bytes[tid] != nbytes:
                self._diverge(f"pack of tensor {tid} ({format_bytes(nbytes)})")
                self.scale = max(self.scale, nbytes / max(int(self.tensor_bytes[tid]), 1))
            # it is already made: counted before anything else moves, so an overshoot shows in the
            # peak, and so the drain below cannot admit a waiting prefetch (R6) into the room that
            # R4 made for this tensor before its gap (_room_for_next); _make_room only catches what
            # that missed
            if self.deaths:
                self._count_deaths()
            self.used += nbytes
            self._on_death(st, self.deaths.append, nbytes)
            if self.static + self.used > self.peak:
                self.peak = self.static + self.used
            if self.outs:
                self._drain()
            if self.used > self.room:
                self._make_room(0, tid)
        elif rec is _UNTRACKED:
            return _Packed(None, t)
        else:
            ex = self.expected
            if i >= len(ex) or ex[i] != rec.tid:
                self._diverge(f"pack of tensor {rec.tid} again")
        p = _Packed(rec, t)  # holds a detached alias (see _Packed)
        if rec.state != RESIDENT:
            p.let_go()  # evicted earlier in the step: rebuilt on unpack
        rec.handles.append(weakref.ref(p))
        self._end_event(i, t_in)
        return p

    def unpack(self, p: _Packed) -> torch.Tensor:
        if self.profile is not None and not isinstance(p, _Packed):
            return self.profile.unpack(p)
        t_in = time.perf_counter()
        if self.marks_in is not None and self.i < len(self.marks_in):
            self.marks_in[self.i] = self.backend.mark()
        p.check_version()
        rec = p.rec
        if rec is None:
            return p.tensor
        i = self.i
        ex = self.expected
        if i >= len(ex) or ex[i] != ~rec.tid:
            self._diverge(f"unpack of tensor {rec.tid}")
        out = p.tensor
        if out is None:  # evicted at some point (a handle holds its tensor only while resident)
            out = self._make_resident(p)
        self._end_event(i, t_in)
        return out

    def _end_event(self, i: int, t_in: float) -> None:
        """After event ``i``: the plan's work at it, room for the next event's tensor (R4, before
        its gap), and the hook's own time and the compute gap before it."""
        self.i = i + 1
        work = self.work
        if i < len(work) and work[i]:
            self._after_event(i)
        alloc = self.alloc
        if i + 1 < len(alloc):
            need = int(alloc[i + 1] * self.scale) + self.other[i + 1]
            if self.used + need > self.room:
                self._room_for_next(need)
            if self.other[i + 1] and self.static + self.used + self.other[i + 1] > self.peak:
                self.peak = self.static + self.used + self.other[i + 1]  # the rebuilt members, through the gap
        if self.marks_in is not None:
            self.marks_out.append(self.backend.mark())
        now = time.perf_counter()
        self.gaps.append(t_in - self.last_exit)  # the compute since the previous event's hook
        self.hook_s += now - t_in
        self.last_exit = now

    def _make_resident(self, p: _Packed) -> torch.Tensor:
        """(a) of an unpack whose tensor was evicted: wait for its prefetch, or bring it on demand."""
        rec = p.rec
        if self.outs or self.deaths:
            self._drain()
        # a freed tensor unpacked again (the step diverged) comes back from its host copy, which
        # stays until the step ends
        if rec.state in (OUT, HOST) or (rec.state == FREED and rec.host is not None):
            if rec in self.waiting:
                self.waiting.remove(rec)  # on demand goes ahead of prefetches waiting for room
            self._make_room(rec.nbytes, rec.tid)
            self._start_in(rec)
            self.on_demand += rec.nbytes
        if rec.state == IN:
            t0 = time.perf_counter()
            self.waits += not self.backend.done(rec.inn)
            self._wait(rec, rec.inn, use=True)
            self.stall_s += time.perf_counter() - t0
            if self.diverged:
                # no plan says when it is last used: the swap-in buffer lives only as long as
                # autograd holds what unpack returns (its finalizer takes the bytes out); an unpack
                # after that brings it back again from the host copy, which stays to the step's end
                buf, rec.inn, rec.state = rec.inn.dst, None, HOST
                return self._rebuild(p, buf)
            rec.flat = rec.inn.dst
            rec.state = RESIDENT
            # a backward that records a graph (double backward) may save what it unpacked: the
            # swap-in buffer is the same saved tensor (R2), as the profiling step numbered it
            st = rec.flat.untyped_storage()
            self.keys[st._cdata] = rec
            self._on_death(st, self.keys.pop, st._cdata, None)
        return self._rebuild(p, rec.flat)

    def _after_event(self, i: int) -> None:
        """(b)-(d) after event ``i``; called only for events with work (``self.work``)."""
        # (b) free what is last used here
        for tid in self.frees[i]:
            rec = self.by_tid[tid]
            # our own references go (the swap-in buffer is held by rec.flat and by the swap-in
            # ticket's dst); autograd drops its handles itself, which frees the storage here as
            # plain PyTorch would. A host copy stays until the step ends, in case an unplanned
            # unpack (divergence) needs it again.
            rec.flat = None
            rec.inn = None
            rec.state = FREED
            if self.keys.get(rec.key) is rec:
                del self.keys[rec.key]  # no pack of it may follow; its address may be reused
        # (c) swap-outs planned here
        for tid in self.out_at[i]:
            rec = self.by_tid.get(tid)
            if rec is not None and rec.state == RESIDENT:
                self._issue_out(rec)
        # (d) prefetches planned here, in issue order, waiting for room (R6)
        pf = self.prefetch_at[i]
        if pf:
            for tid in pf:
                rec = self.by_tid.get(tid)
                if rec is not None and rec.state in (OUT, HOST) and rec not in self.waiting:
                    self.waiting.append(rec)
            self._admit()

    # ------------------------------------------------------------------ end of step
    def finish(self) -> None:
        if self.profile is not None:
            self.profile.finish()
            return
        self.tail_s = time.perf_counter() - self.last_exit
        if self.marks_in is not None:
            self.mark_end = self.backend.mark()
        self.hook_s -= self.stall_s
        if not self.diverged and self.i != self.trace.n_events:
            self._diverge(f"the end of the step after {self.i} of {self.trace.n_events} events")
        self._settle()

    def abort(self) -> None:
        if self.profile is not None:
            self.profile.abort()
        self._settle()

    def _wait(self, rec: _Record, t: Ticket, use: bool = False) -> None:
        """Wait for one of ``rec``'s copies; a copy that failed or hung names its tensor."""
        try:
            (self.backend.wait_for_use if use else self.backend.wait_host)(t)
        except CopyError as exc:
            kind = "swap-out" if t is rec.out else "swap-in"
            raise CopyError(f"{kind} of tensor {rec.tid} ({format_bytes(rec.nbytes)}) {exc}") from exc

    def _settle(self) -> None:
        """Wait for every copy in flight, return host buffers to the pool, drop every stash.

        Never raises (it also runs while an exception unwinds the step). A copy that failed is
        complete, so its buffers may be reused; one that never completed may still write its host
        buffer, which is then dropped instead of pooled, and the backend starts fresh engines."""
        stuck: set[int] = set()
        pending = [(rec, rec.out) for rec in self.outs]
        pending += [(rec, rec.inn) for rec in self.ins if rec.inn is not None]  # None: released at its use
        for rec, t in pending:
            try:
                self.backend.wait_host(t)
            except CopyError:
                if not self.backend.done(t):
                    stuck.add(id(rec))
        if stuck:
            self.backend.recover()
        pool = self.backend.pool
        for rec in self.records:
            if rec.host is not None:
                (pool.discard if id(rec) in stuck else pool.give)(rec.host)
                rec.host = None
            rec.flat = None
            rec.out = rec.inn = None
            for h in rec.live_handles():
                h.let_go()
        self.outs.clear()
        self.waiting.clear()
        self.ins.clear()
        self.records.clear()
        self.keys.clear()
        self.by_tid.clear()
        self._count_deaths()  # what died since the last hook (a storage still alive stays counted)
        self._drop_finalizers()
        if self.rt.blocks is not None:
            self.rt.blocks.metered, self.rt.blocks.watch, self.rt.blocks.known = False, None, None

    def _device_gaps(self) -> tuple[tuple[float, ...] | None, float | None]:
        """Each gap and the tail from the device's marks (the step has synchronized), or None."""
        ins, outs, n = self.marks_in, self.marks_out, self.trace.n_events
        if ins is None or self.diverged or self.mark_end is None or len(outs) != n or any(m is None for m in ins):
            return None, None
        elapsed = self.backend.elapsed_s
        before = [self.mark_start, *outs[:-1]]
        return tuple(max(elapsed(a, b), 0.0) for a, b in zip(before, ins, strict=True)), elapsed(outs[-1], self.mark_end)

    def report(self, step_s: float) -> StepReport:
        if self.profile is not None:
            return self.profile.report(step_s)
        cuda_peak = self.backend.peak_bytes()
        # host-clock gaps mean compute only where compute is synchronous, and only for a whole step
        timed = self.backend.emulated and not self.diverged and len(self.gaps) == self.trace.n_events
        gaps, tail = (tuple(self.gaps), self.tail_s) if timed else self._device_gaps()
        return StepReport(
            step=self.rt.steps, mode="diverged" if self.diverged else "execute", step_s=step_s,
            stall_s=self.stall_s + self.backend.take_device_stall_s(),  # CUDA: compute's waits on the device
            predicted_step_s=self.layout.predicted_s, evicted_bytes=self.evicted, prefetched_bytes=self.prefetched,
            on_demand_bytes=self.on_demand, peak_device_bytes=self.peak, budget_bytes=self.budget,
            # followed, and within budget: the guard may find nothing to evict (a tensor read again
            # by a later backward pass after its first unpack stays), which leaves the peak over
            plan_followed=not self.diverged and self.guard == 0 and self.peak <= self.budget,
            divergence=self.divergence,
            guard_evictions=self.guard, kept_small=int(self.rt.plan.meta.get("kept_small", 0)), cuda_peak_bytes=cuda_peak,
            hook_s=self.hook_s, copies=self.copies, waits=self.waits,
            gaps_s=gaps, tail_s=tail,
            measured_peak_bytes=self.measured_peak(), unowned_bytes=int(self.trace.meta.get("unowned_bytes", 0)),
            recomputed_blocks=self.rt.blocks.names if self.rt.blocks is not None else (),
            shape_predicted=self.layout.predicted, plain_step_s=self.trace.ideal_s,
        )
