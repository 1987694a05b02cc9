"""The runtime's records: where a step left its trace, each step's report and the run's
summary (``runtime.report()``, ``report().run``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from swapsched.budget import format_bytes

__all__ = ["CollectiveTally", "Divergence", "DivergenceError", "RunSummary", "StateStepReport", "StepReport"]


@dataclass(frozen=True)
class Divergence:
    """Where an executed step left its trace: the first event that did not match what the
    profiling steps recorded (a new batch shape, a data-dependent branch, a second backward)."""

    event: int  # index of the trace event where the step was expected to be
    expected: str  # what the trace has there, e.g. "pack of tensor 12 (4.00 MiB)", "the end of the step"
    seen: str  # what the step did instead

    def __str__(self) -> str:
        return f"at event {self.event} the trace expected {self.expected}, the step did {self.seen}"


class DivergenceError(RuntimeError):
    """``SwapRuntime(strict=True)``: an executed step left its trace (as ``torch.utils.checkpoint``
    raises ``CheckpointError`` when a recomputation differs)."""


@dataclass(frozen=True)
class RunSummary:
    """The run so far, beside the last step's report (``report().run``)."""

    steps: int
    profiled: int  # steps run under save_on_cpu semantics to record the trace
    executed: int  # steps that executed a plan to the end
    diverged: int  # steps that left the trace (finished on demand, profiled again)
    median_step_s: float | None  # over the executed steps (the last 1,000)
    # the profiled compute of one step without swapping (its trace's ideal), median over the same
    # executed steps: each step against its own shape's, where shapes vary
    plain_step_s: float | None
    moved_bytes: int  # every byte copied either way, profiling included
    # of the executed steps, the one whose peak came nearest its own budget: its peak, against its
    # budget (a relative budget is each shape's own: "60%" of that shape's activation peak)
    peak_device_bytes: int | None
    budget_bytes: int | None
    guard_evictions: int
    budget_spec: str | int | float | None = None
    median_overhead: float | None = None  # see ``overhead``
    shapes: int = 0  # shapes with a plan (steps of any of them execute it)
    new_shapes: int = 0  # of the profiled steps, those that profiled a shape no plan was made for, as it ran
    predicted_steps: int = 0  # of the executed steps, those on a shape predicted from its family, never profiled
    # the executed steps by the plan they ran (StepReport.plan_source): a new shape starts on a
    # borrowed or a learned plan, and runs on the policy's searched one once it is ready
    borrowed_steps: int = 0
    learned_steps: int = 0
    searched_steps: int = 0

    @property
    def overhead(self) -> float | None:
        """The median over executed steps of each one over its own shape's plain step, minus one."""
        return self.median_overhead

    def __str__(self) -> str:
        parts = [f"run: {self.steps} steps ({self.profiled} profiled, {self.executed} executed, {self.diverged} diverged)"]
        if self.median_step_s is not None:
            over = f", {100 * self.overhead:+.1f}% over the plain step" if self.overhead is not None else ""
            parts.append(f"median {1e3 * self.median_step_s:.2f} ms{over}")
        parts.append(f"moved {format_bytes(self.moved_bytes)}")
        if self.peak_device_bytes is not None and self.budget_bytes is not None:
            relative = isinstance(self.budget_spec, str) and self.budget_spec.strip().endswith("%")
            basis = f" ({self.budget_spec} of its shape's activation peak)" if relative else ""
            nearest = " at the step nearest its budget" if relative and self.shapes > 1 else ""
            parts.append(f"peak {format_bytes(self.peak_device_bytes)} of {format_bytes(self.budget_bytes)}{basis}{nearest}")
        if self.guard_evictions:
            parts.append(f"{self.guard_evictions} guard evictions")
        if self.shapes > 1:
            parts.append(f"plans for {self.shapes} shapes")
        if self.predicted_steps:
            parts.append(f"{self.predicted_steps} executed steps on predicted shapes")
        if self.borrowed_steps or self.learned_steps:
            parts.append(f"plans run: {self.borrowed_steps} borrowed, {self.learned_steps} learned, "
                         f"{self.searched_steps} searched")
        line = ", ".join(parts)
        # never save_on_cpu behaviour in silence: after the first plan, a step either executes a
        # plan, profiles a shape seen for the first time, or leaves its trace
        after = self.executed + self.new_shapes + self.diverged
        if after >= 4 and (self.new_shapes + self.diverged) * 2 > after:
            why = []
            if self.new_shapes:
                why.append(f"{self.new_shapes} profiled a shape seen for the first time (saved tensors of other sizes: "
                           "a batch padded to its own length)")
            if self.diverged:
                why.append(f"{self.diverged} left the profiled trace (other control flow or sizes after the first "
                           "saved tensor; each finished on demand and the next step profiled again)")
            line += (f"\nmost steps ran without a plan: of {after} after the first plan, " + "; ".join(why)
                     + ". Pad to a few fixed lengths (buckets) so that shapes repeat: each then runs its own plan")
        return line


