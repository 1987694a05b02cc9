"""``swapsched.fully_shard``: FSDP2 wrapped as a plan of one rank's step says (R18, live).

FSDP2 (``torch.distributed.fsdp.fully_shard``) fixes two things per unit as it wraps it: whether
the unit's shard, gradient and optimizer state live on the host (``CPUOffloadPolicy``: the plan's
``full``), and whether its parameters stay unsharded from forward to backward
(``reshard_after_forward=False``: the plan's ``unsharded``). Its own offload is all or nothing
for the whole model as users write it; pytorch#188120 asks for it per unit, by budget.

:func:`fully_shard` profiles the model on this device before it is sharded, shards the trace for
the mesh's ranks (``sharding.shard_trace``), plans that rank's step with a policy whose
placements are FSDP2's own (``state.FSDP2_PLACEMENTS``), and wraps each state group's module
(R13: a block, or a module outside the blocks) as a unit with its planned policies, the root
last. Rank 0 plans and broadcasts the plan; every rank wraps from the same plan, so their
collectives match.

**Prefetch.** FSDP2's implicit prefetch issues each unit's all-gather one unit ahead, which is
how the plan times it (R18, ``env/collectives.py``): nothing is set.

**Replans.** The policies are fixed at wrap time. ``SwapRuntime`` on the wrapped model plans the
activations (and ``stream`` on the units left on the device, ``state.SHARD_PLACEMENTS``) and
never changes a unit's offload; a different plan of the units needs a new wrap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from swapsched.agents.registry import get_policy
from swapsched.budget import BudgetError, format_bytes, parse_budget
from swapsched.env.simulator import simulate
from swapsched.errors import UserError
from swapsched.hardware import DEFAULT_CPU_HARDWARE, DEFAULT_GPU_HARDWARE, Hardware, load_hardware
from swapsched.plan import SwapPlan
from swapsched.policy import Policy
from swapsched.runtime.calibrate import calibrate_collectives
from swapsched.runtime.profiler import profile
from swapsched.sharding import shard_trace
from swapsched.state import FROZEN_SUFFIX, FSDP2_PLACEMENTS, group_name

__all__ = ["fully_shard", "ShardedPlan"]


@dataclass(frozen=True)
class ShardedPlan:
    """What :func:`fully_shard` planned and wrapped: the plan of one rank's step, its units (the
    state groups), those it gave ``CPUOffloadPolicy`` and those kept unsharded after forward, the rank's budget, and the
    step the simulator predicts for it."""

    plan: SwapPlan
    world_size: int
    budget_bytes: int
    units: tuple[str, ...]
    offloaded: tuple[str, ...]
    unsharded: tuple[str, ...]
    predicted_s: float
    peak_bytes: int


def fully_shard(model: nn.Module, inputs: tuple[Any, ...] | Any, loss_fn: Callable[[Any], torch.Tensor] = lambda out: out.sum(),
                *, budget: int | str, mesh: Any = None, optimizer: str = "adamw", policy: str | Policy = "default",
                hardware: str | Hardware | None = None, mp_policy: Any = None) -> ShardedPlan:
    """Plan ``model``'s sharded step for ``budget`` bytes a rank and wrap it with FSDP2 as the plan
    says (module docstring). Call it on every rank, with the process group initialized and the
    model not yet sharded, as one calls ``torch.distributed.fsdp.fully_shard``.

    ``inputs`` and ``loss_fn``: one step's example batch and loss (``loss_fn(model(*inputs))``),
    profiled on rank 0 before the model is sharded (a model built on ``meta`` is profiled by
    roofline for ``hardware``). ``optimizer``: the optimizer's name (``state.OPTIMIZERS``), whose
    state the plan counts. ``mesh``: FSDP2's device mesh (default: every rank, as FSDP2's).
    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy``, given to every unit (the all-gathers move its
    ``param_dtype``). Raises :class:`~swapsched.budget.BudgetError` on every rank where no plan
    fits."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise UserError("swapsched.fully_shard needs the process group: call torch.distributed.init_process_group first")
    units = _units(model)
    world = mesh.size() if mesh is not None else dist.get_world_size()
    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    on = next(model.parameters()).device.type
    hw = load_hardware(hardware or (DEFAULT_GPU_HARDWARE if on in ("meta", "cuda") else DEFAULT_CPU_HARDWARE))
    if hw.collective_bytes_per_s is None and world > 1:  # every rank: the group's own all-gathers, timed (R18)
        latency, bus, _ = calibrate_collectives("cpu" if on == "cpu" else f"cuda:{torch.cuda.current_device()}")
        hw = replace(hw, collective_bytes_per_s=bus, collective_latency_s=latency, gpus_per_node=world)
    plan: ShardedPlan | BaseException | None = None
    if dist.get_rank() == 0:
        try:
            plan = _plan(model, inputs, loss_fn, budget, world, optimizer, policy, hw, mp_policy)
        except UserError as exc:  # said on every rank, with nothing left waiting
            plan = exc
    shared = [plan]
    dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], BaseException):
        raise shared[0]
    planned = shared[0]
    assert isinstance(planned, ShardedPlan)
    placement = planned.plan.placement()
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # pinned host memory only beside CUDA

    def policy_of(unit: str) -> Any:
        # FSDP2 offloads a unit whole: its frozen part's group (R13) offloads it too
        return offload if "full" in (placement.get(unit), placement.get(unit + FROZEN_SUFFIX)) else OffloadPolicy()

    for name, modules in units.items():  # the deepest first: FSDP2 wraps a unit's children before it
        if name == "":
            continue
        torch_fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, mp_policy=mp_policy,
                          reshard_after_forward=name not in planned.unsharded, offload_policy=policy_of(name))
    root = "" in units
    torch_fully_shard(model, mesh=mesh, reshard_after_forward=not root or "" not in planned.unsharded, mp_policy=mp_policy,
                      offload_policy=policy_of("") if root else OffloadPolicy())
    return planned


