"""A parameter's compute copy under autocast, held only while it is used (DESIGN R12, "compute copy").

Under ``torch.autocast`` a layer computes with a lower-precision cast of its fp32 weight, and the
node that needs the weight in backward (a matmul's input gradient) saves that cast. Plain PyTorch
so holds every weight's cast from its forward to its backward: a 7B model's bf16 copies, 13 GiB,
beside the fp32 masters for the whole step, whatever a plan does with the masters. FSDP2's
``MixedPrecisionPolicy`` instead holds a unit's bf16 parameters only while the unit computes, and
makes them again for backward.

The runtime's hooks do the same here. A saved tensor that is a cast of a parameter (or a view of
one) is packed as :class:`Recast`: the parameter, the cast's dtype and the geometry of the view,
and no reference to the cast itself, so the cast dies with the forward op that used it. Each
unpack makes the cast again from the parameter (the same bytes: a cast is deterministic), which
the node that reads it then holds until it has run. So the compute copy is on the device only
while forward or backward computes with it, and a parameter placed off the device between its
uses (R13 ``full``, ``stream-full``) frees both copies; the state mover is told of the unpack
first, so the parameter is fetched before it is read (R14).

Autocast's own cache would keep the casts of a region alive until it ends (the whole forward), so
a step turns it off (:func:`no_autocast_cache`): ``torch.autocast`` regions entered inside the
step inherit that. The cost is one cast per weight a backward node reads, a pass over the bytes
that the profiled and executed steps time like any op of backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Recast", "parameter_cast", "recast", "no_autocast_cache"]


def parameter_cast(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(parameter, cast)`` where ``t`` is a cast of a leaf that requires grad (a parameter), or a
    view of one: what autocast makes of a weight; else None. Saved-tensor hooks run with autocast
    turned off, so the cast is recognised by its graph: a ``ToCopyBackward0`` whose only input is
    a leaf's ``AccumulateGrad``."""
    for x in (t, t._base):
        fn = None if x is None else x.grad_fn
        if x is not None and fn is not None and type(fn).__name__ == "ToCopyBackward0":
            nxt = fn.next_functions
            if len(nxt) == 1 and nxt[0][0] is not None and type(nxt[0][0]).__name__ == "AccumulateGrad":
                param: torch.Tensor = getattr(nxt[0][0], "variable")  # noqa: B009 (not in torch's stubs)
                return param, x
            return None
    return None


class Recast:
    """A saved cast of a parameter, kept as what remakes it (module docstring)."""

    __slots__ = ("param", "dtype", "base", "view", "version")

    def __init__(self, param: torch.Tensor, cast: torch.Tensor, t: torch.Tensor):
        # the parameter is alive for the step anyway (the model holds it); the cast is not held
        self.param = param
        self.dtype = cast.dtype
        self.base = (tuple(cast.shape), tuple(cast.stride()))
        self.view = None if t is cast else (tuple(t.shape), tuple(t.stride()), t.storage_offset())
        self.version = param._version

    @classmethod
    def of(cls, t: torch.Tensor) -> Recast | None:
        """``t`` packed as a recast, where it is a cast of a parameter; else None."""
        found = parameter_cast(t)
        return None if found is None else cls(found[0], found[1], t)

    def make(self) -> torch.Tensor:
        """The cast again, from the parameter as it is now (it must be on the device: R14)."""
        if self.param._version != self.version:
            # autograd's own check would have used the cast made before the change; refuse, as it
            # refuses a saved tensor changed in place
            raise RuntimeError(
                "a parameter autocast cast for forward was changed in place before backward read its cast "
                f"(version {self.param._version}, expected {self.version}); swapsched makes the cast again "
                "from the parameter, so change parameters only after backward (optimizer.step())")
        size, stride = self.base
        out = torch.empty_strided(size, stride, dtype=self.dtype, device=self.param.device)
        out.copy_(self.param.detach())
        if self.view is not None:
            out = out.as_strided(*self.view)
        return out


def recast(packed: Recast, state: Any, event: int) -> torch.Tensor:
    """Unpack ``packed`` at trace event ``event`` (-1: a profiling step's): the state mover
    (``state``, a ``StateMover`` or None) fetches the parameter first where its plan placed it off
    the device (R14), then the cast is made from it."""
    if state is not None:
        state.at_unpack(event, packed.param)
    return packed.make()


@contextlib.contextmanager
def no_autocast_cache() -> Iterator[None]:
    """Autocast's cache of weight casts off inside (module docstring), as it was after."""
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)
