"""Hardware: the device a plan is made for (DESIGN.md "Hardware").

Profiles live in ``configs/hardware/NAME.yaml``; ``load_hardware`` takes a name or a path.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from swapsched._paths import atomic_path, config_dir
from swapsched.errors import UserError, read_yaml

__all__ = ["Hardware", "HOST_COSTS", "DEFAULT_HOST_OPTIMIZER_PARAMS_PER_S", "hardware_for_device", "HardwareError", "load_hardware", "hardware_names", "default_hardware", "DEFAULT_GPU_HARDWARE",
           "DEFAULT_CPU_HARDWARE", "TRAINING_HARDWARE"]


class HardwareError(UserError):
    """A hardware profile is missing, malformed or has an impossible value."""


@dataclass(frozen=True)
class Hardware:
    """Copy engines and compute peaks of one device (R6, roofline timing)."""

    name: str
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    copy_latency_s: float
    device_memory_bytes: int
    peak_flops: float  # fp32 matmul peak (TF32 tensor cores where the device has them)
    memory_bytes_per_s: float
    # Half-precision matmul peaks (dense tensor cores); None: the device has no such unit, and a
    # trace in that dtype cannot be retimed for it (V100 has fp16 but no bf16)
    bf16_peak_flops: float | None = None
    fp16_peak_flops: float | None = None
    # "gpu" or "cpu" (the runtime's emulated device, which runs the CPU's kernels): what SDPA's
    # kernels can run on it (swapsched/attention.py)
    kind: str = "gpu"
    # Host-side cost of one saved-tensor hook call on the live runtime; the simulator adds it to
    # every gap so that predictions include what the hooks themselves cost (0 for pure models).
    hook_cost_s: float = 0.0
    # What moving tensors costs the compute thread itself on the live runtime (0 for pure models;
    # ``swapsched calibrate`` measures them; the simulator charges them before the next gap):
    # per copy issued, either direction (the runtime's bookkeeping and the hand-off to the copy
    # engine); per wait for a copy (the waiting thread was asleep: its next kernels start late);
    # and per byte copied where copies share the compute's cores and memory (the CPU backend; DMA
    # engines make it 0 on a GPU).
    copy_issue_s: float = 0.0
    wait_resume_s: float = 0.0
    copy_host_s_per_byte: float = 0.0
    # R13-R16: what the state mover's hooks cost the compute thread per step, per parameter tensor
    # placed off the device (its module and gradient hooks, the copies they issue, its bookkeeping);
    # fitted by the runtime from its own steps (0 for pure models)
    state_hook_s: float = 0.0
    # R6: the copy streams. 2: one engine per direction (the hook runtime's two copy streams, full
    # duplex); 1: both directions on one stream in issue order (R10: torch's ``ao.offload`` /
    # ``ao.reload`` ops issue every copy on one transfer stream). Set by for_executor, not in YAML.
    copy_streams: int = 2
    # R6: how much later than latency + bytes / bandwidth a copy ends that finds its engine idle,
    # as its waiter sees it: the engine's wake-up, a lone copy's late end, the waiter's wake-up
    # (the emulated engines' threads: ~0.13 ms on a 2-core CPU). Queued copies pay only the
    # latency. Optional in YAML (0: not measured); ``swapsched calibrate`` measures it.
    copy_wake_s: float = 0.0
    # R11, host memory. The host's memory bandwidth, which every rank's copies on the node share
    # (YAML, optional: None = never the bottleneck), and how many ranks share it (a node's GPUs
    # under FSDP/DDP). Sharing it, each rank's copies run at most at host_memory_bytes_per_s /
    # (ranks_per_host x copy_streams) in each direction: every rank's copies, both directions at
    # once, draw on it. One rank gets its link's own figure, measured with the host in the path.
    host_memory_bytes_per_s: float | None = None
    ranks_per_host: int = 1
    # R11: the host bytes this rank's swapped tensors may hold at once (pinned memory is finite;
    # None = unlimited). Set per run (--host-budget, SwapRuntime(host_budget=)), not in YAML.
    host_budget_bytes: int | None = None
    # R15: the host's optimizer step, in parameters per second (the fused CPU AdamW of the
    # node, all its cores; YAML, optional): None = DEFAULT_HOST_OPTIMIZER_PARAMS_PER_S.
    # ``swapsched calibrate`` measures it on the CPU profile.
    host_optimizer_params_per_s: float | None = None
    # R18, sharded steps: each rank's collective bandwidth, as nccl-tests reports it (bus
    # bandwidth: an all-gather or reduce-scatter of S bytes over N ranks moves S (N-1)/N through
    # it), among the ranks of one node and across nodes; the latency of one collective; and the
    # ranks one node holds (a job of more crosses nodes at the slower figure). YAML, optional:
    # None = no collective figure (a sharded trace is refused on it).
    collective_bytes_per_s: float | None = None
    internode_bytes_per_s: float | None = None
    collective_latency_s: float = 20e-6
    gpus_per_node: int = 8
    # ... and how many of a node's ranks share one host's memory, link and CPU (None: all of them;
    # 1 on a GH200 node, where each superchip has its own Grace)
    gpus_per_host: int | None = None
    # R19, the disk tier: the node's NVMe (its ranks share it), sequential reads and writes in
    # large blocks at the runtime's queue depth with direct I/O, and the latency of one request.
    # YAML, optional: None = no disk tier (``swapsched calibrate --disk DIR`` measures them).
    disk_read_bytes_per_s: float | None = None
    disk_write_bytes_per_s: float | None = None
    disk_latency_s: float = 0.0
    # R19: the bytes this rank's state may rest on the disk (None: the disk tier is off). Set per
    # run (--disk-budget, SwapRuntime(disk_budget=)), not in YAML.
    disk_budget_bytes: int | None = None

    def collective_rate(self, world_size: int) -> float:
        """R18: the bus bandwidth a collective over ``world_size`` ranks runs at."""
        within = world_size <= self.gpus_per_node
        rate = self.collective_bytes_per_s if within else (self.internode_bytes_per_s or self.collective_bytes_per_s)
        if rate is None:
            raise HardwareError(f"{self.name} gives no collective bandwidth (collective_bytes_per_s): a sharded step "
                                "cannot be timed on it; use a profile that gives one (h100-sxm) or add it to the YAML")
        return rate

    def for_ranks(self, world_size: int) -> Hardware:
        """R18: one rank of ``world_size`` as it sees the node's host: the node's ranks share its
        link and memory bandwidth (R11), its optimizer's rate (R15) and its host budget, which
        is then the node's (``--host-budget`` of a sharded trace is per node). Hardware already
        shared by its ranks (``with_host(ranks_per_host=)``, or this) is returned as it is."""
        ranks = max(1, min(world_size, self.gpus_per_host or self.gpus_per_node))
        if ranks == 1 or self.ranks_per_host > 1:
            return self
        out = replace(self.with_host(ranks_per_host=ranks), host_optimizer_params_per_s=self.host_optimizer_rate() / ranks)
        if self.host_budget_bytes is not None:
            out = replace(out, host_budget_bytes=self.host_budget_bytes // ranks)
        if self.disk_budget_bytes is not None:
            out = replace(out, disk_budget_bytes=self.disk_budget_bytes // ranks)
        return out

    def host_optimizer_rate(self) -> float:
        """R15: parameters the host's optimizer steps per second."""
        return self.host_optimizer_params_per_s or DEFAULT_HOST_OPTIMIZER_PARAMS_PER_S

    def device_optimizer_rate(self, touched_bytes_per_param: float) -> float:
        """R15: parameters the device's optimizer steps per second: the step is memory-bound
        (a fused AdamW reads and writes every state element once), so its roofline is the
        memory bandwidth over the bytes it touches per parameter."""
        return math.inf if touched_bytes_per_param <= 0 else self.memory_bytes_per_s / touched_bytes_per_param

    def link_bytes_per_s(self, direction: str) -> float:
        """R11: the bandwidth one rank's copies get in ``direction`` (``"d2h"`` or ``"h2d"``): its
        link, or its share of the host's memory bandwidth where that is less."""
        link = self.d2h_bytes_per_s if direction == "d2h" else self.h2d_bytes_per_s
        if self.host_memory_bytes_per_s is None or self.ranks_per_host == 1:
            return link  # one rank: its link's figure was measured with the host's memory in the path
        # every rank's copies in both directions (each stream) draw on the one memory
        return min(link, self.host_memory_bytes_per_s / (self.ranks_per_host * self.copy_streams))

    def disk_bytes_per_s(self, direction: str) -> float:
        """R19: the bandwidth one rank's disk I/O gets in ``direction`` (``"read"`` or ``"write"``):
        the node's drives shared by its ranks. Raises where the profile gives no disk."""
        rate = self.disk_read_bytes_per_s if direction == "read" else self.disk_write_bytes_per_s
        if rate is None:
            raise HardwareError(f"{self.name} gives no disk bandwidth (disk_read_bytes_per_s, disk_write_bytes_per_s): "
                                "the disk tier cannot be timed on it; measure it with swapsched calibrate --disk DIR")
        return rate / self.ranks_per_host

    @property
    def has_disk(self) -> bool:
        """R19: the disk tier is on: a disk budget, and the rates to time it."""
        return (self.disk_budget_bytes is not None and self.disk_read_bytes_per_s is not None
                and self.disk_write_bytes_per_s is not None)

    def with_host(self, *, ranks_per_host: int | None = None, host_budget_bytes: int | None = None,
                  disk_budget_bytes: int | None = None) -> Hardware:
        """This hardware shared by ``ranks_per_host`` ranks, or with a host budget (R11) or a
        disk budget (R19: the disk tier on; the profile must give the disk's rates)."""
        out = self
        if ranks_per_host is not None:
            if ranks_per_host < 1:
                raise HardwareError(f"ranks per host must be at least 1, got {ranks_per_host}")
            out = replace(out, ranks_per_host=int(ranks_per_host),
                          name=out.name if ranks_per_host == 1 else f"{self.name.split('@')[0]}@{ranks_per_host}ranks")
        if host_budget_bytes is not None:
            if host_budget_bytes <= 0:
                raise HardwareError(f"host budget must be positive, got {host_budget_bytes}")
            out = replace(out, host_budget_bytes=int(host_budget_bytes))
        if disk_budget_bytes is not None:
            if disk_budget_bytes <= 0:
                raise HardwareError(f"disk budget must be positive, got {disk_budget_bytes}")
            out.disk_bytes_per_s("read")  # a disk budget needs the disk's rates
            out.disk_bytes_per_s("write")
            out = replace(out, disk_budget_bytes=int(disk_budget_bytes))
        return out

    def for_executor(self, executor: str) -> Hardware:
        """This hardware as ``executor`` pays for a plan (R10). ``"hooks"``: as given (the live
        runtime's saved-tensor hooks, with their host costs). ``"compiled"``: a compiled graph
        runs no Python per saved tensor (no hook, issue or resume cost on the host) and issues
        its copies on one transfer stream."""
        if executor == "hooks":
            return self
        if executor == "compiled":
            return replace(self, hook_cost_s=0.0, copy_issue_s=0.0, wait_resume_s=0.0, copy_host_s_per_byte=0.0,
                           state_hook_s=0.0, copy_streams=1)
        raise HardwareError(f"unknown executor {executor!r}; use one of {list(EXECUTORS)}")

    def peak_flops_for(self, dtype: str) -> float:
        """The matmul peak for compute in ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``;
        a trace's ``compute_dtype``)."""
        if dtype in ("float32", "float64", ""):
            return self.peak_flops
        peak = {"bfloat16": self.bf16_peak_flops, "float16": self.fp16_peak_flops}.get(dtype)
        if peak is None:
            raise HardwareError(f"{self.name} has no {dtype} peak (its profile gives none: the device lacks the unit); "
                                "use another --dtype or another --hardware")
        return peak

    def d2h_time(self, nbytes: float) -> float:
        return self.copy_latency_s + nbytes / self.link_bytes_per_s("d2h")

    def h2d_time(self, nbytes: float) -> float:
        return self.copy_latency_s + nbytes / self.link_bytes_per_s("h2d")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path, comments: dict[str, str] | None = None) -> Path:
        """Write YAML, each number with its source as a comment when given."""
        comments = comments or {}
        lines = []
        for k, v in self.to_dict().items():
            if k in _PER_RUN or v is None:
                continue  # a run's settings, not the device's (R10, R11)
            val = repr(v) if isinstance(v, str) else (f"{v:.6e}" if isinstance(v, float) else str(v))
            line = f"{k}: {val}"
            if k in comments:
                line += f"  # {comments[k]}"
            lines.append(line)
        p = Path(path)
        with atomic_path(p) as tmp:
            tmp.write_text("\n".join(lines) + "\n")
        return p


