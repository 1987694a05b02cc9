"""The training state as the trace records it: parameters, gradients and optimizer state, per
group, with their times of use (DESIGN.md R13-R16).

A *group* is the unit a state plan places: a block (the container element activation
checkpointing wraps, ``layers.3``, R9's naming) or, outside any container, a module that owns
parameters (``embed_tokens``, ``lm_head``). Each group records its bytes and four events of the
trace (R1's numbering; ``Trace.group_events`` reads them off its saved tensors):

- ``forward_at``: the first event whose gap computes with it in forward (its parameters must be
  on the device before that gap starts);
- ``forward_end``: the last event whose gap computes with it in forward (after that gap the
  forward is done with it);
- ``backward_at``: the first event at which backward computes with it (its first saved tensor
  unpacked: the node that reads it runs in the next gap);
- ``grad_at``: the event at whose start its gradient is complete (the gap after its last unpack
  ran; ``n_events`` is the tail's end: complete when backward is).

Groups with no saved tensor of their own to tell (an embedding whose only saved tensor is the
caller's batch) are read in the first gap of forward and complete at the tail.

A trace's ``static_bytes`` counts every group's bytes as before (a state plan that keeps them all
is the step every activation plan was made for); :attr:`Trace.fixed_bytes` is what no plan moves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swapsched.errors import UserError
from swapsched.segments import segment_of

__all__ = ["StateGroup", "OptimizerKind", "OPTIMIZERS", "MEASURED_OPTIMIZER_RATES", "optimizer_kind", "group_name", "PLACEMENTS", "SHARD_PLACEMENTS", "FSDP2_PLACEMENTS", "allowed_placements", "check_groups",
           "FROZEN_SUFFIX", "module_of", "frozen_placement", "DISK_TIERS", "DISK_PLACEMENTS", "allowed_disk_tiers"]


@dataclass(frozen=True)
class OptimizerKind:
    """What one optimizer keeps and touches per parameter element."""

    name: str
    # state tensors per parameter, each of the parameter's dtype, as torch.optim keeps them
    # (AdamW: two moments; SGD: a momentum buffer); Adafactor's factored second moment is
    # counted per tensor by the profiler instead
    states_per_param: float
    # bytes one step reads and writes per parameter element on the device (the step's roofline:
    # it is memory-bound), AdamW: reads p, g, m, v and writes p, m, v, fp32
    touched_bytes_per_param: float


OPTIMIZERS: dict[str, OptimizerKind] = {
    "adamw": OptimizerKind("adamw", 2.0, 28.0),
    "sgd": OptimizerKind("sgd", 1.0, 20.0),  # with momentum (torch.optim.SGD(momentum>0))
    "adafactor": OptimizerKind("adafactor", 0.0, 16.0),  # factored: rows + columns per matrix (profiler)
    "none": OptimizerKind("none", 0.0, 0.0),  # gradients only: no step (a frozen-optimizer probe)
}


#: R15, a trace's meta: the user's own optimizer as the runtime timed its ``step()`` in the
#: profiling steps, parameters a second, where it stepped them (``{"device": r}``, ``{"host": r}``
#: where the state stepped on the host; both on the emulated device, whose device is the host).
#: Beside it the hardware's rates are a different optimizer's (a memory roofline; calibrate's
#: fused AdamW), which torch's default CPU AdamW runs 10-20x slower than.
MEASURED_OPTIMIZER_RATES = "optimizer_params_per_s"


def optimizer_kind(name: str) -> OptimizerKind:
    if name not in OPTIMIZERS:
        raise UserError(f"optimizer {name!r} unknown; use one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


@dataclass(frozen=True)
class StateGroup:
    """One group's training state (module docstring)."""

    name: str
    params: int  # parameter elements
    param_bytes: int  # as stored (fp32 under autocast: the master copy; bf16 in pure bf16)
    grad_bytes: int
    optim_bytes: int
    forward_at: int
    forward_end: int
    backward_at: int
    grad_at: int
    #: Sharded (a trace of ``world_size`` > 1, ``swapsched/sharding.py``): the unit's unsharded
    #: parameters as all-gathered (compute dtype) and its unsharded gradient as reduce-scattered
    #: (reduce dtype); the four sizes above are then this rank's shard. 0: not sharded.
    gather_bytes: int = 0
    reduce_bytes: int = 0
    #: Frozen parameters (``requires_grad=False``: a LoRA model's base weights): no gradient, no
    #: optimizer state, no step (``grad_bytes`` and ``optim_bytes`` are 0). Named after the
    #: trainable group of the same modules with ``FROZEN_SUFFIX``; placed ``device`` or ``full``
    #: (resting on the host, fetched for each use and let go after it: ``frozen_placement``).
    frozen: bool = False
    #: The parameter tensors the group's bytes are in: each moves by a copy of its own, and each
    #: copy costs the host ``copy_issue_s`` (R6/R8's host costs, charged by ``env/state_exec.py``)
    tensors: int = 1

    @property
    def bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes


