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

**The budget across graphs.** A relative budget (``"60%"``) is resolved per graph against its
own activation peak, so every graph keeps at most that share. A byte budget is split in step
order: a graph compiled while others of the same step have run forward gets the budget less what
those still hold on the device at their forward's end (their static bytes and the saved tensors
their plans keep, as simulated), so the step as a whole stays within it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from swapsched.budget import BudgetError, check_budget, format_bytes, parse_budget
from swapsched.compiled.graph_trace import GraphTrace, graph_trace, rebasable_views, saved_nodes
from swapsched.compiled.lowering import Lowered, lowered_decisions, place_copies, rebase_views, tag_joint
from swapsched.env.simulator import simulate
from swapsched.errors import UserError
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.policy import Policy

__all__ = ["PlannedBackend", "GraphReport", "CompileReport", "INNER_COMPILERS", "check_torch"]

#: inductor: Inductor compiles the lowered graphs; aot_eager: they run as traced (debugging);
#: aot_eager_decomp: as traced, after Inductor's decompositions (the graphs Inductor would
#: partition, runnable on meta: what the benches trace big models with, as torch's own
#: ``aot_eager_decomp_partition`` backend does)
INNER_COMPILERS = ("inductor", "aot_eager", "aot_eager_decomp")


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
    lowered: Lowered = field(compare=False, repr=False)
    plan: SwapPlan = field(compare=False, repr=False)
    graph: GraphTrace = field(compare=False, repr=False)

    @property
    def predicted_overhead(self) -> float:
        return self.predicted_step_s / self.ideal_s - 1.0 if self.ideal_s > 0 else 0.0


@dataclass(frozen=True)
class CompileReport:
    """Every graph the backend compiled, in compile order. ``str()`` is a table."""

    graphs: tuple[GraphReport, ...]
    budget_spec: str | int | float
    hardware: str
    inner: str

    def __str__(self) -> str:
        if not self.graphs:
            return "swapsched compiled: no graph compiled yet (run a step first)"
        head = (f"{'graph':>5} {'saved':>6} {'saved bytes':>12} {'held':>5} {'offload':>7} {'recomp':>6} "
                f"{'budget':>11} {'pred. peak':>11} {'pred. step':>11} {'over ideal':>10} {'plan s':>7}")
        rows = [head, "-" * len(head)]
        for g in self.graphs:
            rows.append(f"{g.index:>5} {g.saved:>6} {format_bytes(g.saved_bytes):>12} {g.held:>5} {g.offloaded:>7} "
                        f"{g.recomputed:>6} {format_bytes(g.budget_bytes):>11} {format_bytes(g.predicted_peak_bytes):>11} "
                        f"{g.predicted_step_s * 1e3:>9.3f}ms {g.predicted_overhead:>+9.1%} {g.plan_s:>7.3f}")
        symbolic = [str(g.index) for g in self.graphs if g.graph.trace.meta.get("symbolic")]
        if symbolic:
            rows.append(f"graph(s) {', '.join(symbolic)}: dynamic shapes, planned at the sizes' hints (the sizes traced)")
        basis = {g.budget_basis for g in self.graphs}
        rows.append(f"budget {self.budget_spec!r} on {self.hardware}, inner compiler {self.inner}; "
                    f"split: {'; '.join(sorted(basis))}")
        return "\n".join(rows)


