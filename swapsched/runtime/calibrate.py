"""Measure this machine's link and the runtime's host costs into a Hardware profile (``swapsched calibrate``).

- **Link**: copies of 64 KiB to 32 MiB through the backend's own copy engines (the CPU backend's
  threads, throttled or not; the CUDA backend's streams and pinned pool), queued four at a time
  and timed from the host. A least-squares fit of ``time = latency + bytes / bandwidth`` per
  direction gives the two numbers the simulator uses (R6). The latency is what each queued copy
  costs beyond its bytes: the CPU engine's own loop and its sleep's overshoot, or CUDA's launch
  and event latency. Then lone 64 KiB copies, each to an idle engine: what they take beyond the
  fit is ``copy_wake_s`` (R6: the engine's and the waiter's wake-ups).
- **Host costs** (``calibrate_host``): the runtime's own time inside its hooks per saved-tensor
  event, executing a no-eviction plan; the simulator adds it to every gap. PyTorch's cost of
  calling a Python hook at all is not in it: that lands between hooks, in the trace's gaps, both
  when profiling and when executing. Then, executing plans that copy on two fixed workloads, the
  time the compute thread loses per copy issued, per byte copied and per wait for a copy, which
  the simulator charges to it.
- **Host optimizer** (``host_optimizer_rate``, R15): torch's fused CPU AdamW stepping 16 tensors
  of 1M fp32 parameters, the median of five steps after a warm-up: the rate at which this host
  steps the state groups a plan places there.
- **Collectives** (``calibrate_collectives``, R18), where a process group is up (the caller's, or
  ``world_size`` ranks ``calibrate`` starts on this machine: gloo on the CPU, NCCL on CUDA):
  all-gathers of 1 to 64 MiB in all, timed on every rank after a barrier, the slowest rank's
  median of five; a least-squares fit of ``time = latency + S (N - 1) / N / bandwidth`` gives the
  bus bandwidth and latency a sharded step's collectives run at.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from swapsched.errors import UserError
from swapsched.hardware import DEFAULT_GPU_HARDWARE, Hardware, load_hardware
from swapsched.plan import Eviction, SwapPlan, on_demand_plan
from swapsched.runtime.backends import Backend, CpuBackend, CudaBackend, copy_wake_s
from swapsched.runtime.disk_store import measure_disk
from swapsched.runtime.swapper import PolicyRuntime
from swapsched.trace import Trace
from swapsched.zoo import ModelCase, build_model

if TYPE_CHECKING:
    from swapsched.runtime.reports import StepReport

__all__ = ["Calibration", "HostCosts", "calibrate_link", "calibrate_host", "calibrate", "execute_in_rounds",
           "training_step", "host_optimizer_rate", "calibrate_state_hook"]

SIZES = [2**16, 2**18, 2**20, 2**22, 2**24, 2**25]


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured: the profile, the copy timings it was fitted to, and where each
    of the profile's numbers came from (written beside it as YAML comments)."""

    hardware: Hardware
    d2h_points: tuple[tuple[int, float], ...]
    h2d_points: tuple[tuple[int, float], ...]
    host: HostCosts
    provenance: dict[str, str] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        return self.hardware.save(path, comments=self.provenance)


