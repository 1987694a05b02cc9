"""R19, live: the optimizer state of the groups a plan rests on the disk, around the user's
``optimizer.step()`` (the state mover's ``_before_optimizer_step`` and ``_after_optimizer_step``).

The runtime rests a group's optimizer state on the disk (tier ``optim``); its parameter's
master and gradient stay where the placement keeps them. Between steps the state tensors in
``optimizer.state`` are empty (their storages gone) and their bytes are in the group's file
(``disk_store.py``).

- **Host-stepped groups** (``host-step``, ``full``) step one at a time before the user's step:
  the group's state is read (the next group's read issued ahead), the optimizer steps it alone
  (every other parameter's gradient hidden: torch's optimizers skip a parameter with none), and
  its state is written back and let go. Their gradients are then hidden from the user's own step,
  which steps the rest, and put back after it. The step's arithmetic is the optimizer's own, per
  parameter: bit-identical to one step over all of them.
- **Streamed groups** (``stream``, ``stream-full``): the state is read before it streams in to
  the device and let go once it is there (the file is still current); after the device step,
  storages are made for it to stream out into, and it is written.
- ``optimizer.state_dict()`` reads every group's state back first (a checkpoint holds the
  current values; they are written again after the next step); ``load_state_dict`` makes the
  files stale (the loaded tensors are the state).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from swapsched.env.state_parts import STAGING_SLOTS
from swapsched.errors import UserError
from swapsched.runtime.disk_store import DiskStore
from swapsched.runtime.shards import like
from swapsched.state import DISK_PLACEMENTS

__all__ = ["StateOnDisk", "LIVE_DISK_TIERS"]

#: R19: the disk tiers the runtime carries out (a live trace lists them: ``state.allowed_disk_tiers``)
LIVE_DISK_TIERS = ("optim",)
_HOST_STEPPED = ("host-step", "full")


class StateOnDisk:
    """The disk groups of one state mover (module docstring). ``mover``: the ``StateMover``."""

    def __init__(self, mover: Any, store: DiskStore, tiers: Mapping[str, str]):
        bad = sorted(g for g, t in tiers.items() if t not in LIVE_DISK_TIERS)
        if bad:
            raise UserError(f"group {bad[0]!r} is planned with its parameter on the disk (tier {tiers[bad[0]]!r}): the "
                            f"runtime rests the optimizer state there ({', '.join(LIVE_DISK_TIERS)}, R19); plan with "
                            "policy='default', which keeps to that live")
        self.m, self.store = mover, store
        placed = {g: mover.users[g][0].placement for g in tiers if g in mover.users}
        wrong = sorted(g for g, w in placed.items() if w not in DISK_PLACEMENTS)
        if wrong:
            raise UserError(f"group {wrong[0]!r} is placed {placed[wrong[0]]!r}, which rests nothing on the host to put on "
                            f"the disk; place it one of {list(DISK_PLACEMENTS)}")
        self.host_stepped = [g for g in mover.forward_order if placed.get(g) in _HOST_STEPPED]
        self.streamed = [g for g in mover.forward_order if placed.get(g) in ("stream", "stream-full")]
        self._hidden: dict[int, torch.Tensor] = {}
        self._in: list[str] = []  # streamed groups read for this step's stream-in
        self._landing: dict[str, list[Any]] = {}  # ... whose copies to the device may still be under way
        self._at = (store.read_bytes, store.written_bytes, store.wait_s)  # the store's I/O as the last step began
        self._handles: list[Any] = []

    def _tensors(self, g: str) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
        """Group ``g``'s optimizer state: (its parameter's state, key, the tensor holding its bytes)."""
        out = []
        for mp in self.m.users[g]:  # the mover's own reading of it (StateAtRest._state_tensors)
            out += [(self.m.optimizer.state[mp.p], k, v) for k, v in self.m._state_tensors(mp)]
        return out

    def _owned(self, g: str) -> Iterable[torch.Tensor]:
        """Group ``g``'s state tensors, each the one owner of its storage: a host buffer that is a
        view of the pool's (``_host_buffer``) is copied to one of its own once, and the pool's
        buffer let go (a view would keep it alive after its storage is let go)."""
        for st, k, v in self._tensors(g):
            if v._base is not None:
                own = torch.empty_like(v, pin_memory=self.store.pin).copy_(v)
                if id(v) in self.m._host_state:
                    self.m._host_state.discard(id(v))
                    self.m._host_state.add(id(own))
                self.m.backend.pool.discard(v._base)
                st[k] = like(st[k], own)
                v = own
            yield v

    def rest(self, g: str) -> None:
        """Group ``g``'s state to the disk (written off the thread; its memory goes now)."""
        tensors = list(self._owned(g))
        if tensors:
            self.store.write(g, tensors)

    def rest_all(self) -> None:
        """At install (the mover's hooks on): every disk group's state that exists (made by
        earlier steps) to the disk; a checkpoint's read and load of the state hooked."""
        opt = self.m.optimizer
        self._handles = [opt.register_state_dict_pre_hook(lambda opt: self.store.load_all()),
                         opt.register_load_state_dict_pre_hook(lambda opt, sd: self._forget_all())]
        for g in (*self.host_stepped, *self.streamed):
            if g not in self.store:
                self.rest(g)

    def _forget_all(self) -> None:
        for g in (*self.host_stepped, *self.streamed):
            self.store.forget(g)

    # ------------------------------------------------------------------ the host's steps
    def step_on_host(self) -> None:
        """Before the user's step: each host-stepped disk group read, stepped alone and written
        (module docstring); their gradients hidden from the user's step."""
        groups = [g for g in self.host_stepped if any(mp.p.grad is not None for mp in self.m.users[g])]
        if not groups:
            return
        opt = self.m.optimizer
        params = [p for grp in opt.param_groups for p in grp["params"]]
        grads = {id(p): p.grad for p in params}
        # the optimizer's own step without the hooks around it (ours among them): functools.wraps
        # of torch's hook wrapper keeps it as __wrapped__
        raw = getattr(type(opt).step, "__wrapped__", None)
        self.store.prefetch(groups[0])
        try:
            for p in params:
                p.grad = None
            for k, g in enumerate(groups):
                self.store.load(g)
                if k + 1 < len(groups):
                    self.store.prefetch(groups[k + 1])
                for mp in self.m.users[g]:
                    mp.p.grad = grads[id(mp.p)]
                if raw is not None:
                    raw(opt)
                else:  # a class whose step torch did not wrap: its hooks run too (ours return at once)
                    self.m._disk_stepping = True
                    try:
                        opt.step()
                    finally:
                        self.m._disk_stepping = False
                for mp in self.m.users[g]:
                    mp.p.grad = None
                self.rest(g)
        finally:
            for p in params:
                p.grad = grads[id(p)]
        for g in groups:
            for mp in self.m.users[g]:
                if mp.p.grad is not None:
                    self._hidden[id(mp.p)] = mp.p.grad
                    mp.p.grad = None

    def after_step(self) -> None:
        """The user's step is done: the hidden gradients back."""
        self._in.clear()
        if self._hidden:
            for g in self.host_stepped:
                for mp in self.m.users[g]:
                    grad = self._hidden.pop(id(mp.p), None)
                    if grad is not None:
                        mp.p.grad = grad

    # ------------------------------------------------------------------ streamed groups
    def ahead(self) -> None:
        """As a step starts: the reads of the first groups the optimizer step needs are issued,
        two ahead (one staging buffer left for a write), so that they overlap the step's compute."""
        for g in [g for g in (*self.host_stepped, *self.streamed) if g in self.store][:STAGING_SLOTS - 1]:
            self.store.prefetch(g)

    def landing(self, g: str, tickets: list[Any]) -> None:
        """Copies of group ``g``'s state to the device were issued (``tickets``)."""
        if g in self._in:
            self._landing.setdefault(g, []).extend(tickets)

    def _let_go_landed(self, keep: int) -> None:
        """The groups streamed in, all but the last ``keep``: their copies waited for, their
        host copies let go (the files are current)."""
        while len(self._landing) > keep:
            g = next(iter(self._landing))
            for t in self._landing.pop(g):
                self.m.backend.wait_host(t)
            self.store.release(g)

    def before_stream_in(self, g: str) -> None:
        """Group ``g``'s state read before it streams in (the next streamed group's read ahead);
        the one before the last let go once its copies landed (a staging buffer's worth in host
        memory at a time)."""
        if g not in self.streamed or g in self._in:
            return
        self._let_go_landed(keep=1)
        self._in.append(g)
        self.store.load(g)
        later = self.streamed[self.streamed.index(g) + 1:]
        if later:
            self.store.prefetch(later[0])

    @property
    def streaming(self) -> bool:
        """Whether this step streams in a group read from the disk."""
        return bool(self._in)

    def streamed_in(self) -> None:
        """The stream-ins landed (the caller waited for them): the host's copies go (the files
        are current)."""
        self._let_go_landed(keep=0)
        for g in self._in:
            self.store.release(g)

    def before_stream_out(self, g: str) -> None:
        """Storages for group ``g``'s state to stream out into (written by ``streamed_out``)."""
        if g in self._in:
            self.store.allocate(g)

    def streamed_out(self, g: str) -> None:
        """Group ``g``'s stream-out landed: its state written and let go."""
        if g in self._in:
            self.rest(g)

    def begin(self) -> None:
        """The optimizer step starts: its disk I/O counts from here."""
        st = self.store
        self._at = (st.read_bytes, st.written_bytes, st.wait_s)

    def report(self) -> dict[str, Any]:
        """``StateStepReport``'s disk fields: what rests there, the last optimizer step's I/O."""
        st = self.store
        read, written, wait = self._at
        return dict(disk_bytes=st.resting_bytes, disk_read_bytes=st.read_bytes - read,
                    disk_written_bytes=st.written_bytes - written, disk_wait_s=st.wait_s - wait,
                    staging_bytes=st.staging_bytes)

    def remove(self) -> None:
        """Every group's state back in memory (the mover goes), the hooks off."""
        self.store.load_all()
        self.store.settle()
        for h in self._handles:
            h.remove()
