"""Measure this machine's link and hook cost into a Hardware profile (``swapsched calibrate``).

- **Link**: copies of 64 KiB to 32 MiB through the backend's own copy engines (the CPU backend's
  threads, throttled or not; the CUDA backend's streams and pinned pool), timed end to end from
  the host. A least-squares fit of ``time = latency + bytes / bandwidth`` per direction gives the
  two numbers the simulator uses (R6). What the host sees includes thread wake-up (CPU) or launch
  and event latency (CUDA), which is exactly what a plan pays.
- **Hook cost**: the same model trained with the runtime executing a no-eviction plan and without
  it, alternating steps; the median difference per saved-tensor event is ``hook_cost_s``, which the
  simulator adds to every gap.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from swapsched.hardware import Hardware, load_hardware
from swapsched.runtime.backends import Backend, CpuBackend, CudaBackend

__all__ = ["Calibration", "calibrate_link", "calibrate_hooks", "calibrate"]

SIZES = [2**16, 2**18, 2**20, 2**22, 2**24, 2**25]


@dataclass(frozen=True)
class Calibration:
    hardware: Hardware
    d2h_points: tuple[tuple[int, float], ...]
    h2d_points: tuple[tuple[int, float], ...]
    hook_s_per_event: float


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``t = a + b * bytes``: (latency s, bandwidth B/s)."""
    x = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    b, a = np.polyfit(x, y, 1)
    return max(float(a), 0.0), 1.0 / max(float(b), 1e-15)


def calibrate_link(backend: Backend, repeats: int = 5) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    device = "cuda" if backend.name == "cuda" else "cpu"
    d2h, h2d = [], []
    for n in SIZES:
        src = torch.empty(n, dtype=torch.uint8, device=device).fill_(7)
        outs, ins = [], []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            t = backend.copy_out(src)
            backend.wait_host(t)
            outs.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            back = backend.copy_in(t.dst, None)
            backend.wait_host(back)
            ins.append(time.perf_counter() - t0)
            backend.pool.give(t.dst)
        d2h.append((n, statistics.median(outs)))
        h2d.append((n, statistics.median(ins)))
    return d2h, h2d


def calibrate_hooks(backend_name: str, bandwidth: float | None = None, steps: int = 20) -> float:
    """Median per-event cost of the runtime's hooks executing a plan that evicts nothing."""
    from swapsched.runtime.swapper import SwapRuntime
    from swapsched.zoo import build_model

    device = "cuda" if backend_name == "cuda" else "cpu"
    case = build_model("gpt", "tiny", device=device)
    rt = SwapRuntime(budget="100%", policy="no-swap", backend=backend_name, model=case.model, bandwidth=bandwidth)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(rt.profile_steps + 2):
        with rt.step():
            case.loss().backward()
    diffs = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        case.loss().backward()
        sync()
        plain = time.perf_counter() - t0
        t0 = time.perf_counter()
        with rt.step():
            case.loss().backward()
        sync()
        diffs.append(time.perf_counter() - t0 - plain)
        case.model.zero_grad(set_to_none=True)
    n = rt.trace.n_events
    rt.close()
    return max(statistics.median(diffs) / n, 0.0)


def calibrate(backend_name: str = "cpu", bandwidth: float | None = None, name: str | None = None,
              base: str = "cpu-emulated") -> Calibration:
    """Measure link and hooks; the result keeps ``base``'s compute peaks (used for roofline only)."""
    ref = load_hardware(base if backend_name == "cpu" else "h100-pcie5")
    # the CPU engines throttled to the bandwidth alone (no added latency): the latency measured is
    # what the machine adds, thread wake-up included; unthrottled without a bandwidth
    backend = CpuBackend(bandwidth, bandwidth, 0.0) if backend_name == "cpu" else CudaBackend()
    try:
        d2h, h2d = calibrate_link(backend)
    finally:
        backend.shutdown()
    lat_d, bw_d = _fit(d2h)
    lat_h, bw_h = _fit(h2d)
    hook = calibrate_hooks(backend_name, bandwidth)
    mem = torch.cuda.get_device_properties(0).total_memory if backend_name == "cuda" else ref.device_memory_bytes
    hw = Hardware(
        name=name or f"calibrated-{backend_name}", d2h_bytes_per_s=bw_d, h2d_bytes_per_s=bw_h,
        copy_latency_s=(lat_d + lat_h) / 2, device_memory_bytes=int(mem), peak_flops=ref.peak_flops,
        memory_bytes_per_s=ref.memory_bytes_per_s, hook_cost_s=hook,
    )
    return Calibration(hw, tuple(d2h), tuple(h2d), hook)
