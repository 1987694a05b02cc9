"""FSDP2's shards in a live step (R18): each parameter ``fully_shard`` manages is a ``DTensor``
whose bytes on this rank are its local tensor (``_local_tensor``, a view of the padded flat
storage FSDP2 all-gathers from, ``FSDPParam._sharded_param_data``); its gradient and its
optimizer state (torch.optim makes those with ``zeros_like``) are DTensors of the same layout.

What the runtime counts and moves of such a tensor is its local tensor: the DTensor's own
``untyped_storage()`` is a wrapper's, sized as the whole parameter. A moved optimizer state is
put back as a new DTensor over the moved local tensor (FSDP2's own CPU offload keeps its shards
so, a DTensor over a host tensor); the parameters themselves are never re-pointed, since FSDP2
all-gathers from the storage it holds, not from the parameter (``SHARD_PLACEMENTS``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["local_of", "like", "is_sharded", "sharded_ids", "offloaded_by_fsdp", "held_between_micro_batches"]


def _dtensor() -> Any:
    if not torch.distributed.is_available():  # a torch built without distributed has no DTensor
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s bytes on this rank: a DTensor's local tensor, else ``t``."""
    dt = _dtensor()
    return t._local_tensor if dt is not None and isinstance(t, dt) else t  # type: ignore[attr-defined]


def like(ref: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``ref`` is: a DTensor of ``ref``'s layout over it where ``ref`` is one (its
    local tensor is ``local`` itself, so identity checks on local tensors hold), else ``local``."""
    dt = _dtensor()
    if dt is None or not isinstance(ref, dt):
        return local
    return dt(local, ref._spec, requires_grad=False)


def sharded_ids(model: nn.Module) -> set[int]:
    """The ids of ``model``'s DTensor parameters (``fully_shard``, or tensor parallel)."""
    dt = _dtensor()
    return set() if dt is None else {id(p) for p in model.parameters() if isinstance(p, dt)}


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor."""
    return bool(sharded_ids(model))


def offloaded_by_fsdp(model: nn.Module) -> set[int]:
    """The ids of ``model``'s parameters whose FSDP2 unit has ``CPUOffloadPolicy``: their shard,
    gradient and optimizer state live on the host, FSDP2's to move (``swapsched.fully_shard``'s
    ``full`` units), never the device's (on the emulated device too, where FSDP2's copies to the
    host change nothing). Read off each unit's FSDP state: FSDP2 has no public getter for it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return set()
    out: set[int] = set()
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        group = mod._get_fsdp_state()._fsdp_param_group
        if group is not None:
            out |= {id(fp.sharded_param) for fp in group.fsdp_params if fp.offload_to_cpu}
    return out


def held_between_micro_batches(model: nn.Module) -> int:
    """The bytes of the unsharded gradients FSDP2 holds now for ``model``'s units: kept from a
    backward that did not reduce-scatter them (``set_requires_gradient_sync(False)``) to the one
    that does. Read off each unit's FSDP state, as :func:`offloaded_by_fsdp`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return 0
    total = 0
    for mod in model.modules():
        group = mod._get_fsdp_state()._fsdp_param_group if isinstance(mod, FSDPModule) else None
        for fp in group.fsdp_params if group is not None else ():
            unsharded = getattr(fp, "_unsharded_param", None)
            grad = fp.unsharded_accumulated_grad if fp.unsharded_accumulated_grad is not None else \
                (unsharded.grad if unsharded is not None else None)
            if grad is not None:
                total += local_of(grad).untyped_storage().nbytes()
    return total
