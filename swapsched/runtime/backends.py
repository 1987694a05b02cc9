"""Copy primitives under the swap runtime: CUDA streams, or an emulated device on the CPU.

Both backends move *storages* as flat ``uint8`` buffers (so views, non-contiguous tensors and
several dtypes need nothing special) and hand back a :class:`Ticket` per copy (``copy_engine.py``,
with the emulated device's engine threads). The plan-execution
logic in ``runtime/swapper.py`` is the same above both; only these primitives differ.

**Who keeps what alive during a copy** (the classic offloading bug is a tensor freed on the compute
stream while a side-stream copy still reads it):

- swap-out: the ``Ticket`` holds the source device storage until the copy is complete; the swapper
  drops it once ``done()`` is true, or, when it needs the room sooner, right after making the
  compute stream wait for the copy (``wait_for_use``: a stream wait on CUDA, as torchtune does, so
  the host does not drain the device's queue). Either way only work ordered after the copy can
  reuse the storage's memory: compute queued after the wait (the block belongs to the compute
  stream), or a swap-in buffer, whose copy waits for the swap-out's event. No ``record_stream`` is
  needed on the hot path.
- swap-in: the destination device buffer is allocated on the *compute* stream (so its lifetime is
  ordered by compute), the copy stream first waits for an event recorded after that allocation, and
  the ticket holds the pinned host buffer until the copy is complete.
- host buffers return to the pool exactly once, when the step ends and every copy is complete
  (the swapper's ``_settle``), never while a copy may still read them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import torch

from swapsched.budget import parse_budget
from swapsched.errors import UserError
from swapsched.hardware import Hardware, default_hardware, load_hardware
from swapsched.runtime.copy_engine import CopyEngine, CopyError, Ticket
from swapsched.runtime.host_pool import HostPool

__all__ = ["resolve_backend", "Ticket", "Backend", "CpuBackend", "CudaBackend", "CopyError", "make_backend",
           "runtime_devices", "lone_copy_s", "copy_wake_s"]


class Backend:
    """What the swapper needs from a device: copies out and in, completion, waiting, memory, and
    what the device can tell (its capabilities), so that nothing above branches on a name.

    ``device_type``: where the "device" tensors live (``"cpu"`` for the emulated device), which is
    also the clock of the profiling steps. ``emulated``: the device is the host itself, so compute
    is synchronous and timed by the host clock between hooks (executed steps can re-time the
    trace), and memory is what the runtime accounts, measured from the storages' own lifetimes (no
    allocator to ask)."""

    name = "abstract"
    device_type = "cpu"
    emulated = True
    pool: HostPool  # the host buffers swapped tensors go to (R11's limit on them)
    # what the executing step reads around each hook (R6/R8's host costs, retime.py): copies
    # issued so far, whoever issued them (the activations' and the state mover's), and the host's
    # seconds blocked in ``wait_host`` (a CUDA ``wait_for_use`` blocks the device, not the host)
    issued: int = 0
    waited_s: float = 0.0

    def synchronize(self) -> None:
        """Wait until the device has run everything queued (step boundaries only)."""

    def reset_peak(self) -> None:
        """Start the device allocator's peak over (a real device's)."""

    def peak_bytes(self) -> int | None:
        """The device allocator's peak since ``reset_peak``; None on the emulated device."""
        return None

    def memory(self) -> tuple[int, int]:
        """(the device's capacity, the bytes the process holds on it now), for ``budget="device"``:
        a real device's alone (the runtime refuses that budget on the emulated one)."""
        raise NotImplementedError("the emulated device has no capacity of its own")

    def mark(self) -> Any:
        """A point in the device's compute order (the host clock on the emulated device)."""
        return time.perf_counter()

    def elapsed_s(self, a: Any, b: Any) -> float:
        """Seconds of device time from mark ``a`` to mark ``b`` (valid once the device ran both)."""
        return float(b - a)

    def link(self) -> str:
        """The link the copies take, in words (what tells rows of a comparison apart)."""
        return "the device's"

    def copy_out(self, src: torch.Tensor) -> Ticket:
        """Device ``src`` (a flat ``uint8`` storage) into a buffer of the host pool."""
        raise NotImplementedError

    def copy_in(self, host: torch.Tensor, after: Ticket | None, device: Any = None) -> Ticket:
        """Back to ``device`` (default: the device ``after`` copied from), into a new buffer."""
        raise NotImplementedError

    def copy_out_into(self, src: torch.Tensor, host: torch.Tensor) -> Ticket:
        """Device ``src`` into the existing host tensor ``host`` (same shape and dtype), on the
        swap-out engine (a swap-out's pool buffer, or the training state's host master, R14)."""
        raise NotImplementedError

    def copy_in_into(self, host: torch.Tensor, dst: torch.Tensor, after: Ticket | None = None) -> Ticket:
        """Host ``host`` into the existing device tensor ``dst`` (a swap-in's new buffer, or a
        parameter's own storage, which saved views share, R14), on the swap-in engine, not before
        ``after`` completed."""
        raise NotImplementedError

    def done(self, t: Ticket) -> bool:
        raise NotImplementedError

    def wait_host(self, t: Ticket) -> None:
        """Block the host until the copy is complete."""
        raise NotImplementedError

    def wait_for_use(self, t: Ticket) -> None:
        """Make the compute that follows wait for the copy (host wait on CPU, stream wait on CUDA)."""
        raise NotImplementedError

    def take_device_stall_s(self) -> float:
        """Seconds the device's compute waited on copies since the last call, beyond what the host
        measured by waiting itself (0 where every wait is a host wait)."""
        return 0.0

    def copy_out_now(self, src: torch.Tensor) -> torch.Tensor:
        """A synchronous swap-out (the profiling steps): the host buffer, complete on return."""
        t = self.copy_out(src)
        self.wait_host(t)
        return t.dst

    def copy_in_now(self, host: torch.Tensor, device: Any = None) -> torch.Tensor:
        """A synchronous swap-in (the profiling steps): the device buffer, complete on return."""
        t = self.copy_in(host, None, device)
        self.wait_host(t)
        return t.dst

    def recover(self) -> None:
        """After a copy that did not complete: make the next step's copies independent of it."""

    def shutdown(self) -> None:
        pass