class RunTally:
    """Running totals for :class:`RunSummary`: constant memory however long the run (the median is
    over the last ``window`` executed steps)."""

    def __init__(self, window: int = 1000):
        self.steps = self.profiled = self.executed = self.diverged = self.moved = self.guard = 0
        self.new_shapes = self.predicted_steps = 0
        self.by_source = {"borrowed": 0, "learned": 0, "searched": 0}
        self.peak: int | None = None
        self.peak_budget: int | None = None  # the budget of the step whose peak came nearest its own
        self.recent: deque[float] = deque(maxlen=window)
        self.plain: deque[float] = deque(maxlen=window)  # each of those steps' own plain step (its trace's)

    def add(self, rep: StepReport, *, budget_bytes: int | None, budget_spec: str | int | float, shapes: int) -> RunSummary:
        """The run so far, with ``rep``; the run's budget (``budget_spec``, in bytes for the
        current shape) and how many shapes have a plan."""
        self.steps += 1
        self.profiled += rep.mode == "profile"
        self.new_shapes += rep.new_shape
        self.predicted_steps += rep.shape_predicted and rep.mode == "execute"
        self.diverged += rep.mode == "diverged"
        self.moved += rep.evicted_bytes + rep.prefetched_bytes + rep.on_demand_bytes
        self.guard += rep.guard_evictions
        if rep.mode == "execute":
            self.executed += 1
            if rep.plan_source in self.by_source:
                self.by_source[rep.plan_source] += 1
            self.recent.append(rep.step_s)
            self.plain.append(rep.plain_step_s or 0.0)
            share = rep.peak_device_bytes / rep.budget_bytes if rep.peak_device_bytes is not None and rep.budget_bytes else None
            if share is not None and (self.peak is None or not self.peak_budget or share > self.peak / self.peak_budget):
                self.peak, self.peak_budget = rep.peak_device_bytes, rep.budget_bytes
        return RunSummary(
            steps=self.steps, profiled=self.profiled, executed=self.executed, diverged=self.diverged,
            median_step_s=float(np.median(self.recent)) if self.recent else None,
            plain_step_s=float(np.median(self.plain)) if self.plain else None, moved_bytes=self.moved,
            median_overhead=(float(np.median([s / p - 1.0 for s, p in zip(self.recent, self.plain, strict=True) if p > 0]))
                             if any(p > 0 for p in self.plain) else None),
            peak_device_bytes=self.peak, budget_bytes=self.peak_budget if self.peak is not None else budget_bytes,
            guard_evictions=self.guard,
            budget_spec=budget_spec, shapes=shapes, new_shapes=self.new_shapes,
            predicted_steps=self.predicted_steps, borrowed_steps=self.by_source["borrowed"],
            learned_steps=self.by_source["learned"], searched_steps=self.by_source["searched"])


