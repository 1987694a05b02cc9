"""Train a zoo model with the live runtime, beside a run without it (``swapsched run``).

Every run trains two copies of the same model on the same synthetic batch: one under the method
being measured, one plain. The losses are compared bit for bit at every step (``loss_matches``).

``--compare`` (:func:`compare_live`) measures as the benchmarks do: every method (swapsched's
policies and the peers users choose: plain, ``torch.utils.checkpoint`` per block, selective
checkpointing with torchtitan's op list, ``save_on_cpu``, and each block checkpointed with its
input offloaded) trains its own copy of the model, in shuffled interleaved rounds, so that the
machine's drift hits them alike; each method's step is its median over the plain step of the
same rounds, with the spread over rounds. Every method's peak device memory is measured by one
meter that does not depend on the method (:class:`DeviceMeter`: live storages on the CPU,
``max_memory_allocated`` on CUDA), in one extra step each, so that the meter's cost stays out of
the times.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

from swapsched.device_meter import DeviceMeter
from swapsched.errors import UserError
from swapsched.zoo import ModelCase, build_model

__all__ = ["RunResult", "NothingToSwap", "run_runtime", "CompareRow", "compare_live", "LiveComparison"]


@dataclass(frozen=True)
class RunResult:
    method: str
    steps: int
    step_s_median: float
    step_s: tuple[float, ...]
    # CUDA: torch's allocator peak for every row (parameters and buffers plus the most a step allocated);
    # CPU: the runtime's accounting (storage liveness), None for the peers
    peak_device_bytes: int | None
    budget_bytes: int | None
    stall_s: float | None
    loss_matches: bool
    predicted_step_s: float | None = None
    plan_followed: bool | None = None
    why_not_followed: str | None = None  # when plan_followed is False: what happened instead
    # the link the copies took: rows on different links are not comparable (save_on_cpu on the
    # CPU is a plain memcpy, the runtime's emulated device a throttled one)
    link: str = "-"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pair(model: str, size: str | None, batch_size: int | None, seq_len: int | None, device: str) -> tuple[ModelCase, ModelCase]:
    a = build_model(model, size, batch_size=batch_size, seq_len=seq_len, device=device, seed=0)
    b = build_model(model, size, batch_size=batch_size, seq_len=seq_len, device=device, seed=0)
    return a, b


#: The optimizers ``run`` trains with: SGD (no state: what the activations' comparisons use) and
#: AdamW (8 bytes of state a parameter, which a byte budget below the static bytes moves, R13)
LIVE_OPTIMIZERS = ("sgd", "adamw")


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """``run``'s optimizer ``name`` (``LIVE_OPTIMIZERS``) over ``model``'s parameters."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    raise UserError(f"optimizer {name!r} unknown; use one of {', '.join(LIVE_OPTIMIZERS)}")


def _train(case: ModelCase, ref: ModelCase, steps: int, device: str, wrap: Callable[[], Any],
           on_step: Callable[[int, float, bool], None] | None, opt_a: torch.optim.Optimizer,
           opt_b: torch.optim.Optimizer) -> tuple[list[float], bool, list[int]]:
    """``steps`` optimizer steps of ``case`` inside ``wrap()`` and of ``ref`` plainly: step times (forward,
    backward and ``case``'s optimizer step, where a moving state's host steps and copies run: what the
    runtime predicts), whether every loss matched bit for bit, and (CUDA) each step's allocation peak."""
    times, matches, peaks = [], True, []
    cuda = device.startswith("cuda")
    for s in range(steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        la, dt = case.timed_step(wrap)
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated() - base)
        lb = ref.loss()
        lb.backward()
        ok = bool(torch.equal(la.detach(), lb.detach()))
        matches &= ok
        t0 = time.perf_counter()
        opt_a.step()
        if cuda:
            torch.cuda.synchronize()
        dt += time.perf_counter() - t0
        opt_b.step()
        opt_a.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)
        times.append(dt)
        if on_step:
            on_step(s, dt, ok)
    return times, matches, peaks