class CpuBackend(Backend):
    """The emulated device: "device" tensors are ordinary CPU tensors whose bytes the swapper
    accounts against the budget; a swap-out copies a storage into a buffer of a separate host pool
    and drops the original, so process memory really falls. One engine thread per direction, each
    optionally throttled to a bandwidth so copies take link-like time and overlap is real."""

    name = "cpu"

    def __init__(self, d2h_bytes_per_s: float | None = None, h2d_bytes_per_s: float | None = None,
                 latency_s: float = 0.0, copy_timeout_s: float = 60.0):
        # an infinite bandwidth means "not throttled"
        d2h_bytes_per_s = None if d2h_bytes_per_s in (None, float("inf")) else d2h_bytes_per_s
        h2d_bytes_per_s = None if h2d_bytes_per_s in (None, float("inf")) else h2d_bytes_per_s
        self.pool = HostPool(pin=False)
        self.rates = (d2h_bytes_per_s, h2d_bytes_per_s, latency_s)
        self.copy_timeout_s = copy_timeout_s
        self.wake_s = 0.0  # measure_wake's figure, once measured
        self._start_engines()

    def measure_wake(self) -> float:
        """R6's ``copy_wake_s`` of these engines, measured (and kept in ``wake_s``): how much later
        than their latency and bytes say a copy that finds its engine idle ends, as its waiter
        sees it (the engine thread's wake-up, its sleep's late end, the waiter's wake-up; queued
        copies keep the rate, see CopyEngine). 0 for unthrottled engines. ~20 ms."""
        d2h, h2d, latency_s = self.rates
        if d2h and h2d:
            self.wake_s = copy_wake_s(self, 2**12, (latency_s, d2h), (latency_s, h2d))
        return self.wake_s

    def _start_engines(self) -> None:
        d2h, h2d, latency_s = self.rates
        self.d2h = CopyEngine("swapsched-d2h", d2h, latency_s)
        self.h2d = CopyEngine("swapsched-h2d", h2d, latency_s)

    def recover(self) -> None:
        """After a copy that never completed: leave the stuck engines (daemon threads; what they
        hold is never given back to the pool) and start fresh ones for the next step."""
        for engine in (self.d2h, self.h2d):
            engine.stop()
        self._start_engines()

    def copy_out(self, src: torch.Tensor) -> Ticket:
        return self.copy_out_into(src, self.pool.take(src.numel()))

    def copy_in(self, host: torch.Tensor, after: Ticket | None, device: Any = None) -> Ticket:
        return self.copy_in_into(host, torch.empty(host.numel(), dtype=torch.uint8), after)

    def copy_out_into(self, src: torch.Tensor, host: torch.Tensor) -> Ticket:
        t = Ticket(src.numel() * src.element_size(), src=src, dst=host, done_event=threading.Event())
        self.issued += 1

        def copy() -> None:
            host.copy_(src)
            t.src = None  # the source is free to go once copied

        self.d2h.submit(t, copy)
        return t

    def copy_in_into(self, host: torch.Tensor, dst: torch.Tensor, after: Ticket | None = None) -> Ticket:
        t = Ticket(host.numel() * host.element_size(), src=host, dst=dst, after=after, done_event=threading.Event())
        self.issued += 1
        self.h2d.submit(t, lambda: dst.copy_(host))
        return t

    def done(self, t: Ticket) -> bool:
        return t.done_event.is_set()

    def wait_host(self, t: Ticket) -> None:
        if not t.done_event.is_set():
            t0 = time.perf_counter()
            completed = t.done_event.wait(self.copy_timeout_s)
            self.waited_s += time.perf_counter() - t0
            if not completed:
                raise CopyError(f"did not complete in {self.copy_timeout_s:g} s")
        if t.error is not None:
            raise CopyError(f"failed: {t.error}") from t.error

    wait_for_use = wait_host

    # The profiling steps' copies are hook time, left out of the trace's gaps, so they need no link
    # emulation. Done in the calling thread, without the engine's throttle, so the compute measured
    # after them is not slowed by a wait of link length (a host thread woken after milliseconds
    # asleep runs its next kernels measurably slower, which inflated every profiled gap).
    def copy_out_now(self, src: torch.Tensor) -> torch.Tensor:
        host = self.pool.take(src.numel())
        host.copy_(src)
        return host

    def link(self) -> str:
        d2h, h2d, _ = self.rates
        if d2h is None and h2d is None:
            return "emulated, unthrottled"
        rate = f"{(d2h or 0) / 1e9:.3g} GB/s" if d2h == h2d else f"{(d2h or 0) / 1e9:.3g}/{(h2d or 0) / 1e9:.3g} GB/s"
        return f"emulated, {rate}"

    def copy_in_now(self, host: torch.Tensor, device: Any = None) -> torch.Tensor:
        return host.clone()

    def shutdown(self) -> None:
        for engine in (self.d2h, self.h2d):
            engine.stop()
        for engine in (self.d2h, self.h2d):
            engine.join(timeout=5.0)