def _provenance(backend_name: str) -> dict[str, str]:
    src = f"measured by swapsched calibrate --backend {backend_name} on {time.strftime('%Y-%m-%d')}"
    sizes = f"{SIZES[0] // 2**10} KiB..{SIZES[-1] // 2**20} MiB copies"
    work = " and ".join(f"{m}-{s}" for m, s in WORKLOADS)
    return {
        "d2h_bytes_per_s": f"{src}: least-squares fit over {sizes}",
        "h2d_bytes_per_s": f"{src}: least-squares fit over {sizes}",
        "copy_latency_s": f"{src}: intercept of the fits, both directions averaged",
        "copy_wake_s": f"{src}: lone {SIZES[0] // 2**10} KiB copies (engine idle) beyond the fits, median of 5, "
                       "both directions averaged",
        "device_memory_bytes": "the emulated device's nominal size" if backend_name == "cpu" else "torch.cuda device properties",
        "peak_flops": "copied from the base profile (roofline retiming only)",
        "bf16_peak_flops": "copied from the base profile (roofline retiming only)",
        "fp16_peak_flops": "copied from the base profile (roofline retiming only)",
        "memory_bytes_per_s": "copied from the base profile (roofline retiming only)",
        "hook_cost_s": f"{src}: the runtime's own time in its hooks per saved-tensor event, no eviction (median)",
        "copy_issue_s": f"{src}: step time added per copy issued (least squares, {work})",
        "wait_resume_s": f"{src}: step time added per wait for a copy (least squares, {work})",
        "copy_host_s_per_byte": f"{src}: step time added per byte copied (least squares, {work})",
        "state_hook_s": f"{src}: the state mover's time per parameter tensor, beyond copy_issue_s per copy (median over "
                        "executed steps of gpt-tiny, AdamW, every group full)",
        "host_optimizer_params_per_s": f"{src}: torch.optim.AdamW(fused=True) on the CPU, 16 x 1M fp32 parameters, "
                                       "median of 5 steps (R15)",
    }


def host_optimizer_rate(tensors: int = 16, size: int = 2**20, steps: int = 5) -> float:
    """R15: parameters a second the host's fused AdamW steps (module docstring)."""
    params = [torch.nn.Parameter(torch.randn(size)) for _ in range(tensors)]
    for q in params:
        q.grad = torch.randn_like(q)
    try:
        opt = torch.optim.AdamW(params, fused=True)
        opt.step()
    except RuntimeError:  # a torch without the fused CPU kernel: its default (foreach) step
        opt = torch.optim.AdamW(params)
        opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return tensors * size / statistics.median(times)


#: R18: the all-gathers ``calibrate_collectives`` times, in bytes gathered (every rank's shard)
COLLECTIVE_SIZES = tuple(2**k for k in range(20, 27, 2))


def calibrate_collectives(device: str = "cpu", repeats: int = 5) -> tuple[float, float, list[tuple[int, float]]]:
    """R18: (latency s, bus bandwidth B/s, (bytes each rank moves, seconds) points) of
    all-gathers over the process group that is up (module docstring); every rank calls it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UserError("calibrating collectives needs a process group: torch.distributed.init_process_group first, "
                        "or swapsched calibrate --world-size N")
    world = dist.get_world_size()
    if world < 2:
        raise UserError("calibrating collectives needs at least 2 ranks")
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # the name torch 2.13 prefers
    points = []
    for size in COLLECTIVE_SIZES:
        shard = torch.ones(size // 4 // world, dtype=torch.float32, device=device)
        out = torch.empty(shard.numel() * world, dtype=torch.float32, device=device)
        gather(out, shard)  # warm-up: the connections and buffers
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            gather(out, shard)
            if device != "cpu":
                torch.cuda.synchronize()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the collective ends when its slowest rank does
            times.append(float(took))
        points.append((out.numel() * 4 * (world - 1) // world, statistics.median(times)))
    latency, bandwidth = _fit(points)
    return latency, bandwidth, points


def _collective_worker(rank: int, world: int, port: int, device: str, out: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world)
    try:
        if device != "cpu":
            torch.cuda.set_device(rank)
        result = calibrate_collectives(device if device == "cpu" else f"cuda:{rank}")
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on this machine nothing listens on now (for the ranks' rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def measure_collectives(world_size: int, backend_name: str = "cpu") -> tuple[float, float, list[tuple[int, float]]]:
    """R18: :func:`calibrate_collectives` over ``world_size`` ranks started on this machine."""
    import tempfile

    import torch.multiprocessing as mp

    if backend_name == "cuda" and torch.cuda.device_count() < world_size:
        raise UserError(f"--world-size {world_size}: this machine has {torch.cuda.device_count()} CUDA devices")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "collectives.pt")
        mp.start_processes(_collective_worker, args=(world_size, free_port(), backend_name, out), nprocs=world_size,
                           join=True, start_method="spawn")
        latency, bandwidth, points = torch.load(out)
    return latency, bandwidth, points


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``t = a + b * bytes`` in relative error: (latency s, bandwidth B/s).

    Weighted by 1/t, so that each size counts alike: unweighted, the largest copies (tens of ms)
    decide the intercept, and their run-to-run noise of a fraction of a millisecond swamps the
    latency the small copies measure."""
    x = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    b, a = np.polyfit(x, y, 1, w=1.0 / y)
    return max(float(a), 0.0), 1.0 / max(float(b), 1e-15)