class NothingToSwap(UserError):
    """The model's step saves no tensor for backward: it trains, and there is nothing to plan."""


def run_runtime(model: str, policy: Any, budget: str, steps: int, *, size: str | None = None, batch_size: int | None = None,
                seq_len: int | None = None, backend: str | None = None, bandwidth: float | None = None,
                hardware: str | None = None, on_step: Callable[..., None] | None = None, optimizer: str = "sgd",
                memory: dict[str, Any] | None = None) -> RunResult:
    from swapsched.deploy import SwapRuntime
    from swapsched.runtime.backends import resolve_backend

    backend = resolve_backend(backend)
    device = "cuda" if backend == "cuda" else "cpu"
    case, ref = _pair(model, size, batch_size, seq_len, device)
    opt_a, opt_b = make_optimizer(case.model, optimizer), make_optimizer(ref.model, optimizer)
    rt = SwapRuntime(budget=budget, policy=policy, backend=backend, bandwidth=bandwidth, hardware=hardware,
                     model=case.model, optimizer=opt_a, **(memory or {}))
    name = getattr(rt.policy, "name", str(policy))
    if steps <= rt.profile_steps:
        raise UserError(f"--steps must exceed the {rt.profile_steps} profiling steps, got {steps}")
    reports = []

    def step_cb(s: int, dt: float, ok: bool) -> None:
        reports.append(rt.report())
        if on_step:
            on_step(s, dt, ok, rt.report())

    try:
        _, matches, peaks = _train(case, ref, steps, device, rt.step, step_cb, opt_a, opt_b)
    finally:
        rt.close()
    run = [r for r in reports if r.mode == "execute"]
    if not run and all(r.nothing_saved for r in reports):
        raise NothingToSwap(f"{model}: nothing to swap: its training step saves no tensor for backward "
                            f"({len(reports)} steps ran under the runtime unchanged, losses {'matched' if matches else 'DIFFERED'})")
    if not run:
        raise UserError("no step executed a plan (every step diverged or profiled); see the report")
    accounted = max(r.peak_device_bytes for r in run)
    peak = accounted
    if peaks:  # CUDA: torch's allocator peak, as DeviceMeter measures every row of --compare, not our accounting
        resident = sum(t.untyped_storage().nbytes() for t in [*case.model.parameters(), *case.model.buffers()])
        peak = resident + max(p for p, r in zip(peaks, reports, strict=False) if r.mode == "execute")
    return RunResult(
        method=name, steps=len(run), link=rt.backend.link(), step_s_median=statistics.median(r.measured_s for r in run),
        # as predicted: with the optimizer step where the prediction includes it (R15)
        step_s=tuple(r.measured_s for r in run), peak_device_bytes=peak,
        budget_bytes=run[-1].budget_bytes, stall_s=statistics.median(r.stall_s for r in run), loss_matches=matches,
        predicted_step_s=run[-1].predicted_step_s, plan_followed=all(r.plan_followed for r in run),
        why_not_followed=_why_not_followed(reports),
        extra={"guard_evictions": sum(r.guard_evictions for r in run), "cuda_peak_bytes": run[-1].cuda_peak_bytes,
               "accounted_peak_bytes": accounted, "static_bytes": rt.static_bytes},
    )


def _why_not_followed(reports: list[Any]) -> str | None:
    """What kept the executed steps from following their plan, in words; None if nothing did."""
    run = [r for r in reports if r.mode == "execute"]
    why = []
    if guarded := [r for r in run if r.guard_evictions]:
        why.append(f"the guard evicted {sum(r.guard_evictions for r in guarded)} tensors on the spot in "
                   f"{len(guarded)} of {len(run)} executed steps (the plan did not fit the memory as the step ran)")
    over = [r for r in run if r.peak_device_bytes is not None and r.budget_bytes is not None and r.peak_device_bytes > r.budget_bytes]
    if over:
        why.append(f"{len(over)} steps went over the budget with nothing left to evict")
    if diverged := [r for r in reports if r.mode == "diverged"]:
        why.append(f"{len(diverged)} steps left the trace (first: step {diverged[0].step} {diverged[0].divergence})")
    return "; ".join(why) or None