_REQUIRED = ("d2h_bytes_per_s", "h2d_bytes_per_s", "copy_latency_s", "device_memory_bytes", "peak_flops", "memory_bytes_per_s")
_OPTIONAL = ("host_memory_bytes_per_s", "bf16_peak_flops", "fp16_peak_flops", "host_optimizer_params_per_s", "copy_wake_s",
             "collective_bytes_per_s", "internode_bytes_per_s", "collective_latency_s", "disk_read_bytes_per_s",
             "disk_write_bytes_per_s", "disk_latency_s")
#: R15: a node's CPU AdamW where a profile gives none. DeepSpeed's ZenFlow write-up: ZeRO-Offload
#: stretches a Llama-2-7B step from 0.5 s to over 7 s, the CPU step being the difference: 6.7e9
#: parameters in about 6.5 s, 1.0e9 parameters a second (fused, every core of a server node).
DEFAULT_HOST_OPTIMIZER_PARAMS_PER_S = 1.0e9
KINDS = ("gpu", "cpu")
_POSITIVE = ("d2h_bytes_per_s", "h2d_bytes_per_s", "device_memory_bytes", "peak_flops", "memory_bytes_per_s")
#: Fields a run sets (the executor, the ranks on the node, the host budget), never a hardware file
_PER_RUN = ("copy_streams", "ranks_per_host", "host_budget_bytes", "disk_budget_bytes")
EXECUTORS = ("hooks", "compiled")  # R10: who executes a plan, see Hardware.for_executor
HOST_COSTS = ("hook_cost_s", "copy_issue_s", "wait_resume_s", "copy_host_s_per_byte", "state_hook_s")  # optional, 0 = not measured
_NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def _as_number(value: Any, where: str) -> float:
    # PyYAML (YAML 1.1) reads "1.0e10" as a string; accept a plain numeric string, reject the rest.
    if isinstance(value, bool):
        raise HardwareError(f"{where}: expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str) and _NUMBER_RE.match(value.strip()):
        out = float(value.strip())
    else:
        raise HardwareError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(out) or out < 0:
        raise HardwareError(f"{where}: must be a finite number >= 0, got {value!r}")
    return out


def hardware_from_dict(data: Any, source: str) -> Hardware:
    if not isinstance(data, dict):
        raise HardwareError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    unknown = set(data) - set(Hardware.__dataclass_fields__)
    if unknown:
        raise HardwareError(f"{source}: unknown field(s) {sorted(unknown)}; known: {list(Hardware.__dataclass_fields__)}")
    for k in ("name", *_REQUIRED):
        if k not in data:
            raise HardwareError(f"{source}: field {k}: missing")
    if not isinstance(data["name"], str) or not data["name"]:
        raise HardwareError(f"{source}: field name: expected a non-empty string, got {data['name']!r}")
    vals = {k: _as_number(data[k], f"{source}: field {k}") for k in (*_REQUIRED, *HOST_COSTS, *_OPTIONAL)
            if k in data}
    for k in _PER_RUN:
        if k in data:
            raise HardwareError(f"{source}: field {k}: set per run, not in a hardware file (see Hardware)")
    for k in _POSITIVE:
        if vals[k] <= 0:
            raise HardwareError(f"{source}: field {k}: must be > 0, got {data[k]!r}")
    if "host_optimizer_params_per_s" in vals and vals["host_optimizer_params_per_s"] <= 0:
        raise HardwareError(f"{source}: field host_optimizer_params_per_s: must be > 0, got {data['host_optimizer_params_per_s']!r}")
    for k in ("bf16_peak_flops", "fp16_peak_flops"):
        if k in vals and vals[k] <= 0:
            raise HardwareError(f"{source}: field {k}: must be > 0 (leave it out where the device has no such unit), got {data[k]!r}")
    kind = data.get("kind", "gpu")
    if kind not in KINDS:
        raise HardwareError(f"{source}: field kind: expected one of {list(KINDS)}, got {kind!r}")
    for k in ("collective_bytes_per_s", "internode_bytes_per_s", "disk_read_bytes_per_s", "disk_write_bytes_per_s"):
        if k in vals and vals[k] <= 0:
            raise HardwareError(f"{source}: field {k}: must be > 0, got {data[k]!r}")
    counts: dict[str, Any] = {}
    for k in ("gpus_per_node", "gpus_per_host"):
        if k in data:
            if not isinstance(data[k], int) or isinstance(data[k], bool) or data[k] < 1:
                raise HardwareError(f"{source}: field {k}: expected a positive integer, got {data[k]!r}")
            counts[k] = data[k]
    memory = int(vals.pop("device_memory_bytes"))
    return Hardware(name=data["name"], device_memory_bytes=memory, kind=kind, **counts, **vals)  # type: ignore[arg-type]  # vals: the float fields read from YAML


def hardware_names() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "hardware").glob("*.yaml"))