def _units(model: nn.Module) -> dict[str, list[nn.Module]]:
    """FSDP2's units: each state group's module (R13's groups, ``state.group_name``), the deepest
    first; a module that shares a parameter with another group's (a tied weight) in one unit with
    it, named by the group that registers the parameter first (as the trace counts it), since
    FSDP2 manages each parameter in one unit."""
    owner: dict[int, str] = {}
    merged: dict[str, str] = {}  # a group -> the group whose unit it joins

    def lead(g: str) -> str:
        while merged.get(g, g) != g:
            g = merged[g]
        return g

    modules: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        params = [p for p in mod.parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        g = group_name(name)
        modules.setdefault(g, model.get_submodule(g) if g else model)
        for p in params:
            first = owner.setdefault(id(p), g)
            if lead(first) != lead(g):
                merged[lead(g)] = lead(first)
    if not modules:
        raise UserError("the model has no trainable parameter to shard")
    units: dict[str, list[nn.Module]] = {}
    for g, mod in modules.items():
        units.setdefault(lead(g), []).append(mod)
    return dict(sorted(units.items(), key=lambda kv: -kv[0].count(".") if kv[0] else 1))


def _plan(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor], budget: int | str, world: int,
          optimizer: str, policy: str | Policy, hw: Hardware, mp_policy: Any) -> ShardedPlan:
    """Rank 0's plan (module docstring)."""
    on_meta = next(model.parameters()).device.type == "meta"
    trace = profile(model, inputs, loss_fn, name=type(model).__name__, hardware=hw if on_meta else None, state=optimizer)
    model.zero_grad(set_to_none=True)  # the profiled step's gradients are not the user's
    master = next(p for p in model.parameters() if p.requires_grad).element_size()
    gather = torch.empty(0, dtype=mp_policy.param_dtype).element_size() if mp_policy.param_dtype is not None else master
    reduce = torch.empty(0, dtype=mp_policy.reduce_dtype).element_size() if mp_policy.reduce_dtype is not None else gather
    sharded = shard_trace(trace, world, master_bytes=master, gather_bytes=gather, reduce_bytes=reduce)
    # R18: the plan keeps to what FSDP2 carries out per unit
    sharded = replace(sharded, meta={**sharded.meta, "placements": list(FSDP2_PLACEMENTS)})
    if isinstance(budget, str) and budget.strip().endswith("%"):
        raise UserError(f"budget {budget!r}: give swapsched.fully_shard a rank's budget in bytes (an int, or '20GB')")
    nbytes = parse_budget(budget, sharded)
    pol = get_policy(policy) if isinstance(policy, str) else policy
    plan = pol.plan(sharded, nbytes, hw)
    bad = {g: w for g, w in plan.placement().items() if w not in FSDP2_PLACEMENTS}
    if bad:
        raise UserError(f"policy {plan.policy!r} placed {bad}, which FSDP2 cannot carry out per unit: use a policy "
                        f"whose plans keep to {', '.join(FSDP2_PLACEMENTS)} (default does)")
    r = simulate(sharded, plan, hw, nbytes, validate=False)
    if r.oom:
        raise BudgetError(f"policy {plan.policy!r}'s plan does not fit {format_bytes(nbytes)} a rank in simulation; "
                          "try a larger budget or policy='default'")
    offloaded = tuple(sorted({g.removesuffix(FROZEN_SUFFIX) for g, w in plan.placement().items() if w == "full"}))
    units = tuple(sorted({g.name.removesuffix(FROZEN_SUFFIX) for g in sharded.state}))
    return ShardedPlan(plan, world, nbytes, units, offloaded, tuple(sorted(plan.unsharded)), r.iteration_s, r.peak_bytes)