class CudaBackend(Backend):
    """Two copy streams named by role per device, an event per copy, a pinned pool; never
    synchronizes the device on the hot path. The device of each copy is the tensor's own (a model
    on ``cuda:1`` while ``cuda:0`` is current gets its copies on ``cuda:1``'s streams)."""

    name = "cuda"
    device_type = "cuda"
    emulated = False

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device))

    def memory(self) -> tuple[int, int]:
        return int(torch.cuda.get_device_properties(self.device).total_memory), int(torch.cuda.memory_allocated(self.device))

    def mark(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))  # the compute stream, as the step runs it
        return ev

    def elapsed_s(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1e3  # ms between two recorded events

    def __init__(self, device: torch.device | int | None = None):
        if not torch.cuda.is_available():
            raise UserError("backend 'cuda' needs a CUDA device; use backend='cpu' here")
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index or 0)
        self.streams: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self.pool = HostPool(pin=True)
        # timing events around each stream wait on the compute stream: the wait is on the device,
        # so the host clock cannot see the stall (take_device_stall_s reads them)
        self.device_waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """(swap-outs: device -> pinned host, swap-ins: pinned host -> device) of ``device``."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        pair = self.streams.get(idx)
        if pair is None:
            pair = self.streams[idx] = (torch.cuda.Stream(idx), torch.cuda.Stream(idx))
        return pair

    def copy_out(self, src: torch.Tensor) -> Ticket:
        return self.copy_out_into(src, self.pool.take(src.numel()))

    def copy_in(self, host: torch.Tensor, after: Ticket | None, device: Any = None) -> Ticket:
        device = torch.device(device) if device is not None else (after.device if after is not None else self.device)
        dev = torch.empty(host.numel(), dtype=torch.uint8, device=device)  # owned by compute
        return self.copy_in_into(host, dev, after)

    def copy_out_into(self, src: torch.Tensor, host: torch.Tensor) -> Ticket:
        device = src.device
        d2h_stream = self._streams(device)[0]
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(device))  # the producer kernels were queued on compute before this point
        # wait_stream/wait_event on the copy stream itself; the "current" stream inside the
        # context is the copy stream, so never call current_stream() in there
        d2h_stream.wait_event(produced)
        with torch.cuda.stream(d2h_stream):
            host.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(d2h_stream)
        self.issued += 1
        # the ticket holds src until the copy is complete (the swapper frees it only then)
        return Ticket(src.numel() * src.element_size(), src=src, dst=host, done_event=done, device=device)

    def copy_in_into(self, host: torch.Tensor, dst: torch.Tensor, after: Ticket | None = None) -> Ticket:
        device = dst.device
        h2d_stream = self._streams(device)[1]
        allocated = torch.cuda.Event()
        allocated.record(torch.cuda.current_stream(device))  # dst was (re)allocated on compute before this
        h2d_stream.wait_event(allocated)
        if after is not None:  # a swap-in never starts before its swap-out completed (R6)
            h2d_stream.wait_event(after.done_event)
        with torch.cuda.stream(h2d_stream):
            dst.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(h2d_stream)
        self.issued += 1
        return Ticket(host.numel() * host.element_size(), src=host, dst=dst, after=after, done_event=done, device=device)

    def done(self, t: Ticket) -> bool:
        return t.done_event.query()

    def wait_host(self, t: Ticket) -> None:
        t0 = time.perf_counter()
        t.done_event.synchronize()
        self.waited_s += time.perf_counter() - t0

    def wait_for_use(self, t: Ticket) -> None:
        compute = torch.cuda.current_stream(t.device)
        if t.done_event.query():
            return  # already complete: compute will not wait
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(t.done_event)
        after.record(compute)  # reached once the copy completed: after - before is the stall
        self.device_waits.append((before, after))

    def take_device_stall_s(self) -> float:
        waits, self.device_waits = self.device_waits, []
        if not waits:
            return 0.0
        waits[-1][1].synchronize()  # recorded in order on one stream: the last completes last
        return sum(before.elapsed_time(after) for before, after in waits) / 1e3  # elapsed_time is in ms


def resolve_backend(name: str | None) -> str:
    """The one place that picks a backend: ``cuda`` when available unless told otherwise; a
    request for ``cuda`` where there is none is a user error."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise UserError(f"unknown backend {name!r}; use 'cpu' or 'cuda'")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("backend 'cuda': no CUDA device is available here; use backend 'cpu'")
    return name


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

    def lone(copy: Any, args: tuple[Any, ...], times: list[float]) -> Ticket:
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


