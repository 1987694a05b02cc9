"""Data parallel (``DistributedDataParallel``): which replica's all-reduce a step's gradients
wait for, and what that means for a plan (R17).

DDP's reducer reads each ``p.grad`` as its bucket fills in backward, divides it by the world size,
all-reduces the bucket, and writes the mean back into ``p.grad`` in a callback autograd's engine
runs once backward's last node has run (``finalize_backward``). A gradient copied to the host as
it completes would miss the mean (the host would keep this rank's own gradient), and a gradient
accumulated on the host under ``no_sync()`` would never be reduced at all. So under a reducing
DDP a gradient is complete only when backward ends: the mover keeps it on the device until then
and copies the reduced one out, and the plan counts it there (every group's ``grad_at`` at the
tail).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.nn.parallel import DistributedDataParallel

from swapsched.trace import Trace

__all__ = ["replica", "reducing_replica", "gradients_complete_at_backward_end"]


def replica(model: torch.nn.Module) -> DistributedDataParallel | None:
    """Called inside ``model``'s forward (a forward pre-hook): the DDP that runs it, or None.
    ``model`` may be the DDP itself or the module it wraps (DDP marks its forward as active)."""
    if isinstance(model, DistributedDataParallel):
        return model
    return DistributedDataParallel._get_active_ddp_module()


def reducing_replica(model: torch.nn.Module) -> DistributedDataParallel | None:
    """As :func:`replica`, where this forward's backward all-reduces its gradients (not under
    ``no_sync()``, and with autograd recording): DDP decides that in its forward, from the same
    two conditions."""
    ddp = replica(model)
    if ddp is None or not torch.is_grad_enabled() or not ddp.require_backward_grad_sync:
        return None
    return ddp


def gradients_complete_at_backward_end(trace: Trace) -> Trace:
    """``trace`` with every group's gradient complete at the tail (module docstring): a host-placed
    gradient is held on the device from its first accumulation until backward ends."""
    if not trace.state:
        return trace
    return replace(trace, state=tuple(replace(g, grad_at=trace.n_events) for g in trace.state))
