"""What a simulated step costs (R8): :class:`SimResult`, and the :class:`Timeline` ``--plot`` draws."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SimResult", "StateCost", "Timeline"]


@dataclass(frozen=True)
class StateCost:
    """What the state plan did in a simulated step (R13-R16)."""

    param_off_bytes: int  # parameters' bytes placed off the device (they come back for their uses)
    grad_off_bytes: int  # gradients' bytes copied to the host as they complete
    optim_off_bytes: int  # optimizer state's bytes living on the host
    host_bytes: int  # what the host holds of the state (R11, beside the swapped activations)
    host_step_s: float  # the host's optimizer steps, busy time
    device_step_s: float  # the device's optimizer steps, on the compute stream (in iteration_s)
    stall_s: float  # compute waiting for state (in iteration_s)
    skipped: int  # groups the host budget could not hold, kept on the device (R11)
    # R18, a sharded step: the collective stream's busy time, the compute's wait for it, and the
    # unsharded bytes all-gathered and reduce-scattered
    collective_s: float = 0.0
    collective_stall_s: float = 0.0
    gathered_bytes: int = 0
    reduced_bytes: int = 0
    # R19, the disk tier: what rests on the disk, what the step read and wrote there, and the
    # host's staging buffers for it (in host_bytes); groups the disk budget could not hold
    disk_bytes: int = 0
    disk_read_bytes: int = 0
    disk_written_bytes: int = 0
    staging_bytes: int = 0
    disk_skipped: int = 0

    @property
    def off_bytes(self) -> int:
        return self.param_off_bytes + self.grad_off_bytes + self.optim_off_bytes

    @property
    def where_stepped(self) -> str:
        """Where the optimizer stepped: ``device``, ``host``, or ``both`` (some groups each)."""
        if self.host_step_s == 0:
            return "device"
        return "host" if self.device_step_s == 0 else "both"


@dataclass(frozen=True)
class Timeline:
    """What ``--plot`` draws: memory over time and the busy intervals of the three streams."""

    memory: tuple[tuple[float, int], ...]  # (time s, device bytes) after each change
    compute: tuple[tuple[float, float], ...]  # (start, end) of each gap's compute
    d2h: tuple[tuple[float, float, int], ...]  # (start, end, tensor)
    h2d: tuple[tuple[float, float, int], ...]
    stalls: tuple[tuple[float, float, int], ...]  # (start, end, event)
    recompute: tuple[tuple[float, float, int], ...] = ()  # (start, end, segment index), on the compute stream
    # R13-R16: the state's copies (start, end, group index) per direction, and the host's optimizer steps
    state_d2h: tuple[tuple[float, float, int], ...] = ()
    state_h2d: tuple[tuple[float, float, int], ...] = ()
    host_steps: tuple[tuple[float, float, int], ...] = ()
    # R19: the disk's reads and writes (start, end, group index)
    disk_reads: tuple[tuple[float, float, int], ...] = ()
    disk_writes: tuple[tuple[float, float, int], ...] = ()


@dataclass(frozen=True)
class SimResult:
    """R8: what a plan costs. On OOM, ``iteration_s`` and ``overhead`` are ``inf``."""

    iteration_s: float
    ideal_s: float
    stall_s: float
    stall_fwd_s: float
    stall_bwd_s: float
    peak_bytes: int
    budget_bytes: int
    oom: bool
    oom_event: int | None
    d2h_bytes: int
    h2d_bytes: int
    timeline: Timeline | None = field(default=None, compare=False, repr=False)
    # the host's own cost of the copies (Hardware copy_issue_s, copy_host_s_per_byte, wait_resume_s);
    # already in iteration_s
    host_s: float = 0.0
    # R9: compute spent recomputing blocks in backward; already in iteration_s
    recompute_s: float = 0.0
    # R4, guard (simulate(guard=True)): tensors evicted on the spot where the plan left no room
    guard_evictions: int = 0
    # R11: the most host bytes swapped tensors held at once, and the planned swap-outs left on the
    # device because the host budget had no room for them
    host_peak_bytes: int = 0
    host_skipped: int = 0
    # R13-R16: the state plan's cost, for a trace that records its state (None: none recorded)
    state: StateCost | None = None
    # R18: the ranks sharing this rank's host (a sharded step's node): the node's host holds
    # ``host_peak_bytes`` for each of them
    host_ranks: int = 1

    @property
    def node_host_peak_bytes(self) -> int:
        """R18: what the node's host holds at its peak, every rank on it alike."""
        return self.host_peak_bytes * self.host_ranks

    @property
    def overhead(self) -> float:
        return self.iteration_s / self.ideal_s - 1.0 if self.ideal_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return None if math.isinf(x) else x

        return {
            "iteration_s": num(self.iteration_s),
            "ideal_s": self.ideal_s,
            "overhead": num(self.overhead),
            "stall_s": num(self.stall_s),
            "stall_fwd_s": num(self.stall_fwd_s),
            "stall_bwd_s": num(self.stall_bwd_s),
            "peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "oom": self.oom,
            "oom_event": self.oom_event,
            "d2h_bytes": self.d2h_bytes,
            "h2d_bytes": self.h2d_bytes,
            "host_s": num(self.host_s),
            "recompute_s": self.recompute_s,
            "guard_evictions": self.guard_evictions,
            "host_peak_bytes": self.host_peak_bytes,
            "node_host_peak_bytes": self.node_host_peak_bytes,
            "host_ranks": self.host_ranks,
            "host_skipped": self.host_skipped,
            "state": None if self.state is None else {**asdict(self.state), "off_bytes": self.state.off_bytes,
                                                      "where_stepped": self.state.where_stepped},
        }
