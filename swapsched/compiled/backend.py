"""``PlannedBackend``: a ``torch.compile`` backend whose graphs execute a policy's plans (R10).

For each graph Dynamo hands it, AOTAutograd builds the joint forward-backward graph, and the
partitioner this backend installs:

1. partitions it as torch would (``min_cut_rematerialization_partition``);
2. reads that partition as a Trace (:mod:`graph_trace`), timed for the hardware as the compiled
   executor pays (``Hardware.for_executor("compiled")``: no hook costs, one transfer stream);
3. has the policy plan it under the graph's share of the budget, and simulates the plan;
4. tags the joint graph with the plan and partitions it again with torch's activation
   offloading on, then puts each copy at the plan's events (:mod:`lowering`).

The inner compiler (Inductor, or ``aot_eager``) then compiles the lowered graphs as usual.

**The budget across graphs** is the step's (:mod:`step_budget`): graphs are planned in the order
they run, each under what the step's budget leaves after the earlier forward runs' held bytes. A
graph that cannot meet that share gets its smallest feasible budget, and the earlier graphs are
replanned to hold less after their forward (each at its next call, which compiles it again); the
step is refused only where no split fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from swapsched.budget import BudgetError, check_budget, format_bytes
from swapsched.compiled.graph_trace import (
    GraphTrace,
    cloneable_getitems,
    graph_trace,
    merge_chains,
    rebasable_views,
    recomputable_held,
    saved_nodes,
)
from swapsched.compiled.lowering import (
    Lowered,
    clone_getitems,
    kept_clones,
    lowered_decisions,
    place_copies,
    rebase_views,
    tag_joint,
    unclone,
)
from swapsched.compiled.step_budget import (
    GraphMemory,
    activation_budget,
    graph_memory,
    is_relative,
    smallest_step,
    step_peak,
    with_nested,
)
from swapsched.env.simulator import simulate
from swapsched.errors import UserError
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.policy import Policy
from swapsched.trace import Trace

__all__ = ["PlannedBackend", "GraphReport", "StepShare", "CompileReport", "INNER_COMPILERS", "QUICK_ABOVE", "check_torch"]

#: inductor: Inductor compiles the lowered graphs; aot_eager: they run as traced (debugging);
#: aot_eager_decomp: as traced, after Inductor's decompositions (the graphs Inductor would
#: partition, runnable on meta: what the benches trace big models with, as torch's own
#: ``aot_eager_decomp_partition`` backend does)
INNER_COMPILERS = ("inductor", "aot_eager", "aot_eager_decomp")
#: Above this many saved tensors a graph is planned by the backend's quick policy where it has one
#: (``default``'s search grows past 0.9 s there, and a compile waits for it)
QUICK_ABOVE = 500
#: Rounds of rebasing saved views onto their bases (R10): pinning the bases can make the
#: partitioner save other views, rebased in the next round
REBASE_ROUNDS = 3


def check_torch() -> None:
    """Raise a :class:`UserError` naming the version needed where torch lacks compile-time
    activation offloading (``torch._functorch._activation_offloading``, torch 2.10 and later)."""
    try:
        import torch._functorch._activation_offloading.activation_offloading  # noqa: F401
        from torch._functorch import config as functorch_config

        functorch_config.enable_activation_offloading  # noqa: B018
    except (ImportError, AttributeError) as exc:
        raise UserError(f"swapsched's compiled executor needs torch's compile-time activation offloading "
                        f"(torch >= 2.10); this torch is {torch.__version__}: upgrade torch, or use "
                        f"swapsched.SwapRuntime (saved-tensor hooks) instead") from exc


@dataclass(frozen=True)
class GraphReport:
    """One compiled graph as planned and lowered."""

    index: int
    saved: int
    saved_bytes: int
    held: int  # saved tensors torch cannot offload (views, getitems, ...): kept, never planned
    offloaded: int
    recomputed: int  # blocks recomputed whole or selectively
    budget_bytes: int
    budget_basis: str
    predicted_step_s: float
    ideal_s: float
    predicted_peak_bytes: int
    plan_s: float
    policy: str
    held_bytes: int  # bytes of the held tensors
    compiles: int  # 1, or 2 once a later graph of its step had it replanned
    lowered: Lowered = field(compare=False, repr=False)
    plan: SwapPlan = field(compare=False, repr=False)
    graph: GraphTrace = field(compare=False, repr=False)

    @property
    def predicted_overhead(self) -> float:
        return self.predicted_step_s / self.ideal_s - 1.0 if self.ideal_s > 0 else 0.0


@dataclass(frozen=True)
class StepShare:
    """The last training step as its graphs ran: each forward run's graph in order, and the
    step's budget and predicted peak over them (:mod:`step_budget`)."""

    runs: tuple[int, ...]
    budget_bytes: int  # whole-device bytes: the graphs' static bytes and the step's activation budget
    predicted_peak_bytes: int
    smallest_feasible_bytes: int

    @property
    def within(self) -> bool:
        return self.predicted_peak_bytes <= self.budget_bytes


