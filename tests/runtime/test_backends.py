"""runtime/backends.py: the emulated device's copy engines; the CUDA backend (marked gpu)."""

from __future__ import annotations

import time

import pytest
import torch

from swapsched.deploy import SwapRuntime
from swapsched.runtime.backends import CpuBackend
from swapsched.runtime.host_pool import HostPool
from swapsched.zoo import build_model
from tests.conftest import step_reports


def test_throttled_copies_take_link_time_and_round_trip_exactly():
    be = CpuBackend(d2h_bytes_per_s=1e8, h2d_bytes_per_s=2e8, latency_s=0.01)
    src = torch.randint(0, 255, (4_000_000,), dtype=torch.uint8)
    t0 = time.perf_counter()
    out = be.copy_out(src)
    back = be.copy_in(out.dst, after=out)  # queued at once: must wait for the swap-out (R6)
    be.wait_host(back)
    took = time.perf_counter() - t0
    # 0.01 + 4e6/1e8 = 0.05 s out, then 0.01 + 4e6/2e8 = 0.03 s in
    assert took >= 0.08 - 1e-3
    assert back.start_s >= out.end_s
    assert torch.equal(back.dst, src)
    be.shutdown()


def test_engine_runs_copies_one_at_a_time_in_issue_order():
    be = CpuBackend(d2h_bytes_per_s=1e8)
    tickets = [be.copy_out(torch.zeros(1_000_000, dtype=torch.uint8)) for _ in range(3)]
    for t in tickets:
        be.wait_host(t)
    for a, b in zip(tickets, tickets[1:], strict=False):
        assert b.start_s >= a.end_s
    be.shutdown()


def test_pinned_pool_counts_the_power_of_two_blocks_the_pinned_allocator_holds():
    # no allocation here: the rounding is the pool's own arithmetic (pinning itself needs CUDA)
    pinned, pageable = HostPool(pin=True), HostPool(pin=False)
    assert [pinned.held_bytes(n) for n in (1, 100, 128, 129, 3 * 2**20)] == [1, 128, 128, 256, 4 * 2**20]
    assert pageable.held_bytes(100) == 100


def test_host_pool_reuses_by_size():
    pool = HostPool(pin=False)
    a = pool.take(100)
    pool.give(a)
    assert pool.take(100) is a and pool.allocated_bytes == 100
    pool.take(100)
    assert pool.allocated_bytes == 200


def test_backends_say_what_they_can_so_nothing_branches_on_their_name():
    from swapsched.runtime.backends import Backend, CudaBackend

    cpu = CpuBackend()
    try:
        # the emulated device: host-timed compute, no allocator to ask, synchronizing is a no-op
        assert cpu.emulated and cpu.device_type == "cpu" and cpu.peak_bytes() is None
        cpu.synchronize()
        cpu.reset_peak()
    finally:
        cpu.shutdown()
    # the CUDA backend's own answers (class attributes and overrides: no device needed to read them)
    assert not CudaBackend.emulated and CudaBackend.device_type == "cuda"
    for name in ("synchronize", "reset_peak", "peak_bytes", "copy_out", "copy_in", "done", "wait_host", "wait_for_use"):
        assert getattr(CudaBackend, name) is not getattr(Backend, name), name


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("family", ["mlp", "resnet", "gpt"])
def test_cuda_gradients_bit_identical_and_peak_near_budget(family, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # restored after the test
    a = build_model(family, "small", seed=1, device="cuda")
    b = build_model(family, "small", seed=1, device="cuda")
    rt = SwapRuntime(budget="50%", policy="capuchin", backend="cuda", model=a.model, min_bytes=0, audit=True)
    for _ in range(4):
        with rt.step():
            la = a.loss()
            la.backward()
        lb = b.loss()
        lb.backward()
        torch.cuda.synchronize()
        assert torch.equal(la, lb)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=False))
    rep = rt.report()
    assert rep.mode == "execute" and rep.peak_device_bytes <= rep.budget_bytes
    assert rep.cuda_peak_bytes is not None  # reported beside the accounting (allocator slack)
    # the memory really held, from the allocator, within the budget plus what the runtime does not
    # own (the batch, autocast casts) and the allocator's rounding of each block to 512 B
    assert rep.measured_peak_bytes is not None
    assert rep.measured_peak_bytes <= rep.budget_bytes + rep.unowned_bytes + 512 * rt.trace.n_tensors


@pytest.mark.gpu
@cuda
def test_cuda_pinned_pool_stops_allocating_after_warmup():
    case = build_model("gpt", "small", seed=2, device="cuda")
    rt = SwapRuntime(budget="40%", policy="swap-all", backend="cuda", model=case.model, min_bytes=0)
    sizes = []
    for _ in range(6):
        with rt.step():
            case.loss().backward()
        sizes.append(rt.backend.pool.allocated_bytes)
    assert len(set(sizes[3:])) == 1  # steady state: no cudaHostAlloc
    assert all(b.is_pinned() for bs in rt.backend.pool.free.values() for b in bs)


