"""``swapsched fit``: will a model's training step fit a machine, and how fast, under each way of
fitting it.

One trace (a model profiled on the meta device at its real size, timed by roofline for the
hardware) is planned by each *option* under the device's memory and the host's, and each plan is
simulated (R1-R16):

- ``plain``: nothing moved or recomputed (``no-swap``);
- ``checkpoint-all``: every block recomputed, the state on the device;
- the state peers (``agents/state_search.py``), each with every block checkpointed:
  ``zero-offload`` (DeepSpeed ZeRO-Offload), ``fsdp-offload`` (FSDP2's ``CPUOffloadPolicy``),
  ``torchao-offload`` (torchao's ``CPUOffloadOptimizer``);
- ``default``: swapsched's own plan of the state and the activations together.

For one rank of a sharded step (``--world-size``, R18) the options are FSDP2's: ``plain`` (no
checkpointing), ``fsdp`` (every block checkpointed), ``fsdp-offload``, ``fsdp-partial``
(#188120's partial offload), ``zero3-offload`` and ``default``; tokens are the job's, the
device peak a rank's and the host peak and memory a node's.

Each hardware gets the trace re-timed for it (roofline: the profile's FLOPs and bytes over its
peaks). The device budget is the device's memory less ``DEVICE_MARGIN`` (what the runtime's ``"device"``
budget leaves the allocator); the host budget is ``host_memory`` (R11: a group whose host part
does not fit stays on the device), and with a disk budget (R19) the state the host cannot hold
may rest on the hardware's drives (``zero-infinity``, DeepSpeed ZeRO-Infinity, is a row then). A row gives the device peak and the host peak (swapped
activations and the state the host holds, at once), the step, tokens (or samples) a second, and MFU: the
trace's FLOPs (forward, backward and the tail, no recompute) over the step and the hardware's
peak for the trace's compute dtype. Where no option fits, :func:`smallest_fit` bisects the
smallest device memory at which ``default``'s placements fit (with the host memory given) and
the host memory they take there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swapsched.agents.evaluate import run_policy
from swapsched.agents.registry import get_policy
from swapsched.agents.state_search import smallest_state_budget
from swapsched.budget import BudgetError, format_bytes
from swapsched.hardware import Hardware
from swapsched.runtime.budgets import DEVICE_MARGIN
from swapsched.trace import Trace

__all__ = ["FIT_OPTIONS", "SHARDED_OPTIONS", "options_for", "timed_for", "FitRow", "Smallest", "FitReport", "fit", "fit_curves", "device_budget", "step_flops",
           "format_fit"]

#: Each option of the table and the registry policy that plans it (module docstring)
FIT_OPTIONS: dict[str, str] = {"plain": "no-swap", "checkpoint-all": "checkpoint-all", "zero-offload": "zero-offload",
                               "fsdp-offload": "fsdp-offload", "torchao-offload": "ao-offload", "default": "default"}
#: ... for one rank of a sharded step (R18): FSDP2 without and with every block checkpointed,
#: its offload, #188120's partial offload, DeepSpeed ZeRO-3 offload, and default
SHARDED_OPTIONS: dict[str, str] = {"plain": "no-swap", "fsdp": "fsdp", "fsdp-offload": "fsdp-offload",
                                   "fsdp-partial": "fsdp-partial", "zero3-offload": "zero3-offload", "default": "default"}


@dataclass(frozen=True)
class FitRow:
    """One option on one hardware. Figures are None where it does not fit; ``why`` says why."""

    option: str
    hardware: str
    fits: bool
    device_peak_bytes: int | None
    host_peak_bytes: int | None
    step_s: float | None
    tokens_per_s: float | None
    mfu: float | None
    why: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"option": self.option, "hardware": self.hardware, "fits": self.fits,
                "device_peak_bytes": self.device_peak_bytes, "host_peak_bytes": self.host_peak_bytes,
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "why": self.why}


@dataclass(frozen=True)
class Smallest:
    """The smallest device memory at which ``default`` fits, and the host memory it takes there."""

    hardware: str
    device_bytes: int
    host_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"hardware": self.hardware, "device_bytes": self.device_bytes, "host_bytes": self.host_bytes}


@dataclass(frozen=True)
class FitReport:
    """The table :func:`fit` makes: its rows, the fastest fitting one, and for each hardware none
    of whose options fits, the smallest of its kind ``default`` fits."""

    model: str
    tokens: int
    unit: str  # "tokens" or "samples": what ``tokens_per_s`` counts
    host_memory: int | None
    rows: tuple[FitRow, ...]
    fastest: FitRow | None
    smallest: tuple[Smallest, ...]
    world_size: int = 1  # R18: ranks; tokens are the job's, peaks a rank's, host memory a node's
    disk: int | None = None  # R19: the disk budget (None: no disk tier)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "world_size": self.world_size, "tokens_per_step": self.tokens, "unit": self.unit,
                "host_memory_bytes": self.host_memory, "disk_budget_bytes": self.disk,
                "rows": [r.to_dict() for r in self.rows],
                "fastest": None if self.fastest is None else self.fastest.option,
                "fastest_hardware": None if self.fastest is None else self.fastest.hardware,
                "smallest": self.smallest[0].to_dict() if self.smallest and self.fastest is None else None,
                "smallest_by_hardware": [s.to_dict() for s in self.smallest]}


def options_for(trace: Trace, disk: bool = False) -> dict[str, str]:
    """The options of ``trace``'s table: one device's, or a sharded step's (R18); with frozen
    groups (R13: LoRA), accelerate's CPU offload of the frozen weights too; with a disk (R19,
    one device), ZeRO-Infinity's placement."""
    options = dict(SHARDED_OPTIONS if trace.world_size > 1 else FIT_OPTIONS)
    if any(g.frozen for g in trace.state):
        options["accelerate-offload"] = "accelerate-offload"
    if disk and trace.world_size == 1:
        options["zero-infinity"] = "zero-infinity"
    options["default"] = options.pop("default")  # the last row
    return options


