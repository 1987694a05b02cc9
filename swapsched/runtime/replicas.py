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

On several ranks (DDP or FSDP2, R18) the run's first plan is refused on every rank alike
(:func:`on_every_rank`), a rank's wait for another is bounded (:func:`bound_rank_waits`), a step's
error says which rank failed (:func:`note_the_other_ranks`), and :func:`every_rank` gathers the
ranks' reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import TypeVar

import torch
from torch.nn.parallel import DistributedDataParallel

from swapsched.errors import UserError
from swapsched.trace import Trace

T = TypeVar("T")

__all__ = ["replica", "reducing_replica", "gradients_complete_at_backward_end", "on_every_rank", "bound_rank_waits",
           "note_the_other_ranks", "RANK_WAIT", "every_rank"]


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


def on_every_rank(distributed: bool, act: Callable[[], None]) -> None:
    """Run ``act``. Where the model trains on several ranks (``distributed``: DDP or FSDP2, with
    the process group up), a :class:`UserError` (a ``BudgetError`` too) raised on any rank is
    raised on every rank: the lowest failing rank's, of its type and with its message, which
    names that rank. A rank whose plan fitted would otherwise go on into the next step's
    collectives, waiting for a rank that has stopped. Every rank calls it at the same step (one
    collective)."""
    import torch.distributed as dist

    if not (distributed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        act()
        return
    bound_rank_waits()
    mine: UserError | None = None
    try:
        act()
    except UserError as exc:
        mine = exc
    said: list[tuple[type[UserError], str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(said, None if mine is None else (type(mine), str(mine)))
    failed = [(r, s) for r, s in enumerate(said) if s is not None]
    if not failed:
        return
    rank, (kind, message) = failed[0]
    raise kind(f"rank {rank} of {len(said)}: {message}") from mine


#: How long a rank waits in a collective for a rank that stopped answering, where the process
#: group has torch's own default for gloo (30 minutes): NCCL's default, 10 minutes. A timeout the
#: user gave ``init_process_group`` stays.
RANK_WAIT = timedelta(minutes=10)


def bound_rank_waits() -> None:
    """The default process group's timeout lowered to ``RANK_WAIT`` where it is torch's gloo
    default, so that a rank left waiting for one that hangs exits within it (R18)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout, default_pg_timeout

    if not (dist.is_available() and dist.is_initialized()):
        return
    group = _get_default_group()
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        if options is not None and options._timeout == default_pg_timeout:
            _set_pg_timeout(RANK_WAIT, group)
            return


def note_the_other_ranks(exc: BaseException, distributed: bool, step: int) -> None:
    """A collective that fails inside a step of a model on several ranks is most often another
    rank that stopped: said on the error (its type and message stay torch's)."""
    import torch.distributed as dist

    if distributed and isinstance(exc, RuntimeError) and dist.is_available() and dist.is_initialized():
        exc.add_note(f"swapsched: rank {dist.get_rank()} of {dist.get_world_size()} failed in step {step}; where a "
                     "collective failed, another rank most often stopped first: its own log says why")


def every_rank(record: T) -> tuple[T, ...]:
    """``record`` of every rank, in rank order, on every rank (one collective; every rank calls
    it); ``(record,)`` on one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return (record,)
    out: list[T | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, record)
    return tuple(r for r in out if r is not None)