#: The profile a plan is made for when none is given and the device is a GPU.
DEFAULT_GPU_HARDWARE = "h100-pcie5"
#: ... and on the CPU backend's emulated device.
DEFAULT_CPU_HARDWARE = "cpu-emulated"
#: The profiles policies train on by default: every shipped GPU link, PCIe 3 to NVLink-C2C, and the
#: emulated CPU device.
TRAINING_HARDWARE = ("v100-pcie3", "a100-pcie4", "h100-pcie5", "rtx4090-pcie4", "gh200-c2c", "cpu-emulated")


#: Shipped profiles by what ``torch.cuda.get_device_name`` says, most specific first
_BY_DEVICE_NAME = (("GH200", "gh200-c2c"), ("H200", "h200-pcie5"), ("H100", "h100-pcie5"), ("A100", "a100-pcie4"),
                   ("V100", "v100-pcie3"), ("4090", "rtx4090-pcie4"))


def hardware_for_device(device_name: str) -> str | None:
    """The shipped profile of a GPU by its name (``"NVIDIA H200"`` -> ``h200-pcie5``), or None for
    a device no profile describes (then ``swapsched calibrate`` measures one)."""
    upper = device_name.upper()
    return next((profile for key, profile in _BY_DEVICE_NAME if key in upper), None)


def default_hardware(backend: str) -> str:
    """The profile name a plan is made for on ``backend`` ("cpu" or "cuda") when none is given:
    on CUDA the shipped profile of the device in use where one describes it, else
    ``DEFAULT_GPU_HARDWARE``."""
    if backend == "cpu":
        return DEFAULT_CPU_HARDWARE
    import torch

    if torch.cuda.is_available():
        return hardware_for_device(torch.cuda.get_device_name(torch.cuda.current_device())) or DEFAULT_GPU_HARDWARE
    return DEFAULT_GPU_HARDWARE


def load_hardware(spec: str | Path | Hardware) -> Hardware:
    """A profile by name (``h100-pcie5``) or by YAML path."""
    if isinstance(spec, Hardware):
        return spec
    spec_s = str(spec)
    path = Path(spec_s)
    if not (spec_s.endswith((".yaml", ".yml")) or path.is_file()):
        path = config_dir() / "hardware" / f"{spec_s}.yaml"
        if not path.is_file():
            raise HardwareError(f"unknown hardware {spec_s!r}; known: {', '.join(hardware_names())}, or a path to a YAML file")
    return hardware_from_dict(read_yaml(path, HardwareError), str(path))