def device_budget(hardware: Hardware) -> int:
    """The bytes a plan may hold on ``hardware``'s device (module docstring)."""
    return int(hardware.device_memory_bytes * (1 - DEVICE_MARGIN))


def step_flops(trace: Trace) -> float | None:
    """The model's FLOPs in one step (forward, backward and the tail), or None where the trace
    does not count them."""
    flops = [e.flops for e in trace.events]
    if any(f is None for f in flops):
        return None
    return float(sum(f for f in flops if f is not None)) + float(trace.meta.get("tail_flops", 0.0))


def _row(trace: Trace, option: str, budget: int, hw: Hardware, tokens: int, flops: float | None,
         smallest: dict[str, int] | None = None) -> FitRow:
    """``option`` on ``hw`` at ``budget``; where ``default`` refuses it, the smallest budget its
    refusal found goes into ``smallest`` (by hardware), which :func:`smallest_fit` then takes."""
    least = trace.min_feasible_bytes_movable if trace.state else trace.min_feasible_bytes
    if budget < least:  # below what any plan can meet (R14's bound, or R8's without the state)
        return FitRow(option, hw.name, False, None, None, None, None, None,
                      why=f"any plan needs over {format_bytes(math.ceil(least / (1 - DEVICE_MARGIN)))} of device memory")
    try:
        _, res, _ = run_policy(get_policy(options_for(trace, hw.has_disk)[option]), trace, budget, hw)
    except BudgetError as refused:  # default's refusal: none of the placements it screens fits
        if smallest is not None and refused.smallest_bytes is not None:
            smallest[hw.name] = refused.smallest_bytes
        return FitRow(option, hw.name, False, None, None, None, None, None, why="no placement fits")
    if res.oom or not math.isfinite(res.iteration_s):
        skipped = res.state.skipped if res.state is not None else 0
        why = (f"out of device memory ({skipped} groups' state did not fit the host memory, R11)" if skipped
               else f"needs {format_bytes(math.ceil(trace.peak_bytes_no_swap / (1 - DEVICE_MARGIN)))} of device memory"
               if option == "plain" else "out of device memory")
        return FitRow(option, hw.name, False, None, None, None, None, None, why=why)
    host = res.node_host_peak_bytes  # R11: the swapped activations and the state the host holds, at once (R18: the node's)
    peak = hw.peak_flops_for(str(trace.meta.get("compute_dtype", "float32")))
    mfu = None if flops is None else flops / res.iteration_s / peak
    # the job's tokens: every rank's batch (a rank's MFU is the job's: ranks are symmetric)
    return FitRow(option, hw.name, True, res.peak_bytes, host, res.iteration_s, tokens * trace.world_size / res.iteration_s,
                  mfu)


def smallest_fit(trace: Trace, hardware: Hardware, known: int | None = None) -> Smallest | None:
    """Where nothing fits: the smallest device memory at which a placement ``default`` screens
    fits (to within 1%, R14's bisection, with ``hardware``'s host memory), and the host memory
    ``default``'s plan takes there; None where the trace records no state to move. ``known``: that
    budget as ``default``'s refusal at the device's own bisected it (the same screen, from higher
    up: nothing fitted below), so it is not bisected twice."""
    if not trace.state:
        return None
    budget = known if known is not None else smallest_state_budget(trace, hardware, get_policy("default-greedy"),
                                                                   above=trace.min_feasible_bytes_movable)
    if budget is None:
        return None
    row = _row(trace, "default", budget, hardware, 1, None)
    host = (row.host_peak_bytes if row.fits and row.host_peak_bytes is not None
            else sum(g.bytes for g in trace.state) * hardware.for_ranks(trace.world_size).ranks_per_host)
    return Smallest(hardware.name, math.ceil(budget / (1 - DEVICE_MARGIN)), host)


def timed_for(trace: Trace, hardware: Hardware) -> Trace:
    """``trace`` timed for ``hardware``: a roofline trace profiled for another is re-timed (its
    FLOPs and bytes over this one's peaks); a measured one is what it is."""
    if trace.timing == "roofline" and trace.device.split("->")[-1] != hardware.name:
        return trace.retimed(hardware)
    return trace