@dataclass(frozen=True)
class CompileReport:
    """Every graph the backend compiled (its latest plan), the step they make, and how many
    plans were made. ``str()`` is a table."""

    graphs: tuple[GraphReport, ...]
    budget_spec: str | int | float
    hardware: str
    inner: str
    step: StepShare | None = None
    plans_made: int = 0
    plan_total_s: float = 0.0

    @property
    def held_bytes(self) -> int:
        return sum(g.held_bytes for g in self.graphs)

    def __str__(self) -> str:
        if not self.graphs:
            return "swapsched compiled: no graph compiled yet (run a step first)"
        head = (f"{'graph':>5} {'saved':>6} {'saved bytes':>12} {'held':>5} {'held bytes':>11} {'offload':>7} {'recomp':>6} "
                f"{'budget':>11} {'pred. peak':>11} {'pred. step':>11} {'over ideal':>10} {'plan s':>7}  planned by")
        rows = [head, "-" * len(head)]
        for g in self.graphs:
            rows.append(f"{g.index:>5} {g.saved:>6} {format_bytes(g.saved_bytes):>12} {g.held:>5} "
                        f"{format_bytes(g.held_bytes):>11} {g.offloaded:>7} "
                        f"{g.recomputed:>6} {format_bytes(g.budget_bytes):>11} {format_bytes(g.predicted_peak_bytes):>11} "
                        f"{g.predicted_step_s * 1e3:>9.3f}ms {g.predicted_overhead:>+9.1%} {g.plan_s:>7.3f}  {g.policy}")
        saved = sum(g.saved_bytes for g in self.graphs)
        rows.append(f"held by torch (not offloadable): {format_bytes(self.held_bytes)} of {format_bytes(saved)} saved")
        symbolic = [str(g.index) for g in self.graphs if g.graph.trace.meta.get("symbolic")]
        if symbolic:
            rows.append(f"graph(s) {', '.join(symbolic)}: dynamic shapes, planned at the sizes' hints (the sizes traced)")
        if self.step is not None:
            st = self.step
            rows.append(f"step: graphs {' -> '.join(map(str, st.runs))} forward; predicted peak "
                        f"{format_bytes(st.predicted_peak_bytes)} of {format_bytes(st.budget_bytes)} "
                        f"({'within' if st.within else 'OVER'}); smallest feasible {format_bytes(st.smallest_feasible_bytes)}")
        replanned = [str(g.index) for g in self.graphs if g.compiles > 1]
        if replanned:
            rows.append(f"graph(s) {', '.join(replanned)}: replanned for a later graph of the step, compiled again")
        rows.append(f"budget {self.budget_spec!r} of the step on {self.hardware}, inner compiler {self.inner}; "
                    f"{self.plans_made} plan(s) made in {self.plan_total_s:.2f} s")
        return "\n".join(rows)