def make_backend(name: str | None, hardware: Any = None) -> Backend:
    """The backend ``resolve_backend(name)`` picks; the CPU backend's engines are throttled to
    ``hardware``'s link (unthrottled without one, or with an infinite bandwidth)."""
    name = resolve_backend(name)
    if name == "cuda":
        return CudaBackend()
    if name == "cpu":
        if hardware is not None:
            return CpuBackend(hardware.d2h_bytes_per_s, hardware.h2d_bytes_per_s, hardware.copy_latency_s)
        return CpuBackend()
    raise UserError(f"unknown backend {name!r}; use 'cpu' or 'cuda'")


def runtime_devices(name: str, backend: Backend | None, hardware: Hardware | str | None, bandwidth: float | None,
                    host_budget: str | int | None) -> tuple[Hardware, Backend]:
    """The runtime's hardware profile (what it plans for) and backend (what copies), from its
    arguments (``PolicyRuntime``'s docstring): ``name`` is ``resolve_backend``'s pick, ``backend``
    one given as an object."""
    if bandwidth is not None and not bandwidth > 0:
        raise UserError(f"bandwidth must be positive bytes/s, got {bandwidth!r}")
    if hardware is None:
        hw = load_hardware(default_hardware(name))
        if bandwidth is not None:  # plan for the link the copies really get
            hw = replace(hw, name=f"{hw.name}@{bandwidth:.3g}B/s", d2h_bytes_per_s=bandwidth, h2d_bytes_per_s=bandwidth)
    else:
        hw = load_hardware(hardware)  # e.g. a calibrated profile: used for planning as it is
    if host_budget is not None:  # R11: the host bytes swapped tensors may hold; plans and the pool keep to it
        if isinstance(host_budget, str) and host_budget.strip().endswith("%"):
            raise UserError(f"host_budget {host_budget!r}: give bytes, like '64GiB' (pinned host memory for this rank)")
        hw = hw.with_host(host_budget_bytes=parse_budget(host_budget))
    if backend is not None:
        out = backend
    elif name == "cpu" and bandwidth is not None and hardware is not None:
        out = CpuBackend(bandwidth, bandwidth, 0.0)  # the link alone; its latency was measured
    else:
        out = make_backend(name, hw)
    if hardware is None and backend is None and isinstance(out, CpuBackend):
        # the shipped profile's latency is the engines' throttle: what they add to a lone copy
        # beyond it is measured now (a calibrated profile has measured its own; a backend given
        # as an object is the caller's to measure)
        hw = replace(hw, copy_wake_s=out.measure_wake())
    pool = getattr(out, "pool", None)  # a backend given as an object may keep no pool
    if pool is not None:
        pool.limit = hw.host_budget_bytes
    return hw, out