def calibrate_link(backend: Backend, repeats: int = 5, batch: int = 4) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Time per copy of each size and direction, with ``batch`` copies queued back to back.

    Queued, as a plan's copies mostly are: the engine goes from one copy to the next, so the
    latency fitted is what each copy costs in the queue (R6). What a lone copy adds, the
    engine's and its waiter's wake-ups, is not in it: that is ``copy_wake_s`` (``lone_copy_s``)."""
    device = backend.device_type
    d2h, h2d = [], []
    for n in SIZES:
        src = torch.empty(n, dtype=torch.uint8, device=device).fill_(7)
        outs, ins = [], []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tickets = [backend.copy_out(src) for _ in range(batch)]
            backend.wait_host(tickets[-1])
            outs.append((time.perf_counter() - t0) / batch)
            t0 = time.perf_counter()
            backs = [backend.copy_in(t.dst, None) for t in tickets]
            backend.wait_host(backs[-1])
            ins.append((time.perf_counter() - t0) / batch)
            for t in tickets:
                backend.pool.give(t.dst)
        d2h.append((n, statistics.median(outs)))
        h2d.append((n, statistics.median(ins)))
    return d2h, h2d


@dataclass(frozen=True)
class HostCosts:
    """What the compute thread itself pays on the live runtime (the Hardware fields of the same names)."""

    hook_cost_s: float  # per saved-tensor event: the runtime's own time inside its hooks
    copy_issue_s: float  # per copy issued, either direction: in the hooks and in the compute around
    copy_host_s_per_byte: float  # per byte copied, in the compute around (copies on the compute's cores)
    wait_resume_s: float  # per wait for a copy, in the compute that follows
    state_hook_s: float = 0.0  # per parameter tensor the state mover moves (R13-R16): its hooks' bookkeeping


# Fixed calibration workloads, outside the sim2real benchmark's models: many small saved tensors
# (gpt-tiny: 63 tensors, 2 MB) and few large ones (mlp-medium: 23 tensors, 24 MB), so that a cost
# per copy and a cost per byte can be told apart.
WORKLOADS = (("gpt", "tiny"), ("mlp", "medium"))


def _round_trips(trace: Trace, half: str) -> SwapPlan:
    """The ``"smaller"`` or ``"larger"`` half of the tensors by bytes, each out at its last forward
    pack and straight back: copies on both links and next to no waits. The two halves make about
    as many copies of very different sizes, which is what tells a cost per byte from a cost per copy."""
    ids = sorted(range(trace.n_tensors), key=lambda k: trace.tensors[k].bytes)
    ids = ids[: len(ids) // 2] if half == "smaller" else ids[len(ids) // 2:]
    out = trace.last_forward_pack
    ev = tuple(Eviction(k, int(out[k]), int(out[k])) for k in sorted(ids))
    return SwapPlan(trace.name, f"calibration-round-trips-{half}", ev)


def training_step(rt: PolicyRuntime, case: ModelCase) -> Callable[[], StepReport]:
    """One training step of ``case`` under ``rt``, as ``execute_in_rounds`` runs them: forward and
    backward in ``rt.step()`` (which on CUDA ends with the device), gradients cleared; its report."""

    def step() -> StepReport:
        case.timed_step(rt.step)
        case.model.zero_grad(set_to_none=True)
        return rt.report()

    return step


def execute_in_rounds(rt: PolicyRuntime, train_step: Callable[[], StepReport],
                      plans: Sequence[tuple[SwapPlan, int | None]], rounds: int, steps: int = 2,
                      seed: int = 0, on_round: Callable[[], Any] | None = None) -> list[list[list[StepReport]]]:
    """Execute each ``(plan, budget bytes or None)`` on ``rt`` in ``rounds`` rounds, the plans in
    a shuffled order each round, so that the machine's drift hits them alike: after each switch
    the steps until one executes the plan (one, or the profiling steps of a plan that recomputes,
    R9), which warms the host pool for its sizes, then ``steps`` measured ones.
    ``train_step`` runs one step under ``rt`` and returns its report. Returns the executed steps'
    reports per plan, per round."""
    reports: list[list[list[StepReport]]] = [[] for _ in plans]
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(range(len(plans)))
        rng.shuffle(order)
        for k in order:
            rt.use_plan(*plans[k])
            # warm-up: a plan that recomputes blocks first profiles the steps as they then run
            # (R9's two stages), so steps run until one executes it (it warms the host pool too)
            for _ in range(rt.profile_steps + 2):
                if train_step().mode == "execute":
                    break
            reports[k].append([r for r in (train_step() for _ in range(steps)) if r.mode == "execute"])
        if on_round is not None:
            on_round()
    return reports


def _measure_workload(model: str, size: str, backend_name: str, bandwidth: float | None,
                      rounds: int, on_round: Callable[[], Any] | None = None) -> tuple[list[list[list[StepReport]]], int]:
    """Reports of four plans on one workload (no eviction, round trips of the smaller and of the
    larger half of the tensors, swap-all) from ``execute_in_rounds``; and its event count."""
    device = "cuda" if backend_name == "cuda" else "cpu"
    case = build_model(model, size, device=device)
    # unhook=False: the no-eviction steps measure what the hooks cost, so they keep them
    rt = PolicyRuntime(budget="100%", policy=None, backend=backend_name, model=case.model, bandwidth=bandwidth, unhook=False)
    train_step = training_step(rt, case)

    try:
        for _ in range(rt.profile_steps + rt.retime_steps + 1):
            train_step()
        if rt.trace is None or rt.plan is None:
            raise UserError(f"{case.name}: its training step saved no tensor for backward, so there is nothing to "
                            "swap and nothing to calibrate on; pick a model whose loss has a backward pass")
        plans = [rt.plan, _round_trips(rt.trace, "smaller"), _round_trips(rt.trace, "larger"),
                 on_demand_plan(rt.trace, "swap-all")]
        reports = execute_in_rounds(rt, train_step, [(p, None) for p in plans], rounds, on_round=on_round)
    finally:
        rt.close()
    if not all(all(r) for r in reports):
        raise RuntimeError(f"calibrate_host: a plan on {model}-{size} never executed")
    return reports, rt.trace.n_events


def calibrate_host(backend_name: str, bandwidth: float | None = None, rounds: int = 32,
                   on_round: Callable[[], Any] | None = None) -> HostCosts:
    """Measure the runtime's host costs on the fixed ``WORKLOADS``.

    On each, four plans run (see ``_measure_workload``): one that evicts nothing, two that send
    tensors out and straight back (the smaller or the larger half by bytes: copies, next to no
    waits) and swap-all (copies and a wait at nearly every unpack). The no-eviction plan's hook
    time per event is ``hook_cost_s``. What the other plans add to the step beyond the waits
    themselves (time in the hooks and compute between them), against the no-eviction steps of the
    same round (median over the rounds), six observations in all, is fitted by non-negative least
    squares as ``copies * copy_issue_s + bytes * copy_host_s_per_byte + waits * wait_resume_s``.
    On this machine 8 rounds let the per-byte cost move by half or more from one calibration to the
    next. Four calibrations in a row gave 76-152 us per copy with 16 rounds (about 9 s each) and
    103-115 us with 32 (about 17 s), alternating, so 32 it is."""
    med = statistics.median

    def net(r) -> float:  # the step less its waits
        return r.step_s - r.stall_s

    rows, ys, hooks = [], [], []
    for model, size in WORKLOADS:
        (keep, *moving), n_events = _measure_workload(model, size, backend_name, bandwidth, rounds, on_round)
        hooks.append(med(r.hook_s or 0.0 for rnd in keep for r in rnd) / n_events)
        for plan_rounds in moving:
            reps = [r for rnd in plan_rounds for r in rnd]
            rows.append([med(r.copies for r in reps), med(r.evicted_bytes + r.prefetched_bytes + r.on_demand_bytes for r in reps),
                         med(r.waits for r in reps)])
            # what the plan adds, against the no-eviction steps of the same round (the machine's
            # speed drifts by tens of percent over minutes, much less within one round)
            ys.append(med(med(net(r) for r in mv) - med(net(r) for r in kp) for mv, kp in zip(plan_rounds, keep, strict=False)))
    coef = nonnegative_fit(np.array(rows, dtype=np.float64), np.maximum(np.array(ys), 0.0))
    issue, per_byte, resume = (float(c) for c in coef)
    return HostCosts(max(med(hooks), 0.0), issue, per_byte, resume, calibrate_state_hook(backend_name, bandwidth, issue))


class _EveryGroupFull:
    """The calibration's state plan: every trainable group ``full`` (FSDP2's CPU offload: fetched
    for each use, the gradient copied out, the step on the host), no activation moved."""

    name = "calibration-state-full"

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        return SwapPlan.of(trace, self.name, (), state={g.name: "full" for g in trace.state if not g.frozen},
                           host_step="after-backward")


def calibrate_state_hook(backend_name: str, bandwidth: float | None, copy_issue_s: float, steps: int = 24) -> float:
    """R13-R16's host cost: the state mover's time per parameter tensor it moves (its hooks'
    bookkeeping), beyond ``copy_issue_s`` for each copy it issues. gpt-tiny under AdamW, every
    group placed ``full`` under a budget below its static bytes; the median over the executed
    steps, by the rule the runtime fits it with (``retime.state_hook_per_tensor``)."""
    from swapsched.runtime.profiler import static_bytes_of
    from swapsched.runtime.retime import state_hook_per_tensor

    device = "cuda" if backend_name == "cuda" else "cpu"
    case = build_model("gpt", "tiny", device=device)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-4)
    rt = PolicyRuntime(budget=int(0.9 * static_bytes_of(case.model, opt)), policy=_EveryGroupFull(),
                       backend=backend_name, model=case.model, optimizer=opt, bandwidth=bandwidth, tune=False)
    reports = []
    try:
        for _ in range(rt.profile_steps + steps):
            case.timed_step(rt.step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if (r := rt.report()).mode == "execute":
                reports.append(r)
    finally:
        rt.close()
    per_tensor = state_hook_per_tensor(reports, copy_issue_s)
    if per_tensor is None:
        raise RuntimeError("calibrate_state_hook: no step executed the state plan")
    return per_tensor


def nonnegative_fit(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Costs ``c >= 0`` minimizing ``|a c - y|``: a cost the data would make negative is 0, and the
    others are fitted without it (clipping an ordinary fit afterwards would leave them biased).
    Columns are scaled first, since they differ by orders of magnitude (copies, bytes)."""
    from scipy.optimize import nnls

    scale = np.maximum(np.abs(a).max(axis=0), 1.0)
    return np.asarray(nnls(a / scale, y)[0] / scale)


