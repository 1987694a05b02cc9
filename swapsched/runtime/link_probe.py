"""What the emulated device's link costs beyond its throttle, measured on the running machine
(R6): a lone copy's wake-up (``copy_wake_s``) and what copies in flight take of the compute around
them (``copy_interference``). ``backends.runtime_devices`` measures both as the runtime starts on
the shipped profile; ``swapsched calibrate`` writes a profile that has its own.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Protocol

import torch

__all__ = ["copy_wake_s", "lone_copy_s", "copy_interference", "interference_costs"]


class Backend(Protocol):
    """What these probes use of a ``backends.Backend`` (which imports this module)."""

    emulated: bool
    device_type: str
    pool: Any

    def copy_out(self, src: torch.Tensor) -> Any: ...
    def copy_in(self, host: torch.Tensor, after: Any, device: Any = None) -> Any: ...
    def wait_host(self, t: Any) -> None: ...
    def synchronize(self) -> None: ...


def copy_wake_s(backend: Backend, nbytes: int, d2h: tuple[float, float], h2d: tuple[float, float]) -> float:
    """R6's ``copy_wake_s`` of ``backend``'s engines: what lone copies of ``nbytes``
    (``lone_copy_s``) take beyond ``latency + bytes / bandwidth`` of each direction (``d2h``,
    ``h2d``: (latency s, bytes/s), a queued copy's), the two directions averaged."""
    out_s, in_s = lone_copy_s(backend, nbytes)
    beyond = [t - latency - nbytes / rate for t, (latency, rate) in ((out_s, d2h), (in_s, h2d))]
    return max(0.0, sum(beyond) / 2)


def lone_copy_s(backend: Backend, nbytes: int, samples: int = 5) -> tuple[float, float]:
    """Median seconds from issuing a lone copy of ``nbytes`` (its engine idle: each waits 1 ms
    after the last) to its waiter running again, out then in (R6's ``copy_wake_s`` is what they
    take beyond latency and bytes). On the emulated device each is issued right after a matmul,
    as the hooks issue copies right after an op: the op's worker threads still spin on the cores
    the engine's thread wakes on, which adds a third to the wake-up on a 2-core machine."""
    src = torch.zeros(nbytes, dtype=torch.uint8, device=backend.device_type)
    op = torch.ones(256, 256) if backend.emulated else None
    outs: list[float] = []
    ins: list[float] = []

    def lone(copy: Any, args: tuple[Any, ...], times: list[float]) -> Any:
        backend.synchronize()
        time.sleep(1e-3)
        if op is not None:
            torch.mm(op, op)
        t0 = time.perf_counter()
        t = copy(*args)
        backend.wait_host(t)
        times.append(time.perf_counter() - t0)
        return t

    for _ in range(samples):
        host = lone(backend.copy_out, (src,), outs).dst
        lone(backend.copy_in, (host, None), ins)
        backend.pool.give(host)
    return sorted(outs)[samples // 2], sorted(ins)[samples // 2]


def copy_interference(backend: Backend, sizes: tuple[int, int] = (2**16, 2**20), ops: int = 160, every: int = 4,
                      rounds: int = 5) -> tuple[float, float]:
    """What copies in flight cost the compute around them on the emulated device, per copy and per
    byte (R6: Hardware ``copy_issue_s``, ``copy_host_s_per_byte``, which the simulator charges to
    the compute): ``ops`` matmuls on torch's threads, a copy out issued before every ``every``-th
    of them, against the same matmuls with no copy, in ``rounds`` interleaved rounds (medians),
    at two copy sizes; the two points give the cost per copy and per byte. On a 2-core machine a
    copy engine's thread takes a core from the op's worker threads, which then wait for it at the
    op's end: a model's gaps ran 2.2x longer with 82 copies in flight per step than with none,
    where the plan's prediction had them equal (issue 55). ~0.5 s; (0, 0) on a device with DMA
    engines, whose copies take no compute core."""
    if not backend.emulated:
        return 0.0, 0.0
    a, b = torch.randn(64, 256), torch.randn(256, 256)
    srcs = [torch.zeros(s, dtype=torch.uint8) for s in sizes]

    def run(src: torch.Tensor | None) -> float:
        tickets = []
        t0 = time.perf_counter()
        for i in range(ops):
            if src is not None and i % every == 0:
                tickets.append(backend.copy_out(src))
            torch.mm(a, b)
        dt = time.perf_counter() - t0
        for t in tickets:  # the copies' buffers go back to the pool once landed
            backend.wait_host(t)
            backend.pool.give(t.dst)
        return dt

    run(None), run(srcs[0])  # warm the pool and the threads
    times: list[list[float]] = [[], [], []]
    for _ in range(rounds):
        for k, src in enumerate((None, *srcs)):
            times[k].append(run(src))
    base, small, large = (statistics.median(t) for t in times)
    return interference_costs(base, (small, large), len(range(0, ops, every)), sizes)


def interference_costs(base_s: float, with_copies_s: tuple[float, float], copies: int,
                       sizes: tuple[int, int]) -> tuple[float, float]:
    """``copy_interference``'s arithmetic: the compute took ``base_s`` alone and ``with_copies_s``
    with ``copies`` copies of each of ``sizes`` in flight; the line through the two extra times per
    copy gives the cost per copy (at 0 bytes) and per byte, neither below 0."""
    small, large = (max(t - base_s, 0.0) / copies for t in with_copies_s)
    per_byte = max(large - small, 0.0) / (sizes[1] - sizes[0])
    return max(small - per_byte * sizes[0], 0.0), per_byte