#: Where a plan puts a group's state (R13). ``device``: all of it on the device, the step there
#: (the default). ``param``: the parameter off the device between its forward and backward uses
#: (copied out after forward, fetched ahead of backward); gradients, optimizer state and the step
#: on the device. ``host-step``: the gradient copied to the host as it completes and the step run
#: there (the optimizer state lives on the host), the updated parameter copied back before its
#: next forward use (ZeRO-Offload's placement). ``stream``: the optimizer state on the host,
#: streamed in for the device step and out after it. ``full``: ``host-step`` with the parameter on
#: the device only while forward or backward computes with it (FSDP2's CPUOffloadPolicy).
#: ``stream-full``: nothing on the device between uses: the parameter as in ``full``, the gradient
#: copied out as in ``host-step``, and the device steps the group after backward, its parameter,
#: gradient and optimizer state streamed in and the parameter and state out (where the host's
#: optimizer is slower than the link, this beats the host step).
PLACEMENTS = ("device", "param", "host-step", "stream", "full", "stream-full")

#: R18, live: the placements the runtime carries out on FSDP2's shards (``runtime/shards.py``).
#: FSDP2 all-gathers a unit from the shard storage it holds, at moments of its own, and its
#: gradients and the user's optimizer step act on the parameter DTensors themselves: a placement
#: that takes a shard off the device between uses (``param``, ``full``, ``stream-full``) or steps
#: the parameter on the host (``host-step``) would have to re-point FSDP2's own tensors.
#: ``stream`` moves the optimizer state alone. A trace of such a step lists what its plan may use
#: in ``meta["placements"]`` (:func:`allowed_placements`).
SHARD_PLACEMENTS = ("device", "stream")
#: ... and those FSDP2 carries out itself, fixed per unit as ``fully_shard`` wraps it (R18,
#: ``swapsched/fsdp.py``): ``full`` is its ``CPUOffloadPolicy``
FSDP2_PLACEMENTS = ("device", "full")


def allowed_placements(meta: Mapping[str, Any]) -> tuple[str, ...]:
    """The placements a plan of a trace with ``meta`` may use (R18: a live sharded step's are
    ``SHARD_PLACEMENTS``); every one where the trace does not say."""
    return tuple(meta.get("placements", PLACEMENTS))


#: R19, the disk tier: what of a group's state at rest on the host rests on the disk instead.
#: ``optim``: its optimizer state, read for the group's step and written after it (DeepSpeed
#: ZeRO-Infinity's ``offload_optimizer: nvme``); ``state``: the parameter's master too, read for
#: each fetch of it (``offload_param: nvme``). The gradient stays on the host: the step that
#: reads it follows its arrival.
DISK_TIERS = ("optim", "state")
#: ... and the placements that keep something on the host to put there (``param``'s parameter
#: is copied out and back within one step: no rest on the disk)
DISK_PLACEMENTS = ("stream", "host-step", "full", "stream-full")


def allowed_disk_tiers(meta: Mapping[str, Any]) -> tuple[str, ...]:
    """The disk tiers a plan of a trace with ``meta`` may use (R19: the live runtime reads and
    writes the disk around the optimizer's step only: ``optim``; none on FSDP2's shards); every
    one where it does not say."""
    return tuple(meta.get("disk_tiers", DISK_TIERS))


#: R13: the suffix of a frozen group's name (the frozen parameters of the modules of the group
#: named without it)
FROZEN_SUFFIX = "/frozen"


def module_of(group: str) -> str:
    """The module path whose parameters group ``group`` holds (a frozen group's, without its suffix)."""
    return group[: -len(FROZEN_SUFFIX)] if group.endswith(FROZEN_SUFFIX) else group


def frozen_placement(where: str) -> str:
    """What placement ``where`` means for a frozen group, which has no gradient or step: it rests
    on the host and is fetched for each use where ``where`` keeps the parameter there between
    uses (``full``, ``stream-full``), else it stays on the device."""
    return "full" if where in ("full", "stream-full") else "device"


def group_name(module: str) -> str:
    """The group a module's parameters belong to: its block (R9's naming), else the module."""
    where = segment_of(module)
    if where is None:
        return module
    container, index = where
    return f"{container}.{index}" if container else str(index)


def check_groups(groups: Sequence[StateGroup], n_events: int, static_bytes: int) -> str | None:
    """What is wrong with ``groups`` for a trace of ``n_events`` events, or None."""
    names: set[str] = set()
    total = 0
    for g in groups:
        if g.name in names:
            return f"group {g.name!r} listed twice"
        names.add(g.name)
        if min(g.params, g.param_bytes, g.grad_bytes, g.optim_bytes, g.gather_bytes, g.reduce_bytes) < 0:
            return f"group {g.name!r} has negative bytes"
        if g.frozen and (g.grad_bytes or g.optim_bytes or not g.name.endswith(FROZEN_SUFFIX)):
            return f"frozen group {g.name!r} must be named ...{FROZEN_SUFFIX} and have no gradient or optimizer bytes"
        if not (0 <= g.forward_at <= g.forward_end < max(n_events, 1) and 0 <= g.backward_at <= g.grad_at <= n_events):
            return (f"group {g.name!r}: its events must satisfy 0 <= forward_at <= forward_end < n_events and "
                    f"backward_at <= grad_at <= n_events, got {g.forward_at}, {g.forward_end}, {g.backward_at}, {g.grad_at}")
        total += g.bytes
    if total > static_bytes:
        return f"the groups hold {total} bytes, more than the static bytes ({static_bytes}) that count them"
    return None