@dataclass(frozen=True)
class StateStepReport:
    """What the state moved in the last training step (``StepReport.state``)."""

    placements: tuple[tuple[str, str], ...]  # (group, placement) of the groups off the device
    param_bytes_off: int  # parameter bytes the device did not hold at rest
    grad_bytes_off: int
    optimizer_bytes_off: int
    host_stepped: tuple[str, ...]  # groups stepped on the host
    optimizer_step_s: float | None  # the last optimizer.step(), fetches and copies back included
    copied_bytes: int  # bytes of state copied either way in the last step and its optimizer step
    peak_transient_bytes: int  # the most state bytes on the device beyond the resident part
    # R19: the optimizer state resting on the disk now, what the last optimizer step read and wrote
    # there and how long it waited for the disk, and the host's staging buffers for it
    disk_bytes: int = 0
    disk_read_bytes: int = 0
    disk_written_bytes: int = 0
    disk_wait_s: float = 0.0
    staging_bytes: int = 0

    def __str__(self) -> str:
        where = ", ".join(f"{g}: {w}" for g, w in self.placements[:4]) + (", ..." if len(self.placements) > 4 else "")
        step = f"; last optimizer step {1e3 * self.optimizer_step_s:.1f} ms" if self.optimizer_step_s is not None else ""
        disk = (f"; on the disk {format_bytes(self.disk_bytes)} (last step read {format_bytes(self.disk_read_bytes)}, wrote "
                f"{format_bytes(self.disk_written_bytes)}, waited {1e3 * self.disk_wait_s:.1f} ms)"
                if self.disk_bytes or self.disk_written_bytes else "")
        return (f"state off the device: parameters {format_bytes(self.param_bytes_off)}, gradients "
                f"{format_bytes(self.grad_bytes_off)}, optimizer {format_bytes(self.optimizer_bytes_off)} "
                f"({len(self.placements)} group(s): {where}); {len(self.host_stepped)} stepped on the host{step}; "
                f"copied {format_bytes(self.copied_bytes)}{disk}")


@dataclass(frozen=True)
class CollectiveTally:
    """The collectives one rank's step ran (R18: DDP's all-reduces, FSDP2's all-gathers and
    reduce-scatters), counted off the dispatcher in the steps that run a meter (profiling steps,
    and every step under ``audit=True``): how many of each and their payload bytes (an
    all-gather's, what it gathered; a reduce-scatter's, what it reduced; an all-reduce's, its
    tensors). How long they stalled compute is not measured: gloo and NCCL run them off the
    calling thread, and FSDP2 waits for them where nothing of ours runs."""

    all_gathers: int = 0
    all_gather_bytes: int = 0
    reduce_scatters: int = 0
    reduce_scatter_bytes: int = 0
    all_reduces: int = 0
    all_reduce_bytes: int = 0

    @classmethod
    def of(cls, counted: dict[str, list[int]] | None) -> CollectiveTally | None:
        """From a meter's tally (``TransientMeter.collectives``); None where no meter ran or it
        saw no collective."""
        if not counted:
            return None
        out: dict[str, int] = {}
        for kind, (n, nbytes) in counted.items():
            out[f"{kind}s"], out[f"{kind}_bytes"] = n, nbytes
        return cls(**out)

    def __str__(self) -> str:
        return (f"collectives: {self.all_gathers} all-gather(s) {format_bytes(self.all_gather_bytes)}, "
                f"{self.reduce_scatters} reduce-scatter(s) {format_bytes(self.reduce_scatter_bytes)}, "
                f"{self.all_reduces} all-reduce(s) {format_bytes(self.all_reduce_bytes)}")