#: R19: what ``calibrate --disk`` writes and reads back (large enough to pass a drive's DRAM cache)
DISK_PROBE_BYTES = 1024 * 2**20


def calibrate(backend_name: str = "cpu", bandwidth: float | None = None, name: str | None = None,
              base: str = "cpu-emulated", progress: bool = False, world_size: int = 1,
              disk: str | Path | None = None) -> Calibration:
    """Measure link and hooks; the result keeps ``base``'s compute peaks (used for roofline only).
    ``progress``: a bar over the link and the host-cost rounds (35-60 s in all on a CPU);
    ``world_size`` > 1: the collectives too, over that many ranks on this machine (R18); ``disk``:
    the drive under that directory too (R19, ``disk_store.measure_disk``)."""
    from tqdm import tqdm

    rounds = 32
    bar = tqdm(total=1 + rounds * len(WORKLOADS), desc="calibrating", unit="round", disable=not progress)
    ref = load_hardware(base if backend_name == "cpu" else DEFAULT_GPU_HARDWARE)
    # the CPU engines throttled to the bandwidth alone (no added latency): the latency measured is
    # what the machine adds, thread wake-up included; unthrottled without a bandwidth
    backend = CpuBackend(bandwidth, bandwidth, 0.0) if backend_name == "cpu" else CudaBackend()
    try:
        d2h, h2d = calibrate_link(backend)
        lat_d, bw_d = _fit(d2h)
        lat_h, bw_h = _fit(h2d)
        # R6: what a copy that finds its engine idle takes beyond a queued one's latency and bytes
        wake = copy_wake_s(backend, SIZES[0], (lat_d, bw_d), (lat_h, bw_h))
        bar.update()
    finally:
        backend.shutdown()
    try:
        host = calibrate_host(backend_name, bandwidth, rounds, on_round=bar.update)
    finally:
        bar.close()
    mem = torch.cuda.get_device_properties(0).total_memory if backend_name == "cuda" else ref.device_memory_bytes
    hw = Hardware(
        name=name or f"calibrated-{backend_name}", d2h_bytes_per_s=bw_d, h2d_bytes_per_s=bw_h,
        copy_latency_s=(lat_d + lat_h) / 2, copy_wake_s=wake, device_memory_bytes=int(mem), peak_flops=ref.peak_flops,
        memory_bytes_per_s=ref.memory_bytes_per_s, bf16_peak_flops=ref.bf16_peak_flops, fp16_peak_flops=ref.fp16_peak_flops,
        kind=ref.kind, hook_cost_s=host.hook_cost_s,
        copy_issue_s=host.copy_issue_s, wait_resume_s=host.wait_resume_s, copy_host_s_per_byte=host.copy_host_s_per_byte,
        state_hook_s=host.state_hook_s, host_optimizer_params_per_s=host_optimizer_rate(),
    )
    provenance = _provenance(backend_name)
    if world_size > 1:
        latency, bus, _ = measure_collectives(world_size, backend_name)
        hw = replace(hw, collective_bytes_per_s=bus, collective_latency_s=latency, gpus_per_node=world_size)
        how = (f"measured by swapsched calibrate --world-size {world_size}: all-gathers of {COLLECTIVE_SIZES[0] // 2**20}.."
               f"{COLLECTIVE_SIZES[-1] // 2**20} MiB over {world_size} ranks of this machine, least squares")
        provenance.update(collective_bytes_per_s=how, collective_latency_s=how,
                          gpus_per_node="the ranks calibrate ran on this machine")
    if disk is not None:
        read, write, latency, direct = measure_disk(disk, nbytes=DISK_PROBE_BYTES)
        hw = replace(hw, disk_read_bytes_per_s=read, disk_write_bytes_per_s=write, disk_latency_s=latency)
        how = (f"measured by swapsched calibrate --disk on {time.strftime('%Y-%m-%d')}: {DISK_PROBE_BYTES // 2**20} MiB in "
               f"16 MiB sequential requests, {'direct I/O' if direct else 'buffered, the page cache dropped between'}")
        provenance.update(disk_read_bytes_per_s=how, disk_write_bytes_per_s=f"{how}, fsync'd",
                          disk_latency_s=f"{how}: the median of 8 reads of one 4 KiB block")
    return Calibration(hw, tuple(d2h), tuple(h2d), host, provenance)