class PlannedBackend:
    """A ``torch.compile`` backend (module docstring). ``policy`` is a policy object; for names,
    use :class:`swapsched.CompileBackend`."""

    def __init__(self, budget: str | int, policy: Policy, hardware: Hardware, *, inner: str = "inductor",
                 quick_policy: Policy | None = None):
        check_torch()
        if inner not in INNER_COMPILERS:
            raise UserError(f"inner compiler {inner!r} unknown; use one of {list(INNER_COMPILERS)}")
        if not isinstance(policy, Policy):
            raise UserError(f"policy must have plan(trace, budget, hardware), got {type(policy).__name__}")
        self.budget_spec = check_budget(budget)
        self.policy = policy
        # a graph of more than QUICK_ABOVE saved tensors, where the policy's search would take
        # longer than a compile should wait, is planned by this one (the learned parts' own plan)
        self.quick_policy = quick_policy
        self.hardware = hardware
        self.executed_hardware = hardware.for_executor("compiled")
        self.inner = inner
        self._graphs: dict[int, GraphReport] = {}  # each graph's latest plan
        self._memory: dict[int, GraphMemory] = {}
        self._compiled = 0
        self._plans_made = 0
        self._plan_total_s = 0.0
        # step order: the graphs whose forward ran (with grad) since a backward last ran, one
        # entry per run; and the last step's, for the report
        self._runs: list[int] = []
        self._last_step: tuple[int, ...] = ()
        # graphs a later graph of their step had replanned: the budget and plan for their next call
        self._replan: dict[int, tuple[int, SwapPlan]] = {}

    # ------------------------------------------------------------------ torch.compile's entry
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        index = self._compiled
        self._compiled += 1
        current = [self._compile(gm, example_inputs, _Partitioner(self, index))]

        def run(*args: Any) -> Any:
            if index in self._replan:
                # a later graph of the step needs room this graph's plan keeps: compile it again
                # with the plan made for it then (the same joint graph, so the same partition)
                budget, plan = self._replan.pop(index)
                current[0] = self._compile(gm, example_inputs, _Partitioner(self, index, budget=budget, plan=plan))
            if torch.is_grad_enabled():
                self._runs.append(index)
            out = current[0](*args)
            for t in _tensors(out):
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(self._backward_seen)
                    break
            return out
        return run

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], partition: _Partitioner) -> Callable[..., Any]:
        if self.inner == "inductor":
            from torch._functorch import config as functorch_config
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            # a cached artifact would skip the partitioner, and with it this graph's plan (or
            # bring back another run's): plan and compile afresh
            with inductor_config.patch(custom_partitioner_fn=partition, fx_graph_cache=False), \
                    functorch_config.patch(enable_autograd_cache=False):
                return compile_fx(gm, example_inputs)  # type: ignore[return-value]
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def nop(g: fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
            return make_boxed_func(g.forward)

        decompositions = None
        if self.inner == "aot_eager_decomp":
            from torch._inductor.decomposition import select_decomp_table

            decompositions = select_decomp_table()
        return aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition,  # type: ignore[no-any-return]
                            decompositions=decompositions)(gm, example_inputs)

    def _backward_seen(self, grad: torch.Tensor) -> None:
        if self._runs:
            self._last_step = tuple(self._runs)
        self._runs.clear()

    # ------------------------------------------------------------------ the step's budget
    def budget_for(self, trace: Trace, index: int) -> tuple[int, str]:
        """Graph ``index``'s budget in bytes, and how it was split (:mod:`step_budget`). Where the
        earlier runs of the step leave it less than its smallest feasible budget, the earlier
        graphs are replanned with what runs after them nested in their backward's first gap
        (installed at their next call, which compiles them again); :class:`BudgetError` where no
        split fits, naming the step's smallest feasible budget."""
        spec = self.budget_spec
        runs = [*self._runs, index]
        graphs = {**self._memory, index: graph_memory(trace)}
        traces = {**{i: g.graph.trace for i, g in self._graphs.items()}, index: trace}
        beta = activation_budget(spec, runs, graphs)
        basis = f"{spec} of the step's activation peak" if is_relative(spec) else "whole-device bytes"
        earlier = runs[:-1]
        need = graphs[index].min_peak
        avail = beta - sum(graphs[i].held for i in earlier)
        if avail >= need:
            return trace.static_bytes + avail, basis + (", less what the step's earlier graphs hold" if earlier else "")
        replans: dict[int, tuple[int, SwapPlan, GraphMemory]] = {}
        nested, made_room = need, False
        for p in reversed(range(len(earlier))):
            j = earlier[p]
            if j in replans or earlier.count(j) > 1:  # a graph run several times keeps its plan (DESIGN R10)
                nested += graphs[j].held
                continue
            tj = with_nested(traces[j], nested)
            budget_j = max(tj.static_bytes + beta - sum(graphs[i].held for i in earlier[:p]), tj.min_feasible_bytes)
            t0 = time.perf_counter()
            plan = self.planner_for(tj).plan(tj, budget_j, self.executed_hardware).validate(traces[j])
            oom = simulate(tj, plan, self.executed_hardware, budget_j).oom
            own = simulate(traces[j], plan, self.executed_hardware, budget_j)
            self._count_plan(time.perf_counter() - t0)
            if oom:
                break
            replans[j] = (budget_j, plan, graph_memory(traces[j], plan, own.peak_bytes))
            if budget_j - tj.static_bytes <= beta - sum(graphs[i].held for i in earlier[:p]):
                made_room = True  # j holds little enough with the rest nested: the runs before it keep theirs
                break
            nested = budget_j - tj.static_bytes  # j at its least: the runs before it make room for that
        if not made_room:
            least, worst = smallest_step(runs, traces)
            raise BudgetError(f"budget {spec!r} cannot hold the step's compiled graphs {' -> '.join(map(str, runs))}: "
                              f"the smallest feasible budget for the whole step is {format_bytes(least)} ({least} bytes); "
                              f"graph {worst} needs most ({format_bytes(traces[worst].min_feasible_bytes - traces[worst].static_bytes)}"
                              " of its own activations at the least)")
        for j, (budget_j, plan_j, new) in replans.items():
            self._replan[j] = (budget_j, plan_j)
            self._memory[j] = new
        avail = beta - sum(self._memory[i].held for i in earlier)
        return (trace.static_bytes + max(avail, need),
                basis + f", less what the step's earlier graphs hold (graph(s) {', '.join(map(str, replans))} replanned)")

    def planner_for(self, trace: Trace) -> Policy:
        """The policy that plans ``trace``: the quick one above ``QUICK_ABOVE`` saved tensors."""
        return self.quick_policy if self.quick_policy is not None and trace.n_tensors > QUICK_ABOVE else self.policy

    def _count_plan(self, seconds: float) -> None:
        self._plans_made += 1
        self._plan_total_s += seconds

    def record(self, report: GraphReport, memory: GraphMemory) -> None:
        self._graphs[report.index] = report
        self._memory[report.index] = memory

    def report(self) -> CompileReport:
        """Every graph compiled so far: what it saves, offloads and recomputes, and the
        simulator's prediction of its step and peak under its budget; and the last step over them."""
        step = None
        runs = self._last_step or tuple(self._runs)
        if runs and all(i in self._memory for i in runs):
            beta = activation_budget(self.budget_spec, runs, self._memory)
            statics = sum(self._memory[i].static for i in dict.fromkeys(runs))
            step = StepShare(runs, statics + beta, statics + step_peak(runs, self._memory),
                             smallest_step(runs, {i: g.graph.trace for i, g in self._graphs.items()})[0])
        graphs = tuple(self._graphs[i] for i in sorted(self._graphs))
        return CompileReport(graphs, self.budget_spec, self.hardware.name, self.inner, step, self._plans_made,
                             self._plan_total_s)


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _forward_names(joint: fx.GraphModule) -> frozenset[str]:
    """The joint graph's forward nodes (AOTAutograd tags each node forward or backward)."""
    from torch._functorch.partitioners import _has_tag_is_forward

    return frozenset(n.name for n in joint.graph.nodes if n.op == "call_function" and _has_tag_is_forward(n))