@pytest.mark.gpu
@cuda
def test_cuda_copy_streams_are_not_the_compute_stream():
    from swapsched.runtime.backends import CudaBackend

    be = CudaBackend()
    compute = torch.cuda.current_stream()
    d2h_stream, h2d_stream = be._streams(torch.device("cuda"))
    assert d2h_stream != compute and h2d_stream != compute and d2h_stream != h2d_stream
    x = torch.randn(1 << 20, device="cuda")
    flat = torch.empty(0, dtype=torch.uint8, device="cuda").set_(x.untyped_storage())
    out = be.copy_out(flat)
    del x, flat  # the ticket keeps the device storage alive until the copy completes
    torch.cuda.empty_cache()
    back = be.copy_in(out.dst, out)
    be.wait_for_use(back)
    assert torch.cuda.current_stream() == compute  # no stream context leaked
    torch.cuda.synchronize()
    assert torch.equal(back.dst.cpu(), out.dst)


@pytest.mark.gpu
@cuda
def test_cuda_calibration_measures_the_link_and_the_host_costs():
    from swapsched.runtime.calibrate import calibrate

    hw = calibrate("cuda").hardware
    assert hw.d2h_bytes_per_s > 1e9 and hw.h2d_bytes_per_s > 1e9  # any PCIe or C2C link
    assert min(hw.hook_cost_s, hw.copy_issue_s, hw.copy_host_s_per_byte, hw.wait_resume_s) >= 0


@pytest.mark.gpu
@cuda
def test_cuda_stall_is_measured_on_the_device():
    """The compute stream's wait is on the device, where the host clock cannot see it."""
    from swapsched.runtime.backends import CudaBackend

    be = CudaBackend()
    host = torch.ones(256 << 20, dtype=torch.uint8).pin_memory()
    t = be.copy_in(host, None)
    be.wait_for_use(t)  # compute waits for a 256 MiB copy: a millisecond or more on any link
    assert be.take_device_stall_s() > 1e-4
    assert be.take_device_stall_s() == 0.0  # each wait is counted once
    assert torch.equal(t.dst[-4:].cpu(), host[-4:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_copies_run_on_the_tensors_own_device():
    """A model on cuda:1 while cuda:0 is current: its swap-in comes back to cuda:1, on cuda:1's
    streams (it used to go to the current device)."""
    from swapsched.runtime.backends import CudaBackend

    be = CudaBackend()
    x = torch.randn(1 << 16, device="cuda:1")
    flat = torch.empty(0, dtype=torch.uint8, device="cuda:1").set_(x.untyped_storage())
    out = be.copy_out(flat)
    back = be.copy_in(out.dst, out)
    be.wait_host(back)
    assert back.dst.device == torch.device("cuda:1") and out.device == torch.device("cuda:1")
    assert torch.equal(back.dst, flat)


@pytest.mark.gpu
@cuda
def test_cuda_retimes_its_trace_from_executed_steps_with_timing_events():
    """Finding 8 of issue 15: the first executed steps mark each hook in the compute order; the
    trace is re-timed from those device gaps once, and later steps mark nothing."""
    case = build_model("gpt", "small", seed=2, device="cuda")
    rt = SwapRuntime(budget="50%", policy="min", backend="cuda", model=case.model, min_bytes=0, retime_steps=2)
    reports = step_reports(rt, case, 6)
    trace = rt.trace
    rt.close()
    assert [r.mode for r in reports] == ["profile"] * 3 + ["execute"] * 3
    assert reports[3].gaps_s is not None and reports[4].gaps_s is not None and reports[5].gaps_s is None
    assert trace.meta["timed_by_execution"] == 2 and len(reports[3].gaps_s) == trace.n_events
    assert all(g >= 0 for g in reports[3].gaps_s) and sum(reports[3].gaps_s) <= reports[3].step_s


def test_plans_for_the_shipped_profile_count_the_emulated_engines_wake_up():
    # a throttled CPU backend measures what a lone copy takes beyond its throttle (R6's
    # copy_wake_s): the shipped profile gains it, its latency (the throttle) unchanged; a
    # calibrated (given) profile is used as it is
    from swapsched.hardware import default_hardware, load_hardware
    from swapsched.runtime.backends import lone_copy_s, runtime_devices

    nominal = load_hardware(default_hardware("cpu"))
    hw, backend = runtime_devices("cpu", None, None, 1e9, None)
    try:
        # a thread's wake-up is tens of microseconds on any machine, and far below a millisecond
        assert 1e-6 < backend.wake_s < 5e-3
        assert hw.copy_wake_s == backend.wake_s and hw.copy_latency_s == nominal.copy_latency_s
        out_s, in_s = lone_copy_s(backend, 2**12)
        assert min(out_s, in_s) >= nominal.copy_latency_s + 2**12 / 1e9  # the throttle holds a lone copy
    finally:
        backend.shutdown()
    given, backend = runtime_devices("cpu", None, "cpu-emulated", None, None)
    try:
        assert given.copy_latency_s == nominal.copy_latency_s and given.copy_wake_s == 0.0
    finally:
        backend.shutdown()
