"""Shared fixtures: tiny hand-made traces, a round-number hardware profile, and training a model
under the runtime beside a plain copy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from swapsched.hardware import Hardware
from swapsched.trace import Event, TensorInfo, Trace


def make_trace(sizes: list[int], events: list[tuple[str, int, float]], tail: float = 0.0, static: int = 0,
               name: str = "hand", ops: list[str] | None = None, other: list[int] | None = None,
               modules: list[str] | None = None) -> Trace:
    """A hand-made trace; ``modules`` (default ``layer{i}``, in no block) place tensors in blocks (R9)."""
    mods = modules or [f"layer{i}" for i in range(len(sizes))]
    tensors = tuple(TensorInfo(i, b, (b // 4,), "float32", (ops or [""] * len(sizes))[i], mods[i]) for i, b in enumerate(sizes))
    evs = tuple(Event(k, t, g, other_bytes=(other[i] if other else None)) for i, (k, t, g) in enumerate(events))
    return Trace(name=name, timing="measured", device="cpu", static_bytes=static, tail_compute_s=tail, tensors=tensors, events=evs)


def make_hw(d2h: float = 100.0, h2d: float = 100.0, latency: float = 0.0) -> Hardware:
    return Hardware(name="hand", d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d, copy_latency_s=latency,
                    device_memory_bytes=10**9, peak_flops=1e12, memory_bytes_per_s=1e11)


@pytest.fixture
def two_tensors() -> Trace:
    """T0, T1 of 100 B. e0 pack0 @1, e1 pack1 @2, e2 unpack1 @4, e3 unpack0 @5 (ideal 5 s)."""
    return make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)])


@pytest.fixture
def one_block() -> Trace:
    """Block ``blk.0``: anchor T0 and member T1; T2 outside any block; 100 B each, 1 s gaps.
    e0 pack0, e1 pack1, e2 pack2, e3 unpack2, e4 unpack1, e5 unpack0 (ideal 6 s). Recomputing
    the block rebuilds T1 at e4 and spends the gaps of its forward packs, e0 and e1: 2 s."""
    return make_trace([100, 100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 1.0), ("unpack", 2, 1.0),
                                        ("unpack", 1, 1.0), ("unpack", 0, 1.0)], modules=["blk.0.ln", "blk.0.fc", "head"])


@pytest.fixture
def hw() -> Hardware:
    return make_hw()


def step_reports(rt: Any, case: Any, steps: int) -> list[Any]:
    """``steps`` training steps of the zoo ``case`` under ``rt``: each step's report."""
    reports = []
    for _ in range(steps):
        with rt.step():
            case.loss().backward()
        reports.append(rt.report())
    return reports


def train_together(a: torch.nn.Module, b: torch.nn.Module, rt: Any, steps: int,
                   run: Callable[[torch.nn.Module, int], torch.Tensor]) -> list[Any]:
    """Step ``a`` under ``rt`` and ``b`` plainly with ``run(model, step)`` (which returns the loss
    after its backward); assert equal losses and gradients each step; return the step reports."""
    reports = []
    for i in range(steps):
        for m in (a, b):
            m.zero_grad(set_to_none=True)
        with rt.step():
            la = run(a, i)
        lb = run(b, i)
        assert torch.equal(la, lb), f"step {i}: losses differ"
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True)), f"step {i}"
        reports.append(rt.report())
    return reports
