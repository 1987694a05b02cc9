"""What autograd keeps per saved tensor under the runtime's hooks, and what the runtime keeps per storage.

``Packed`` is what a pack hook returns and autograd keeps (the runtime holds only weak references
to it): the record and, while the record is resident, a detached alias of the original tensor
(which keeps the storage alive, and is what unpacking a kept tensor returns). ``Record`` is one
saved storage (R2). When it is evicted, its swap-out ticket holds the device storage (a flat
``uint8`` view) until the copy completes, each handle keeps only its view's geometry (dtype, size,
stride, offset), and the record keeps the host buffer; after a swap-in the record holds the new
device storage and unpacks rebuild the views on it. The profiling and the executing steps return
the same ``Packed``; ``profiled`` says which one made it.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch

from swapsched.env.events import RESIDENT
from swapsched.runtime.backends import Ticket

__all__ = ["Record", "Packed", "UNTRACKED", "rebuild", "flat_bytes"]


class Record:
    """One saved storage (R2). Plain slots: one is made per saved tensor, on the hot path."""

    __slots__ = ("tid", "nbytes", "key", "flat", "host", "state", "out", "inn", "handles")

    def __init__(self, tid: int, nbytes: int, key: int = 0, host: torch.Tensor | None = None, state: int = RESIDENT):
        self.tid, self.nbytes, self.key = tid, nbytes, key  # key: the storage's identity
        self.flat: torch.Tensor | None = None  # uint8 view of the device storage after a swap-in
        self.host, self.state = host, state
        self.out: Ticket | None = None
        self.inn: Ticket | None = None
        # weak references: autograd owns the handles and drops each once its node has run, which
        # is what frees a kept tensor as early as plain PyTorch would
        self.handles: list[weakref.ref[Packed]] = []

    def live_handles(self) -> list[Packed]:
        return [h for h in (r() for r in self.handles) if h is not None]


UNTRACKED = Record(-1, 0)  # the step's key map entry for parameters and storages the trace lacks


def _origin_died(packed: weakref.ref[Packed], _dead: object) -> None:
    """The program's tensor died: read the version its storage ended with, and let the alias go."""
    p = packed()
    if p is not None and p.watch is not None:
        p.seen = p.watch._version
        p.watch = None


class Packed:
    """What autograd keeps per pack: the record and, while it is resident, a detached alias.

    It also keeps autograd's own check on saved tensors, which saved-tensor hooks otherwise lose
    (``save_on_cpu`` computes silently with a value changed in place): the version counter at
    pack, compared at unpack with the last version the bytes could have reached (``check_version``).
    A swap-out copies the bytes while the program may still hold its tensor and change it, so a
    let-go alias is kept (``watch``) until the program's tensor dies: that tensor holds the same
    storage, so the alias costs no memory, and its version counter is the one the change bumps."""

    __slots__ = ("rec", "tid", "profiled", "tensor", "geometry", "version", "seen", "watch", "origin", "__weakref__")

    def __init__(self, rec: Record | None, t: torch.Tensor, tid: int | None = None, profiled: bool = False):
        # a detached alias: holding the tensor itself would tie it to its own grad_fn in a
        # reference cycle (the handle lives in that grad_fn) that only the cyclic GC frees;
        # autograd re-attaches the grad_fn when it unpacks (as with save_on_cpu's copies). The
        # alias shares the tensor's storage and its version counter.
        self.rec = rec
        self.tensor: torch.Tensor | None = t.detach()
        # the profiling step's trace id (None for a parameter; an executing step's is rec.tid), and
        # which kind of step made it: a step that hands its hooks over mid-step gets both kinds back
        self.tid, self.profiled = tid, profiled
        self.version = self.seen = t._version
        self.watch: torch.Tensor | None = None
        # the callback holds this record weakly: a strong one would keep it alive past autograd
        self.origin = weakref.ref(t, partial(_origin_died, weakref.ref(self)))
        # (dtype, size, stride, storage offset, conj bit, neg bit): taken when the tensor reference
        # is dropped. The two bits are lazy views over the same bytes (a complex tensor's conj()),
        # so the raw storage alone would give back the unconjugated values.
        self.geometry: tuple[Any, ...] | None = None

    def let_go(self) -> None:
        """Drop the tensor reference, keeping what is needed to rebuild the view and to check it."""
        t = self.tensor
        if t is not None:
            self.geometry = (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.is_conj(), t.is_neg())
            self.seen = t._version
            self.tensor = None
            if self.origin() is not None:
                self.watch = t

    def check_version(self) -> None:
        """Refuse a saved tensor changed in place since its pack, as autograd does without hooks."""
        t = self.tensor if self.tensor is not None else self.watch
        now = t._version if t is not None else self.seen
        if now != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a saved tensor is at version {now}; expected version {self.version} instead. "
                "(swapsched keeps autograd's check; clone the tensor before changing it in place.)")



def rebuild(p: Packed, flat: torch.Tensor) -> torch.Tensor:
    """``p``'s view, rebuilt on the storage of ``flat`` (a swap-in buffer or a host copy brought back)."""
    assert p.geometry is not None, "a let-go tensor keeps its geometry"
    dtype, size, stride, offset, conj, neg = p.geometry
    out = torch.empty(0, dtype=dtype, device=flat.device).set_(flat.untyped_storage(), offset, size, stride)
    if neg:
        out = torch._neg_view(out)
    return out.conj() if conj else out


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A ``uint8`` view of ``t``'s whole storage: what a copy moves (R2: the storage, not the view)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
