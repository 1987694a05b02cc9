"""The profiling step's own time inside its dispatch modes, kept out of the trace's gaps (R1).

A profiling step runs the model under two Python dispatch modes (``recorder.OpNames``, the op
names and producers; ``transients.TransientMeter``, R3's other bytes). Every op then pays their
Python work, about 40 us on this kind of host, and twice the cost of entering a Python mode at
all: on a small model that is more than the op itself. The host clock's gaps would count it as
the model's compute, so a plan made on them (and its first prediction) saw a step two to three
times longer than it runs without the modes.

So each mode charges what it does around the op to a :class:`ModeTime` (its own time, and one
entry per op), and the recorder leaves it out of the gap it fell in, as it leaves out the hooks'
own time. The cost of entering a Python mode, which no mode can time from inside, is measured
once per process (:func:`dispatch_entry_s`). The op itself (``func``) is never charged.
"""

from __future__ import annotations

import statistics
import time
from functools import cache

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ModeTime", "dispatch_entry_s"]


class ModeTime:
    """What the profiling modes spent around the ops so far: ``own_s`` of their Python work, and
    ``entries`` into a mode (one per op per mode), each costing :func:`dispatch_entry_s`."""

    __slots__ = ("own_s", "entries", "entry_s")

    def __init__(self) -> None:
        self.own_s = 0.0
        self.entries = 0
        self.entry_s = dispatch_entry_s()

    def total_s(self) -> float:
        """Every second the modes added to the step so far."""
        return self.own_s + self.entries * self.entry_s


class _Passthrough(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops += 1
        return func(*args, **(kwargs or {}))


@cache
def dispatch_entry_s(steps: int = 10, repeats: int = 5) -> float:
    """The seconds one op pays for entering a Python dispatch mode that does nothing, as a
    training step's ops pay it (autograd's included): ``steps`` forward and backward passes of a
    four-layer MLP on a tiny batch (about 30 ops each) with and without such a mode, the median
    difference over ``repeats`` interleaved rounds, per op (at least 0). Measured once per
    process (about 30 ms)."""
    # measured inside the user's first profiling step: their random numbers must not move (the
    # step's dropout masks), and their grad mode must not stop the measurement
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        return _measure_entry(steps, repeats)


def _measure_entry(steps: int, repeats: int) -> float:
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    x = torch.randn(4, 16)

    def run() -> None:
        for _ in range(steps):
            mlp(x).sum().backward()
            mlp.zero_grad(set_to_none=True)

    counter = _Passthrough()
    with counter:
        run()  # warm, and counts the ops
    ops = counter.ops
    diffs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        plain = time.perf_counter() - t0
        with _Passthrough():
            t0 = time.perf_counter()
            run()
            moded = time.perf_counter() - t0
        diffs.append(moded - plain)
    return max(statistics.median(diffs) / max(ops, 1), 0.0)