class _Partitioner(CustomPartitionerFn):
    """The partition function of one graph (module docstring, steps 1-4). ``budget`` and ``plan``:
    a replan's, made when a later graph of the step needed room (``PlannedBackend.budget_for``)."""

    def __init__(self, backend: PlannedBackend, index: int, *, budget: int | None = None, plan: SwapPlan | None = None):
        self.backend, self.index = backend, index
        self.budget, self.plan = budget, plan

    def uuid(self) -> None:  # Inductor's cache key for a custom partitioner: never cache a planned graph
        return None

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        joint = gm
        from torch._functorch import config as functorch_config
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        be = self.backend
        kwargs.setdefault("compiler", "inductor")
        n_out = kwargs["num_fwd_outputs"]
        static_idx = kwargs.get("static_lifetime_input_indices") or []
        placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
        static_names = [placeholders[i].name for i in static_idx]
        forward = _forward_names(joint)
        t0 = time.perf_counter()
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        # R10: a saved view's storage is offloadable once the partition saves its base instead
        # (and a non-contiguous one's, rebuilt from offloadable bases; and a getitem's, once the
        # partition saves a clone of it)
        rebase: dict[str, list[str]] = {}
        clones: dict[str, str] = {}
        for _ in range(REBASE_ROUNDS):  # a partition with bases pinned may save other views: rebase those too
            saved = {n.name for n in saved_nodes(fw, n_out)}
            items = cloneable_getitems(fw, n_out, forward)
            if items:
                made = clone_getitems(joint, items)
                clones.update(made)
                saved = (saved - set(items)) | set(made)
                forward = _forward_names(joint)
            found = rebasable_views(fw, n_out, forward)
            merge_chains(found, recomputable_held(fw, n_out, forward))
            if not merge_chains(rebase, found) and not items:
                break
            rebase_views(joint, rebase, saved, forward)
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        gt = graph_trace(fw, bw, n_out, be.executed_hardware, static_input_names=static_names,
                         name=f"compiled-graph-{self.index}", taggable=forward)
        gt = replace(gt, rebased=tuple(rebase))
        earlier = be._graphs.get(self.index)
        planned = True
        if self.budget is not None and self.plan is not None and earlier is not None \
                and _same_structure(earlier.graph.trace, gt.trace):  # the plan made when a later graph needed room
            budget, basis, plan, planned = self.budget, "replanned: a later graph of the step needed room", self.plan, False
        else:
            budget, basis = be.budget_for(gt.trace, self.index) if self.budget is None else (self.budget, "replanned")
            plan = be.planner_for(gt.trace).plan(gt.trace, budget, be.executed_hardware).validate(gt.trace)
        sim = simulate(gt.trace, plan, be.executed_hardware, budget)
        plan_s = time.perf_counter() - t0
        if planned:
            be._count_plan(plan_s)
        if sim.oom:
            raise BudgetError(f"policy {be.policy.name!r} made a plan for compiled graph {self.index} that does not fit "
                              f"{format_bytes(budget)} (out of memory at event {sim.oom_event}); try a larger budget or "
                              f"policy 'default'")
        kept = kept_clones(joint, gt, plan, clones)
        if kept:  # a clone the plan keeps would cost a copy for nothing
            unclone(joint, kept)
            gt = replace(gt, uncloned=kept)
        tag_joint(joint, gt, plan, forward)
        stream = torch.cuda.is_available() and any(isinstance(v, torch.Tensor) and v.is_cuda for v in joint_inputs)
        with functorch_config.patch(enable_activation_offloading=bool(plan.evictions),
                                    activation_offload_separate_stream=stream):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        if plan.evictions:
            place_copies(fw, bw, gt, plan)
        lowered = lowered_decisions(fw, bw, forward, n_out)
        held_bytes = int(gt.trace.meta["held_bytes"])
        saved_bytes = int(gt.trace.tensor_bytes.sum()) + held_bytes
        be.record(GraphReport(self.index, gt.trace.n_tensors + len(gt.held), saved_bytes, len(gt.held),
                              len(lowered.offloaded), len(plan.recompute) + len(plan.selective), budget, basis,
                              sim.iteration_s, sim.ideal_s, sim.peak_bytes, plan_s, plan.policy, held_bytes,
                              1 + (earlier is not None), lowered, plan, gt),
                  graph_memory(gt.trace, plan, sim.peak_bytes))
        return fw, bw


def _same_structure(a: Trace, b: Trace) -> bool:
    """The same partition of the same joint graph: a plan made on ``a`` holds on ``b``."""
    return (a.n_tensors == b.n_tensors and [(e.kind, e.tensor) for e in a.events] == [(e.kind, e.tensor) for e in b.events]
            and list(a.tensor_bytes) == list(b.tensor_bytes))