@dataclass(frozen=True)
class StepReport:
    """What ``runtime.report()`` returns about the last step."""

    step: int
    # "profile" | "execute" | "diverged" | "timing" (the plan's compute without hooks, unbudgeted on
    # the emulated device, once before the first re-timing: DESIGN R1, "hooked gaps")
    mode: str
    step_s: float  # on CUDA from a synchronized start to the device's end of the step
    stall_s: float  # compute waiting for copies: the host's waits, and on CUDA the device's (timing events)
    predicted_step_s: float | None
    evicted_bytes: int
    prefetched_bytes: int
    on_demand_bytes: int
    # None for the profiling step, which runs unbudgeted on demand; an unhooked step's is its plan's
    # peak as simulated (nothing is counted there)
    peak_device_bytes: int | None
    budget_bytes: int | None
    plan_followed: bool
    guard_evictions: int
    kept_small: int  # planned evictions of tensors below min_bytes, dropped before the step
    cuda_peak_bytes: int | None = None
    hook_s: float | None = None  # the runtime's own time inside its hooks, waits left out
    copies: int = 0  # swap-outs and swap-ins issued
    # of ``hook_s``: the events whose hooks issued no copy and waited for none, and their time
    # (what a hook costs alone: retime.fitted_host_costs)
    plain_hook_s: float = 0.0
    plain_events: int = 0
    # R13-R16, executed steps: the state mover's host time in the step (its hooks, waits left out:
    # they are in ``stall_s``; not in ``hook_s`` or the gaps), the parameter tensors it moves, and
    # the copies it issued in the step
    state_host_s: float | None = None
    state_tensors: int = 0
    state_copies: int = 0
    waits: int = 0  # times compute waited for a copy that was not complete
    # CPU backend, executed steps: the compute before each event's hook and after the last one, on
    # the host clock (what ``timed_by_execution`` re-times a trace from)
    gaps_s: tuple[float, ...] | None = field(default=None, repr=False)
    tail_s: float | None = None
    # SwapRuntime(audit=True): static bytes plus the most bytes of saved storages (every storage
    # packed, whoever holds it, and every buffer made for a swap-in) alive at once, measured from
    # the storages' own lifetimes (CPU backend) or torch's allocator peak (CUDA); None without audit
    measured_peak_bytes: int | None = None
    # saved storages the runtime found held by someone else (the caller's inputs, module buffers):
    # left resident and counted in the trace's static bytes
    unowned_bytes: int = 0
    divergence: Divergence | None = None  # mode "diverged": where and how
    nothing_saved: bool = False  # the step saved no tensor for backward: there is nothing to swap
    recomputed_blocks: tuple[str, ...] = ()  # blocks run under torch.utils.checkpoint this step (R9)
    selective_blocks: tuple[str, ...] = ()  # those of them checkpointed selectively (R9, selective)
    new_shape: bool = False  # mode "profile": a step whose shape no plan was made for, profiled as it ran
    shape_predicted: bool = False  # executed on a trace predicted from its family's sizes (runtime/shapes.py)
    # whose plan an executed step ran: "borrowed" (a size near it, in its family), "learned" (the
    # quick planner's, made on the loop's thread for a new shape), "searched" (the policy's own)
    plan_source: str | None = None
    plain_step_s: float | None = None  # executed: the step's trace's compute without swapping (its ideal)
    # seconds the runtime spent planning on the training loop's thread for this step: laying out a
    # predicted shape at its first saved tensor, and what it did after the step (the policy's plan,
    # a re-layout); plans made on the planner thread are not in it
    planning_s: float = 0.0
    # R11: host bytes this step held: its swapped tensors (the pool's buffers, until the step's
    # end), the state the plan keeps on the host and the disk's staging buffers (R19); and planned
    # swap-outs left on the device because the host budget had no room
    host_peak_bytes: int = 0
    host_skipped: int = 0
    # the plan moved nothing and the shape's steps had followed it: the hooks came off after the
    # step's first saved tensor (no Python per saved tensor; nothing watched, so no peak of ours)
    unhooked: bool = False
    # the training state the plan moves (R13-R16; SwapRuntime(model=, optimizer=) under a byte
    # budget no activation plan meets): what was off the device, where each group stepped
    state: StateStepReport | None = None
    collectives: CollectiveTally | None = None  # R18: on several ranks, this rank's (where a meter ran)
    run: RunSummary | None = None  # the whole run so far
    # the user's optimizer.step() since this step (``runtime.report()`` reads it; None: no optimizer
    # given, or it has not stepped since), and whether ``predicted_step_s`` includes it: the plan's
    # trace records the state (R13), whose steps R15-R16 time (see ``measured_s``)
    optimizer_step_s: float | None = None
    predicts_optimizer_step: bool = False

    @property
    def measured_s(self) -> float:
        """What ``predicted_step_s`` predicts, measured: the step, and where the prediction includes
        the optimizer's step (``predicts_optimizer_step``), the one after it."""
        return self.step_s + ((self.optimizer_step_s or 0.0) if self.predicts_optimizer_step else 0.0)

    def __str__(self) -> str:
        pred = f"{1e3 * self.predicted_step_s:.2f} ms" if self.predicted_step_s is not None else "-"
        lines = [
            f"step {self.step} ({self.mode}): {1e3 * self.step_s:.2f} ms measured"
            + (f" (+{1e3 * self.optimizer_step_s:.2f} ms its optimizer step)"
               if self.predicts_optimizer_step and self.optimizer_step_s is not None else "")
            + f", {pred} predicted, "
            f"stall {1e3 * self.stall_s:.2f} ms",
            f"  evicted {format_bytes(self.evicted_bytes)}, prefetched {format_bytes(self.prefetched_bytes)}, "
            f"on demand {format_bytes(self.on_demand_bytes)}",
            (f"  peak device {format_bytes(self.peak_device_bytes)} of budget {format_bytes(self.budget_bytes or 0)}"
             + (" (unhooked: the plan moves nothing and the hooks came off, so this is the plan's peak as simulated)"
                if self.unhooked else "")
             if self.peak_device_bytes is not None else
             "  timing step: the compute without hooks, not budgeted (the emulated device's memory is the host's)"
             if self.mode == "timing" else
             "  unhooked: the plan moves nothing and the hooks came off; no peak could be simulated" if self.unhooked else
             "  profiling step: every saved tensor on the host, back on demand"
             + (" (a shape no plan was made for; it is planned now)" if self.new_shape else ""))
            + (f" (torch peak {format_bytes(self.cuda_peak_bytes)})" if self.cuda_peak_bytes is not None else "")
            + (f"; measured {format_bytes(self.measured_peak_bytes)}" if self.measured_peak_bytes is not None else ""),
            f"  plan followed: {'yes' if self.plan_followed else 'no'}; guard evictions {self.guard_evictions}; "
            f"small tensors kept {self.kept_small}"
            + (f"; runtime's own hook time {1e3 * self.hook_s:.2f} ms" if self.hook_s is not None else ""),
        ]
        if self.recomputed_blocks:
            lines.append(f"  recomputed {len(self.recomputed_blocks)} block(s) under torch.utils.checkpoint: "
                         + ", ".join(self.recomputed_blocks[:4]) + (", ..." if len(self.recomputed_blocks) > 4 else "")
                         + (f" ({len(self.selective_blocks)} selectively)"
                            if self.selective_blocks else ""))
        if self.state is not None:
            lines.append(f"  {self.state}")
        if self.collectives is not None:
            lines.append(f"  {self.collectives}")
        if self.divergence is not None:
            lines.append(f"  diverged {self.divergence}: finished on demand; the next step profiles again")
        if self.nothing_saved:
            lines.append("  nothing to swap: the step saved no tensor for backward (it ran as it would without swapsched)")
        if self.run is not None:
            lines.append(f"  {self.run}")
        return "\n".join(lines)
