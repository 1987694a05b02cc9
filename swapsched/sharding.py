"""Sharded training (FSDP2's ``fully_shard``, DeepSpeed ZeRO-3) as one rank's trace (R18).

Each of ``world_size`` ranks computes its own micro-batch, so a rank's activations are one
device's; what changes is the state. Every state group is one FSDP *unit* (a ``fully_shard``
call: by default each block, and the modules outside blocks). A rank holds ``1/world_size`` of
each unit's parameters, gradients and optimizer state (the *shard*, fp32 under FSDP2's
``MixedPrecisionPolicy``), and while the unit computes, its *unsharded* parameters: all-gathered
in the compute dtype before its forward (and again before its backward where it resharded after
forward), its unsharded gradient in the reduce dtype from its backward until the reduce-scatter
that leaves the rank its shard of it has run.

:func:`shard_trace` makes that trace from a one-device trace profiled as a rank computes (the
compute in bf16 on bf16 parameters, as ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` runs
it: no autocast copies of the weights). The simulator's collectives are ``env/collectives.py``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from swapsched.errors import UserError
from swapsched.trace import Trace

__all__ = ["shard_trace"]


def shard_trace(trace: Trace, world_size: int, *, master_bytes: int = 4, gather_bytes: int = 2,
                reduce_bytes: int = 4) -> Trace:
    """``trace`` (one device, its state recorded) as one rank's step of ``world_size`` ranks:
    each group's parameters, gradients and optimizer state sharded (``master_bytes`` an element,
    the optimizer's states per element kept), and its all-gather (``gather_bytes`` an element:
    the compute dtype) and reduce-scatter (``reduce_bytes``: the reduce dtype) recorded.
    ``world_size`` 1 is the trace itself."""
    if world_size < 1:
        raise UserError(f"world size must be at least 1, got {world_size}")
    if world_size == 1:
        return trace
    if trace.world_size != 1:
        raise UserError(f"trace {trace.name!r} is sharded already ({trace.world_size} ranks)")
    if not trace.state:
        raise UserError(f"trace {trace.name!r} records no state to shard: profile it with an optimizer (the default)")
    groups = []
    for g in trace.state:
        shard = math.ceil(g.params / world_size)
        states_per_param = g.optim_bytes / g.param_bytes if g.param_bytes else 0.0  # in elements, any dtype
        if g.frozen:  # R13: its own dtype, no gradient to reduce, no state
            groups.append(replace(g, params=shard, param_bytes=shard * (g.param_bytes // max(g.params, 1)),
                                  gather_bytes=g.params * gather_bytes))
            continue
        groups.append(replace(g, params=shard, param_bytes=shard * master_bytes, grad_bytes=shard * master_bytes,
                              optim_bytes=round(states_per_param * shard * master_bytes),
                              gather_bytes=g.params * gather_bytes, reduce_bytes=g.params * reduce_bytes))
    static = trace.fixed_bytes + sum(g.bytes for g in groups)
    return replace(trace, name=f"{trace.name}-x{world_size}", static_bytes=static, state=tuple(groups),
                   world_size=world_size, meta={**trace.meta, "world_size": world_size})
