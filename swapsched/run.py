"""Train a zoo model with the live runtime, beside a run without it (``swapsched run``).

Every run trains two copies of the same model on the same synthetic batch: one under the method
being measured, one plain. The losses are compared bit for bit at every step (``loss_matches``).
Peers for ``--compare``: PyTorch's ``torch.autograd.graph.save_on_cpu`` and activation
checkpointing (``torch.utils.checkpoint`` around each block), measured the same way.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

from swapsched.errors import UserError
from swapsched.zoo import ModelCase, build_model

__all__ = ["RunResult", "NothingToSwap", "run_runtime", "run_peer", "PEERS"]

PEERS = ("plain", "save_on_cpu", "checkpoint")


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


def _train(case: ModelCase, ref: ModelCase, steps: int, device: str, wrap: Callable[[], Any],
           on_step: Callable[[int, float, bool], None] | None = None) -> tuple[list[float], bool, list[int]]:
    """``steps`` SGD steps of ``case`` inside ``wrap()`` and of ``ref`` plainly: step times, whether
    every loss matched bit for bit, and (CUDA) each step's allocation peak above its start."""
    opt_a = torch.optim.SGD(case.model.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(ref.model.parameters(), lr=1e-3)
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
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(dt)
        if on_step:
            on_step(s, dt, ok)
    return times, matches, peaks


class NothingToSwap(UserError):
    """The model's step saves no tensor for backward: it trains, and there is nothing to plan."""


def run_runtime(model: str, policy: Any, budget: str, steps: int, *, size: str | None = None, batch_size: int | None = None,
                seq_len: int | None = None, backend: str | None = None, bandwidth: float | None = None,
                hardware: str | None = None, on_step: Callable[..., None] | None = None) -> RunResult:
    from swapsched.deploy import SwapRuntime
    from swapsched.runtime.backends import resolve_backend

    backend = resolve_backend(backend)
    device = "cuda" if backend == "cuda" else "cpu"
    case, ref = _pair(model, size, batch_size, seq_len, device)
    rt = SwapRuntime(budget=budget, policy=policy, backend=backend, bandwidth=bandwidth, hardware=hardware,
                     model=case.model)
    name = getattr(rt.policy, "name", str(policy))
    if steps <= rt.profile_steps:
        raise UserError(f"--steps must exceed the {rt.profile_steps} profiling steps, got {steps}")
    reports = []

    def step_cb(s: int, dt: float, ok: bool) -> None:
        reports.append(rt.report())
        if on_step:
            on_step(s, dt, ok, rt.report())

    try:
        _, matches, peaks = _train(case, ref, steps, device, rt.step, step_cb)
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
    if peaks:  # CUDA: the same figure as the peers' rows (run_peer), torch's allocator peak, not our accounting
        resident = sum(t.untyped_storage().nbytes() for t in [*case.model.parameters(), *case.model.buffers()])
        peak = resident + max(p for p, r in zip(peaks, reports, strict=False) if r.mode == "execute")
    return RunResult(
        method=name, steps=len(run), link=rt.backend.link(), step_s_median=statistics.median(r.step_s for r in run),
        step_s=tuple(r.step_s for r in run), peak_device_bytes=peak,
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
    guarded = [r for r in run if r.guard_evictions]
    if guarded:
        why.append(f"the guard evicted {sum(r.guard_evictions for r in guarded)} tensors on the spot in "
                   f"{len(guarded)} of {len(run)} executed steps (the plan did not fit the memory as the step ran)")
    over = [r for r in run if r.peak_device_bytes is not None and r.budget_bytes is not None
            and r.peak_device_bytes > r.budget_bytes]
    if over:
        why.append(f"{len(over)} steps went over the budget with nothing left to evict")
    diverged = [r for r in reports if r.mode == "diverged"]
    if diverged:
        why.append(f"{len(diverged)} steps left the trace (first: step {diverged[0].step} {diverged[0].divergence})")
    return "; ".join(why) or None


def _checkpoint_blocks(model: nn.Module) -> int:
    """Wrap each block (transformer block, residual block, or each child of a top-level
    Sequential) in ``torch.utils.checkpoint``; returns how many were wrapped."""
    from torch.utils.checkpoint import checkpoint

    from swapsched.zoo import BasicBlock, TransformerBlock

    blocks = [m for m in model.modules() if isinstance(m, (TransformerBlock, BasicBlock))]
    if not blocks:
        seqs = [m for m in model.children() if isinstance(m, nn.Sequential)]
        blocks = [c for s in seqs for c in s.children() if any(p.requires_grad for p in c.parameters())]
    for m in blocks:
        fwd = m.forward
        m.forward = lambda *a, _f=fwd, **k: checkpoint(_f, *a, use_reentrant=False, **k)  # type: ignore[method-assign]
    return len(blocks)


def run_peer(kind: str, model: str, steps: int, *, size: str | None = None, batch_size: int | None = None,
             seq_len: int | None = None, device: str = "cpu") -> RunResult:
    """``plain`` (no swap), ``save_on_cpu`` (PyTorch's own offload) or ``checkpoint``."""
    if kind not in PEERS:
        raise UserError(f"unknown peer {kind!r}; known: {', '.join(PEERS)}")
    case, ref = _pair(model, size, batch_size, seq_len, device)
    extra: dict[str, Any] = {}
    wrap: Callable[[], Any] = contextlib.nullcontext
    if kind == "save_on_cpu":
        pin = device.startswith("cuda")
        wrap = lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)  # noqa: E731
    elif kind == "checkpoint":
        extra["blocks"] = _checkpoint_blocks(case.model)
    times, matches, peaks = _train(case, ref, steps, device, wrap)
    warm = times[1:] or times
    peak = None
    if peaks:  # parameters and buffers, plus the most a step allocated above its start (grads included)
        resident = sum(t.untyped_storage().nbytes() for t in [*case.model.parameters(), *case.model.buffers()])
        peak = resident + max(peaks)
    link = "none (no copies)" if kind != "save_on_cpu" else (
        "the device's" if device.startswith("cuda") else "host memcpy, unthrottled: not comparable with an emulated link")
    return RunResult(method=kind, steps=len(warm), link=link, step_s_median=statistics.median(warm), step_s=tuple(warm),
                     peak_device_bytes=peak, budget_bytes=None, stall_s=None, loss_matches=matches, extra=extra)