def fit(trace: Trace, hardware: Sequence[Hardware], tokens: int, unit: str = "tokens", *,
        host_memory: int | None = None, disk: int | None = None, options: Sequence[str] | None = None,
        progress: bool = True) -> FitReport:
    """Each option on each hardware (module docstring), with ``tokens`` per step and rank.
    ``host_memory``: a node's, for a sharded trace (R18); ``disk``: the disk budget (R19: the
    state the host memory cannot hold may rest on the hardware's drives)."""
    from tqdm import tqdm

    known = options_for(trace, disk is not None)
    options = list(known) if options is None else list(options)
    unknown = [o for o in options if o not in known]
    if unknown:
        raise ValueError(f"unknown fit options {unknown}; known: {', '.join(known)}")
    flops = step_flops(trace)
    rows: list[FitRow] = []
    hws = [hw.with_host(host_budget_bytes=host_memory, disk_budget_bytes=disk) for hw in hardware]
    timed = {hw.name: timed_for(trace, hw) for hw in hws}
    refused: dict[str, int] = {}  # hardware -> the smallest budget default's refusal found there
    with tqdm(total=len(hws) * len(options), disable=not progress, unit="option", leave=False, dynamic_ncols=True) as bar:
        for hw in hws:
            for option in options:
                bar.set_postfix_str(f"{hw.name} {option}", refresh=True)
                rows.append(_row(timed[hw.name], option, device_budget(hw), hw, tokens, flops, refused))
                bar.update(1)
    fitting = [r for r in rows if r.fits and r.step_s is not None]
    fastest = min(fitting, key=lambda r: r.step_s or math.inf) if fitting else None
    smallest: list[Smallest] = []
    for hw in hws:  # a machine none of whose options fits: the smallest of its kind default fits
        if not any(r.fits for r in rows if r.hardware == hw.name):
            found = smallest_fit(timed[hw.name], hw, refused.get(hw.name))
            if found is not None:
                smallest.append(found)
    return FitReport(trace.name, tokens * trace.world_size, unit, host_memory, tuple(rows), fastest, tuple(smallest),
                     trace.world_size, disk)


def fit_curves(trace: Trace, hardware: Hardware, options: Sequence[str] | None = None, points: int = 6,
               progress: bool = True) -> dict[str, list[tuple[int, float | None]]]:
    """Each option's step (None: does not fit) over ``points`` device memories, from the smallest
    feasible with the state movable to the peak with nothing moved (the plot of ``fit --plot``)."""
    from tqdm import tqdm

    lo = trace.min_feasible_bytes_movable if trace.state else trace.min_feasible_bytes
    hi = max(int(trace.peak_bytes_no_swap * 1.02), lo + 1)  # past the peak: plain's point too
    budgets = [int(lo + (hi - lo) * i / (points - 1)) for i in range(points)]
    options = list(options_for(trace, hardware.has_disk)) if options is None else list(options)
    trace = timed_for(trace, hardware)
    out: dict[str, list[tuple[int, float | None]]] = {o: [] for o in options}
    with tqdm(total=points * len(options), disable=not progress, unit="plan", leave=False, dynamic_ncols=True) as bar:
        for b in budgets:
            for o in options:
                row = _row(trace, o, b, hardware, 1, None)
                out[o].append((math.ceil(b / (1 - DEVICE_MARGIN)), row.step_s))
                bar.update(1)
    return out


def format_fit(report: FitReport) -> str:
    """The table ``swapsched fit`` prints: a row per option (the fastest fitting marked *)."""
    from swapsched.report import format_grid

    head = ["option", "hardware", "fits", "device peak", "host peak", "step", f"{report.unit}/s", "MFU"]
    body = []
    for r in report.rows:
        mark = " *" if r is report.fastest else ""
        if r.fits:
            body.append([r.option + mark, r.hardware, "yes", format_bytes(r.device_peak_bytes or 0),
                         format_bytes(r.host_peak_bytes or 0), f"{r.step_s:.3f} s", f"{r.tokens_per_s:,.0f}",
                         "-" if r.mfu is None else f"{100 * r.mfu:.1f}%"])
        else:
            body.append([r.option, r.hardware, f"no: {r.why}", "-", "-", "-", "-", "-"])
    ranks = "" if report.world_size == 1 else f" on {report.world_size} ranks (device peak: a rank's; host: a node's)"
    lines = [f"{report.model}: {report.tokens:,} {report.unit} a step{ranks}; device budget = memory less "
             f"{100 * DEVICE_MARGIN:.0f}%; host memory {format_bytes(report.host_memory) if report.host_memory else 'unlimited'}"
             + (f"; disk {format_bytes(report.disk)}" if report.disk else ""),
             format_grid(head, body)]
    if report.fastest is not None:
        lines.append(f"* fastest that fits: {report.fastest.option} on {report.fastest.hardware}")
    else:
        lines.append("nothing fits")
    for s in report.smallest:
        lines.append(f"nothing fits {s.hardware}; default fits it from {format_bytes(s.device_bytes)} of device memory with "
                         f"{format_bytes(s.host_bytes)} of host memory")
    return "\n".join(lines)