def _checkpoint_blocks(model: nn.Module) -> int:
    """Wrap each block (transformer, residual, or child of a top-level Sequential) in checkpoint; how many."""
    from torch.utils.checkpoint import checkpoint

    blocks = _blocks_of(model)
    for m in blocks:
        fwd = m.forward
        m.forward = lambda *a, _f=fwd, **k: checkpoint(_f, *a, use_reentrant=False, **k)  # type: ignore[method-assign]
    return len(blocks)


# ----------------------------------------------------------------------------- --compare, interleaved


def round_ratios(times: list[list[float]], base: list[list[float]]) -> tuple[float, float, float, float]:
    """Interleaved rounds (``times``: each round's steps of a method; ``base``: the reference
    method's in the same rounds): the method's median step, and the median, lowest and highest
    over the rounds of its median step over the reference's in that round."""
    ratios = [statistics.median(t) / statistics.median(b) for t, b in zip(times, base, strict=True)]
    return statistics.median(t for ts in times for t in ts), statistics.median(ratios), min(ratios), max(ratios)


@dataclass(frozen=True)
class CompareRow:
    """One method of ``run --compare``: its median step over the plain step of the same rounds
    (``ratio``), the lowest and highest round's ratio, its peak by :class:`DeviceMeter`, whether
    that fits the budget, whether every loss equalled plain training's bit for bit, and a note
    (how its copies travel, or why it is not comparable)."""

    method: str
    step_s_median: float
    ratio: float
    ratio_low: float
    ratio_high: float
    peak_bytes: int
    fits: bool | None
    loss_matches: bool
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sac_blocks(model: nn.Module) -> int:
    """Each block under selective activation checkpointing with torchtitan's op list: the outputs
    of matmuls, convolutions and attention are saved, everything else recomputed
    (``trace.SELECTIVE_SAVE_OPS``; a random op is always recomputed, as torch requires)."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from swapsched.segments import SELECTIVE_SAVE_OPS

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = getattr(getattr(op, "overloadpacket", op), "__name__", "")
        return CheckpointPolicy.MUST_SAVE if name in SELECTIVE_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    context = functools.partial(create_selective_checkpoint_contexts, policy)
    blocks = _blocks_of(model)
    for m in blocks:
        fwd = m.forward
        m.forward = lambda *a, _f=fwd, **k: checkpoint(_f, *a, use_reentrant=False, context_fn=context, **k)  # type: ignore[method-assign]
    return len(blocks)


def _blocks_of(model: nn.Module) -> list[nn.Module]:
    from swapsched.zoo import BasicBlock, TransformerBlock

    blocks = [m for m in model.modules() if isinstance(m, (TransformerBlock, BasicBlock))]
    if not blocks:
        seqs = [m for m in model.children() if isinstance(m, nn.Sequential)]
        blocks = [c for s in seqs for c in s.children() if any(p.requires_grad for p in c.parameters())]
    return blocks


class _Method:
    """One method of the comparison: its own copy of the model, its optimizer, what wraps its step."""

    def __init__(self, name: str, case: ModelCase, wrap: Callable[[], Any], note: str = "", runtime: Any = None,
                 optimizer: torch.optim.Optimizer | None = None):
        self.name, self.case, self.wrap, self.note, self.runtime = name, case, wrap, note, runtime
        self.opt = optimizer or torch.optim.SGD(case.model.parameters(), lr=1e-3)
        self.losses: list[torch.Tensor] = []
        self.times: list[list[float]] = []

    def step(self, meter: DeviceMeter | None = None) -> float:
        ctx = meter.step() if meter is not None else contextlib.nullcontext()
        with ctx:
            loss, dt = self.case.timed_step(self.wrap)
        self.losses.append(loss.detach())
        # the optimizer's step is timed too: where the state moves, the host steps and the copies
        # back run in it
        t0 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.case.inputs and isinstance(self.case.inputs[0], torch.Tensor) and self.case.inputs[0].is_cuda:
            torch.cuda.synchronize()
        return dt + time.perf_counter() - t0

    def warm(self) -> None:
        """Steps until the method runs as measured: a runtime through its profiling steps, its
        first re-timing and the plan it then keeps (R9's second stage, a plan on trial: its
        ``settled``), to an executed step; every method at least one step."""
        self.step()
        if self.runtime is not None:
            rt = self.runtime
            for _ in range(8 * rt.profile_steps + 6 * max(rt.retime_steps, 1) + 8):
                if rt.settled and rt.report().mode == "execute":
                    break
                self.step()


def compare_live(model: str, budget: str, policies: list[str], *, size: str | None = None, batch_size: int | None = None,
                 seq_len: int | None = None, backend: str | None = None, bandwidth: float | None = None,
                 hardware: str | None = None, rounds: int = 6, round_steps: int = 2, seed: int = 0,
                 progress: Callable[[str], None] | None = None, optimizer: str = "sgd",
                 memory: dict[str, Any] | None = None) -> LiveComparison:
    """Every method of ``--compare`` (module docstring) on ``model`` at ``budget``, interleaved;
    ``memory``: the runtimes' ``host_budget``, ``disk`` and ``disk_budget`` (R11, R19)."""
    import random

    from swapsched.budget import parse_budget
    from swapsched.deploy import SwapRuntime
    from swapsched.runtime.backends import resolve_backend

    if rounds < 2 or round_steps < 1:
        raise UserError(f"--rounds must be at least 2 and --round-steps at least 1, got {rounds} and {round_steps}")
    backend = resolve_backend(backend)
    device = "cuda" if backend == "cuda" else "cpu"

    def fresh() -> ModelCase:
        return build_model(model, size, batch_size=batch_size, seq_len=seq_len, device=device, seed=0)

    runtimes = []

    def runtime_method(name: str, policy: str, note: str = "") -> _Method:
        case = fresh()
        opt = make_optimizer(case.model, optimizer)
        # audited in the metered step only (below): the audit meter's dispatch mode slows every op,
        # and timed rounds under it put a moving state's rows at 3-4x their step (gpt tiny, AdamW)
        rt = SwapRuntime(budget=budget, policy=policy, backend=backend, bandwidth=bandwidth, hardware=hardware,
                         model=case.model, optimizer=opt, **(memory or {}))
        runtimes.append(rt)
        return _Method(name, case, rt.step, note or f"swapsched runtime, link: {rt.backend.link()}", rt, opt)

    def plain_method(name: str, case: ModelCase, wrap: Callable[[], Any], note: str) -> _Method:
        return _Method(name, case, wrap, note, optimizer=make_optimizer(case.model, optimizer))

    methods = [plain_method("plain", fresh(), contextlib.nullcontext, "no copies")]
    ck = fresh()
    n = _checkpoint_blocks(ck.model)
    methods.append(plain_method("checkpoint", ck, contextlib.nullcontext, f"torch.utils.checkpoint on {n} blocks, no copies"))
    sac = fresh()
    n = _sac_blocks(sac.model)
    methods.append(plain_method("selective-checkpoint", sac, contextlib.nullcontext,
                                f"torch selective checkpointing on {n} blocks (torchtitan's op list), no copies"))
    if device == "cuda":
        methods.append(plain_method("save_on_cpu", fresh(), lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
                                    "torch.autograd.graph.save_on_cpu(pin_memory=True)"))
    else:  # on the CPU it would copy nothing (the tensors are on the host already): its schedule, emulated
        methods.append(runtime_method("save_on_cpu", "swap-all", "save_on_cpu's schedule on the runtime's emulated link "
                                                                 "(torch's own copies nothing on a CPU-only machine)"))
    methods.append(runtime_method("checkpoint-offload", "checkpoint-offload",
                                  "each block checkpointed, its input offloaded (ALST), on the runtime"))
    if optimizer != "sgd" and not budget.strip().endswith("%"):
        # R13: the offloaders users pick for the state, as their placements (agents/state_search.PEERS,
        # each block checkpointed as they are run) executed by the runtime: their own code (FSDP2's
        # CPUOffloadPolicy, torchao's CPUOffloadOptimizer, DeepSpeed's ZeRO-Offload) offloads from a
        # CUDA device and is not run here; each row says so
        for peer, what in (("zero-offload", "ZeRO-Offload's placement"), ("fsdp-offload", "FSDP2 CPUOffloadPolicy's placement"),
                           ("ao-offload", "torchao CPUOffloadOptimizer's placement"),
                           *((("zero-infinity", "ZeRO-Infinity's placement (offload_optimizer: nvme)"),)
                             if (memory or {}).get("disk") else ())):
            methods.append(runtime_method(peer, peer, f"{what} executed by the swapsched runtime, not the peer's own code"))
    for p in policies:  # one row per method: a peer's placement is its row above already
        if all(m.name != p for m in methods):
            methods.append(runtime_method(p, p))
    refused: dict[str, str] = {}
    try:
        for m in methods:
            if progress:
                progress(f"warm {m.name}")
            try:
                m.warm()
            except UserError as exc:  # a method that cannot run at this budget: a row that says why
                refused[m.name] = str(exc).split("; give")[0]
        methods = [m for m in methods if m.name not in refused]
        rng = random.Random(seed)
        for r in range(rounds):
            order = list(methods)
            rng.shuffle(order)
            for m in order:
                if progress:
                    progress(f"round {r + 1}/{rounds} {m.name}")
                m.times.append([m.step() for _ in range(round_steps)])
        peaks = {}
        for m in methods:  # one metered step each, outside the timed rounds
            meter = DeviceMeter(m.case.model, m.opt, device)
            if m.runtime is not None and optimizer != "sgd" and device == "cpu":
                # with a state to move, a runtime row measures itself (audit): on the emulated device
                # the live-storage meter cannot tell a host master from a device tensor, nor see a
                # parameter's storage let go and refilled
                m.runtime.audit = True
            m.step(meter)
            peaks[m.name] = meter.peak
            audited = m.runtime.report().measured_peak_bytes if m.runtime is not None and m.runtime.mover is not None else None
            if audited is not None:
                peaks[m.name] = audited
                m.note += "; peak by its audit meter (the state moves)"
    finally:
        for rt in runtimes:
            rt.close()
    plain = methods[0]
    ref = plain.losses
    # the budget in bytes as the runtime resolves it on this model (a relative one: parameters,
    # gradients and optimizer state, plus the share of the step's activation peak)
    budget_bytes = runtimes[0].budget_bytes if budget.strip().endswith("%") else parse_budget(budget)
    rows = []
    for m in methods:
        n = min(len(m.losses), len(ref))
        rows.append(CompareRow(m.name, *round_ratios(m.times, plain.times), peaks[m.name], peaks[m.name] <= budget_bytes,
                               all(torch.equal(a, b) for a, b in zip(m.losses[:n], ref[:n], strict=True)), m.note))
    nan = float("nan")
    rows += [CompareRow(name, nan, nan, nan, nan, 0, False, False, f"refused: {why}") for name, why in refused.items()]
    return LiveComparison(tuple(rows), budget_bytes, rounds, round_steps)


@dataclass(frozen=True)
class LiveComparison:
    """What :func:`compare_live` measured: a row per method, the budget in the meter's bytes, and
    the rounds. ``fastest`` is the fastest method whose peak fits the budget."""

    rows: tuple[CompareRow, ...]
    budget_bytes: int
    rounds: int
    round_steps: int

    @property
    def fastest(self) -> CompareRow | None:
        fits = [r for r in self.rows if r.fits]
        return min(fits, key=lambda r: r.ratio) if fits else None

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [r.to_dict() for r in self.rows], "budget_bytes": self.budget_bytes, "rounds": self.rounds,
                "round_steps": self.round_steps, "fastest": self.fastest.method if self.fastest else None}