class PlannedBackend:
    """A ``torch.compile`` backend (module docstring). ``policy`` is a policy object; for names,
    use :class:`swapsched.CompileBackend`."""

    def __init__(self, budget: str | int, policy: Policy, hardware: Hardware, *, inner: str = "inductor"):
        check_torch()
        if inner not in INNER_COMPILERS:
            raise UserError(f"inner compiler {inner!r} unknown; use one of {list(INNER_COMPILERS)}")
        if not isinstance(policy, Policy):
            raise UserError(f"policy must have plan(trace, budget, hardware), got {type(policy).__name__}")
        self.budget_spec = check_budget(budget)
        self.policy = policy
        self.hardware = hardware
        self.executed_hardware = hardware.for_executor("compiled")
        self.inner = inner
        self._graphs: list[GraphReport] = []
        self._compiled = 0
        # step order (byte budgets): the graphs whose forward ran since a backward last ran, and
        # what each leaves on the device for the rest of the step
        self._forward_since_backward: list[int] = []
        self._held_after_forward: dict[int, int] = {}

    # ------------------------------------------------------------------ torch.compile's entry
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        index = self._compiled
        self._compiled += 1
        partition = _Partitioner(self, index)
        wrap = self._wrap_forward(index)
        if self.inner == "inductor":
            from torch._functorch import config as functorch_config
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            # a cached artifact would skip the partitioner, and with it this graph's plan (or
            # bring back another run's): plan and compile afresh
            with inductor_config.patch(custom_partitioner_fn=partition, fx_graph_cache=False), \
                    functorch_config.patch(enable_autograd_cache=False):
                compiled = compile_fx(gm, example_inputs)
        else:
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            def nop(g: fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
                return make_boxed_func(g.forward)

            decompositions = None
            if self.inner == "aot_eager_decomp":
                from torch._inductor.decomposition import select_decomp_table

                decompositions = select_decomp_table()
            compiled = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition,
                                    decompositions=decompositions)(gm, example_inputs)
        return wrap(compiled)  # type: ignore[arg-type]

    def _wrap_forward(self, index: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Note the graph's forward in step order; a backward (the gradient of any output) ends it."""
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any) -> Any:
                self._forward_since_backward.append(index)
                out = fn(*args)
                for t in _tensors(out):
                    if t.requires_grad and t.grad_fn is not None:
                        t.register_hook(self._backward_seen)
                        break
                return out
            run.__wrapped__ = fn  # type: ignore[attr-defined]
            return run
        return wrap

    def _backward_seen(self, grad: torch.Tensor) -> None:
        self._forward_since_backward.clear()

    # ------------------------------------------------------------------ planning one graph
    def budget_for(self, trace: Any, index: int) -> tuple[int, str]:
        """The graph's budget in bytes and how it was split (module docstring)."""
        spec = self.budget_spec
        if isinstance(spec, str) and spec.strip().endswith("%"):
            return parse_budget(spec, trace), f"{spec} of each graph's own activation peak"
        earlier = [i for i in dict.fromkeys(self._forward_since_backward) if i != index]
        held = sum(self._held_after_forward.get(i, 0) for i in earlier)
        total = parse_budget(spec)
        mine = total - held
        if mine < trace.min_feasible_bytes:
            need = trace.min_feasible_bytes + held
            raise BudgetError(f"budget {spec!r} = {format_bytes(total)} cannot hold compiled graph {index}: with "
                              f"{format_bytes(held)} held by the step's earlier graphs it needs at least "
                              f"{format_bytes(need)} ({need} bytes)")
        return mine, ("whole-device bytes, less what the step's earlier graphs hold" if earlier else "whole-device bytes")

    def record(self, report: GraphReport) -> None:
        self._graphs.append(report)
        # what stays on the device after this graph's forward, for the graphs after it (byte budgets)
        t = report.graph.trace
        kept = sum(t.tensors[k].bytes for k in range(t.n_tensors) if k not in report.plan.evicted)
        held = int(t.other_bytes[t.backward_start]) if t.backward_start < t.n_events else 0  # none saved: no event
        self._held_after_forward[report.index] = int(t.static_bytes + kept + held)

    def report(self) -> CompileReport:
        """Every graph compiled so far: what it saves, offloads and recomputes, and the
        simulator's prediction of its step and peak under its budget."""
        return CompileReport(tuple(self._graphs), self.budget_spec, self.hardware.name, self.inner)


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
    """The partition function of one graph (module docstring, steps 1-4)."""

    def __init__(self, backend: PlannedBackend, index: int):
        self.backend, self.index = backend, index

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
        rebase = rebasable_views(fw, n_out, forward)
        if rebase:
            rebase_views(joint, rebase, {n.name for n in saved_nodes(fw, n_out)}, forward)
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        gt = graph_trace(fw, bw, n_out, be.executed_hardware, static_input_names=static_names,
                         name=f"compiled-graph-{self.index}", taggable=forward)
        gt = replace(gt, rebased=tuple(rebase))
        budget, basis = be.budget_for(gt.trace, self.index)
        plan = be.policy.plan(gt.trace, budget, be.executed_hardware).validate(gt.trace)
        sim = simulate(gt.trace, plan, be.executed_hardware, budget)
        plan_s = time.perf_counter() - t0
        if sim.oom:
            raise BudgetError(f"policy {be.policy.name!r} made a plan for compiled graph {self.index} that does not fit "
                              f"{format_bytes(budget)} (out of memory at event {sim.oom_event}); try a larger budget or "
                              f"policy 'default'")
        tag_joint(joint, gt, plan, forward)
        stream = torch.cuda.is_available() and any(isinstance(v, torch.Tensor) and v.is_cuda for v in joint_inputs)
        with functorch_config.patch(enable_activation_offloading=bool(plan.evictions),
                                    activation_offload_separate_stream=stream):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        if plan.evictions:
            place_copies(fw, bw, gt, plan)
        lowered = lowered_decisions(fw, bw, forward, n_out)
        saved_bytes = int(gt.trace.tensor_bytes.sum()) + int(gt.trace.meta["held_bytes"])
        be.record(GraphReport(self.index, gt.trace.n_tensors + len(gt.held), saved_bytes, len(gt.held),
                              len(lowered.offloaded), len(plan.recompute) + len(plan.selective), budget, basis,
                              sim.iteration_s, sim.ideal_s, sim.peak_bytes, plan_s, be.policy.name, lowered, plan,
                              gt))
        return fw, bw

