"""The training state moved in real training (R13-R16): parameters fetched ahead of their uses and
let go after, gradients copied out as they are produced, the optimizer's state streamed in for a
device step, and host steps run by the user's own optimizer.

:class:`StateMover` carries a plan's ``state`` placements (``swapsched/state.py``) out on a model
and its optimizer, on either backend (``backends.py``: the emulated device's copy engines, or CUDA
copy streams with pinned host buffers). The user's loop does not change: ``optimizer.step()`` and
``zero_grad()`` stay the user's calls; optimizer step hooks put each group's tensors where its
placement steps it, around the user's own step.

**Where a parameter is.** Between steps ("at rest") every tensor is where the user can read and
change it: a placement that steps on the host (``host-step``, ``full``) or keeps its master there
(``stream-full``) leaves ``p.data`` and ``p.grad`` as the host tensors, so ``clip_grad_norm_``,
``state_dict()`` and ``load_state_dict()`` see the current values and ``optimizer.step()`` steps
them on the host; ``device``, ``param`` and ``stream`` leave the parameter on the device. Within
a step (``begin_step`` to ``end_step``) a parameter being used lives in a device storage; "let
go" resizes that storage to 0 bytes and a fetch resizes it back and copies into it. Autograd's
saved views of the parameter (``weight.t()``) share the storage, so they see the fetched bytes
and never hold the released ones; the copies write through a separate tensor on the storage, so
the parameter's version counter (autograd's check on saved tensors) does not move.

**When.** A group's forward fetch is issued as the previous fetched group's forward starts (the
first as the step starts) and waited for by a forward pre-hook on the group's module; its
parameters are let go by the forward hook (``param``: once their copy out lands). In backward a
parameter is fetched when autograd first unpacks a saved tensor on its storage
(:meth:`at_unpack`, called by the step's unpack hook, at the group's ``backward_at`` event or at a
kept tensor on its storage), and the next group's fetch is issued then (R14: one group ahead); it
is let go once its gradient is complete. A gradient that leaves
the device is copied out from its post-accumulate hook into a host buffer and added to the
gradient kept there (gradient accumulation: ``g1 + g2`` in the order autograd adds them).
Under a DDP that reduces this step's gradients (``replicas.py``) a host-placed gradient stays on
the device until DDP has written the mean into it, and only then goes to the host.

**What keeps tensors alive during a copy.** Every copy's ``Ticket`` holds its source until the
copy completes; a storage is resized to 0 only after the copy reading it is complete (polled at
every hook, waited for where its room or its bytes are needed); host buffers are the mover's own
for the run (the host masters, gradients and state), or go back to the pool once added.

Host steps run inside the user's ``optimizer.step()``, after backward (the plan's ``host_step`` is
executed as ``"after-backward"``: a step that overlapped backward could not see the clipping and
accumulation the user does after it). Streamed state comes in at ``optimizer.step()`` too.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from swapsched.errors import UserError
from swapsched.runtime.backends import Backend, Ticket
from swapsched.runtime.disk_store import DiskStore
from swapsched.runtime.mode_time import ModeTime
from swapsched.runtime.shards import local_of, sharded_ids
from swapsched.runtime.state_disk import StateOnDisk
from swapsched.runtime.state_fetches import DeviceStorages
from swapsched.runtime.state_rest import (
    _RELEASED,
    HOST_PLACEMENTS,
    Handover,
    _alias,
    _Param,
    present_dev,
    present_host,
)
from swapsched.state import FROZEN_SUFFIX, PLACEMENTS, SHARD_PLACEMENTS, StateGroup, frozen_placement, group_name, module_of

__all__ = ["StateMover", "HOST_PLACEMENTS"]

class StateMover(DeviceStorages):
    """Carries ``placement`` (group -> ``state.PLACEMENTS``) out on ``model`` and ``optimizer``
    (module docstring). ``groups``: the trace's state groups (their forward order); ``on_bytes``:
    called with each change of the state's device bytes beyond the resident part (the executing
    step's accounting adds them to its static bytes). ``handover``: what the last mover left on
    the host (a change of plan, ``StateAtRest.hand_over``): it stays there where this placement
    keeps it on the host. ``disk``: R19, the store and the groups (with their tiers) whose
    optimizer state rests on the disk (``state_disk.py``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, backend: Backend,
                 groups: Sequence[StateGroup], placement: Mapping[str, str], handover: Handover | None = None,
                 disk: tuple[DiskStore, Mapping[str, str]] | None = None):
        bad = {w for w in placement.values() if w not in PLACEMENTS}
        if bad:
            raise UserError(f"unknown placement(s) {sorted(bad)}; use one of {', '.join(PLACEMENTS)}")
        self.model, self.optimizer, self.backend = model, optimizer, backend
        self.placement = {g: w for g, w in placement.items() if w != "device"}
        self.on_bytes: Callable[[int], None] | None = None
        # the room a fetch may take now (the executing step's; None: no budget to wait for)
        self.room: Callable[[], int] | None = None
        self.timer: ModeTime | None = None  # a profiling step's instruments (_charged)
        # the seconds spent in its hooks so far (module, gradient and unpack hooks, backward's end),
        # and of them blocked in the backend's waits: an executing step takes them out of the
        # compute gaps they fell in (R1), as the profiling steps' timer does (execute_step.py)
        self.spent_s = self.waited_s = 0.0
        self._waiting: list[_Param] = []  # fetches waiting for room, in issue order (R6)
        # gradients on their way to the host, in issue order: (parameter, copy, host buffer)
        self._grad_outs: deque[tuple[_Param, Ticket, torch.Tensor]] = deque()
        self.eager = False  # fetch on demand in the calling thread (the profiling steps': state_plans.py)
        self.in_step = False
        self.transient = self.peak_transient = 0
        self.copied = 0
        self.optimizer_step_s: float | None = None
        self._t_step = 0.0
        self._handles: list[Any] = []
        self._by_storage: dict[int, _Param] = {}  # a released parameter's device storage -> it
        self._host_state: set[int] = set()  # ids of the optimizer-state tensors that are host buffers
        self._streamed: dict[int, torch.Tensor] = {}  # a streamed-in state tensor's id -> its host tensor
        self._backward = False
        self._next_backward = 0  # index in backward_order of the next group backward reaches
        self._reduced = self._rest_after_reducer = False  # state_grads.py
        self._held = {}
        # parameters per group (each once, in the group of the module that registers it first, as
        # profiler.state_groups counts it), and which groups' modules use each (a tied weight)
        owner: dict[int, str] = {}
        users: dict[str, list[nn.Parameter]] = {}
        names: dict[int, str] = {}
        for mod_name, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                g = group_name(mod_name) + ("" if p.requires_grad else FROZEN_SUFFIX)  # R13: frozen apart
                owner.setdefault(id(p), g)
                names.setdefault(id(p), f"{mod_name}.{pname}" if mod_name else pname)
                if all(q is not p for q in users.setdefault(g, [])):
                    users[g].append(p)
        unknown = set(self.placement) - set(users)
        if unknown:
            raise UserError(f"placement names group(s) {sorted(unknown)} that own no trainable parameter of the model")
        in_optimizer = {id(p) for grp in optimizer.param_groups for p in grp["params"]}
        shards = sharded_ids(model)
        self.params: dict[int, _Param] = {}
        for ps in users.values():
            for p in ps:
                where = self.placement.get(owner[id(p)], "device")
                if where == "device" or id(p) in self.params:
                    continue
                if not p.requires_grad and where != frozen_placement(where):
                    raise UserError(f"group {owner[id(p)]!r} is frozen (no gradient, no step) and placed {where!r}: "
                                    "a frozen group rests on the device or on the host ('full')")
                if p.requires_grad and id(p) not in in_optimizer:
                    raise UserError(f"parameter {names[id(p)]!r} is placed ({where}) but not in the optimizer; "
                                    "give the optimizer that steps the model, or keep its group on the device")
                if id(p) in shards and where not in SHARD_PLACEMENTS:
                    raise UserError(f"group {owner[id(p)]!r} is placed {where!r}, and its parameter {names[id(p)]!r} is an "
                                    "FSDP2 shard (DTensor), which FSDP2 all-gathers from a storage of its own: on shards "
                                    f"the runtime carries out {', '.join(SHARD_PLACEMENTS)} (R18); plan with "
                                    "policy='default', which keeps to those, or wrap with swapsched.fully_shard, which "
                                    "gives FSDP2's CPUOffloadPolicy to the units a plan offloads whole")
                data = local_of(p)  # a shard's own bytes (R18)
                if not data.is_contiguous():
                    raise UserError(f"parameter {names[id(p)]!r} is not contiguous; it cannot move (keep its group on the device)")
                self.params[id(p)] = _Param(p, names[id(p)], owner[id(p)], where, data.numel() * data.element_size())
        self.users = {g: [self.params[id(p)] for p in ps if id(p) in self.params] for g, ps in users.items()}
        self.users = {g: ps for g, ps in self.users.items() if ps}
        if not self.params:
            raise UserError("the placement moves no trainable parameter of the model")
        self.device = local_of(next(iter(self.params.values())).p).device
        order = {grp.name: i for i, grp in enumerate(sorted(groups, key=lambda grp: grp.forward_at))}
        self.forward_order = sorted(self.users, key=lambda g: order.get(g, len(order)))
        # backward reaches each group at its backward_at (R13), the last forward group first
        back_at = {grp.name: grp.backward_at for grp in groups}
        self.backward_order = sorted(self.users, key=lambda g: (back_at.get(g, 0), -order.get(g, 0)))
        self.backward_at = [back_at.get(g, 0) for g in self.backward_order]
        # R13: frozen groups fetched for backward are let go once its last use of them is past
        # (their ``grad_at``: no gradient tells it), in that order
        grad_at = {grp.name: grp.grad_at for grp in groups}
        self.frozen_done = sorted((grad_at.get(g, 0), g) for g, ps in self.users.items()
                                  if g.endswith(FROZEN_SUFFIX) and any(mp.placement in _RELEASED for mp in ps))
        self._next_frozen = 0
        # R19: the groups whose optimizer state rests on the disk (``disk``: the store, group -> tier),
        # checked before anything moves
        self.disk_tiers = dict(disk[1]) if disk is not None else {}
        self._disk_stepping = False
        self.disk = StateOnDisk(self, disk[0], self.disk_tiers) if self.disk_tiers and disk is not None else None
        self._check_host_step()
        self._to_rest_at_install(handover)
        self._install_hooks()
        if self.disk is not None:
            self.disk.rest_all()

    # ------------------------------------------------------------------ setup
    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor of ``like``'s shape and dtype from the backend's pool (pinned on CUDA)."""
        nbytes = like.numel() * like.element_size()
        return self.backend.pool.take(nbytes).view(like.dtype).view(like.shape)

    def _install_hooks(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(lambda m, a: self._forward_starts()))
        for g in self.users:
            mod = self.model.get_submodule(module_of(g)) if module_of(g) else self.model
            self._handles.append(mod.register_forward_pre_hook(lambda m, a, g=g: self._charged(self._enter, g)))
            self._handles.append(mod.register_forward_hook(lambda m, a, o, g=g: self._charged(self._leave, g)))
        # each module inside a group that owns placed parameters: they are on the device before it
        # runs, also where its group's own hooks do not (a checkpointed block's recompute in
        # backward calls the block's forward, not the module)
        groups = set(self.users)
        for name, mod in self.model.named_modules():
            owned = [self.params[id(p)] for p in mod.parameters(recurse=False) if id(p) in self.params]
            if owned and name not in groups:
                self._handles.append(mod.register_forward_pre_hook(lambda m, a, owned=owned: self._charged(self._touch, owned)))
        for mp in self.params.values():
            if not mp.p.requires_grad:  # frozen: no gradient to hook (let go by at_unpack)
                continue
            if mp.placement in HOST_PLACEMENTS or mp.placement in _RELEASED:
                self._handles.append(mp.p.register_post_accumulate_grad_hook(lambda p, mp=mp: self._charged(self._grad_ready, mp)))
            if mp.placement in HOST_PLACEMENTS:  # runs before autograd accumulates into p.grad
                self._handles.append(mp.p.register_hook(lambda g, mp=mp: self._charged(self._take_grad, mp)))
        self._handles.append(self.optimizer.register_step_pre_hook(self._step_pre_hook))
        self._handles.append(self.optimizer.register_step_post_hook(lambda opt, a, k: self._after_optimizer_step()))

    def _charged(self, hook: Callable[..., Any], *args: Any) -> Any:
        """``hook(*args)``; in a profiling step (``timer`` set) its time is charged to the step's
        instruments, for its gaps to leave out (mode_time.py): its fetches there are synchronous,
        unlike an executing step's, and the modes' own time inside it is charged already. Inside a
        checkpointed block's recompute the hook runs outside the dispatch modes: selective
        checkpointing's mode refuses any op its forward did not run, and the mover's own ops (a
        fetch's buffer) are not the model's (R9 with R13)."""
        if torch._C._len_torch_dispatch_stack() and any(
                type(m).__module__ == "torch.utils.checkpoint" for m in _get_current_dispatch_mode_stack()):
            with _disable_current_modes():
                return self._charged_in(hook, *args)
        return self._charged_in(hook, *args)

    def _charged_in(self, hook: Callable[..., Any], *args: Any) -> Any:
        timer = self.timer
        if timer is None:
            return self._timed(hook, *args)
        t0, modes = time.perf_counter(), timer.total_s()
        try:
            return self._timed(hook, *args)
        finally:
            timer.own_s += time.perf_counter() - t0 - (timer.total_s() - modes)

    def _timed(self, hook: Callable[..., Any], *args: Any) -> Any:
        """``hook(*args)``, its time added to ``spent_s`` and its waits to ``waited_s``."""
        backend = self.backend
        t0, waited = time.perf_counter(), backend.waited_s
        try:
            return hook(*args)
        finally:
            self.spent_s += time.perf_counter() - t0
            self.waited_s += backend.waited_s - waited

    # ------------------------------------------------------------------ the step
    def begin_step(self) -> None:
        """As a step under the runtime starts: the first group's forward fetch is issued."""
        self.in_step = True
        self._waiting.clear()
        self._backward = False
        self._next_backward = self._next_frozen = 0
        self._reduced = False
        self.peak_transient = self.transient
        self.copied = 0
        if self.disk is not None:
            self.disk.ahead()  # R19: the optimizer step's first reads overlap the step
        self._issue_next(self.forward_order, None)

    def _issue_next(self, order: list[str], after: str | None) -> None:
        """R14: the group after ``after`` in ``order`` whose parameters leave the device between
        uses: its fetch issued (those of its parameters not on the device already)."""
        start = 0 if after is None else order.index(after) + 1
        for g in order[start:]:
            moving = [mp for mp in self.users[g] if mp.placement in _RELEASED]
            if moving:
                for mp in moving:
                    self._prefetch(mp)
                return

    def _enter(self, g: str) -> None:
        """Forward pre-hook of group ``g``'s module: its parameters on the device."""
        if not self.in_step:
            self._enter_at_rest(g)
            return
        self._poll()
        for mp in self.users[g]:
            mp.uses += 1
            if mp.placement == "host-step":
                self._host_step_ready(mp)
            else:
                self._ready(mp)
        self._issue_next(self.forward_order, g)

    def _touch(self, owned: list[_Param]) -> None:
        """A module's own placed parameters on the device before it runs (within a step)."""
        if not self.in_step:
            return
        for mp in owned:
            if mp.placement == "host-step":
                if mp.p.data is not mp.dev:
                    self._host_step_ready(mp)
            elif not (mp.resident and mp.fetch is None and mp.p.data is mp.dev):
                self._ready(mp)

    def _host_step_ready(self, mp: _Param) -> None:
        """host-step: the device copy current (R16: its copy back waited for; a reloaded master
        copied again) and the parameter on it."""
        assert mp.dev is not None, "a host-step parameter keeps its device copy"
        if mp.back is not None:
            self.backend.wait_for_use(mp.back)
            mp.back = None
        if mp.dev_version != mp.p._version and mp.p.data is mp.host:  # changed in place on the host (a reload)
            t = self.backend.copy_in_into(present_host(mp), _alias(mp.dev))
            self.backend.wait_for_use(t)
            self.copied += mp.nbytes
        mp.dev_version = mp.p._version
        mp.p.data = mp.dev

    def _leave(self, g: str) -> None:
        """Forward hook of group ``g``'s module: what leaves the device between its uses goes."""
        if not self.in_step:
            self._leave_at_rest(g)
            return
        for mp in self.users[g]:
            mp.uses = max(0, mp.uses - 1)
            if mp.uses or mp.placement not in _RELEASED:
                continue
            if mp.placement == "param":  # the device copy is the master: copied out, let go once it lands
                if mp.host is None:
                    mp.host = self._host_buffer(mp.p)
                mp.out = self.backend.copy_out_into(_alias(present_dev(mp)), mp.host)
                self.copied += mp.nbytes
            self._release(mp)

    def at_unpack(self, event: int, t: torch.Tensor | None) -> None:
        """Autograd unpacks a saved tensor at trace event ``event`` (``t``: it, where the step kept
        it rather than swapped it). Backward reaches each group at its ``backward_at`` (R13): its
        parameters are waited for there and the next group's fetch is issued (R14); a kept tensor
        on a placed parameter's storage is fetched first whatever the events say (a step that left
        its trace). Timed (``spent_s``), not charged to a profiling step's timer: it runs inside the
        step's own hook, whose time the step leaves out already."""
        if self.in_step:
            self._timed(self._at_unpack, event, t)

    def _at_unpack(self, event: int, t: torch.Tensor | None) -> None:
        if self._grad_outs:
            # gradients whose copies landed let go of their device storage before the next gap,
            # as the simulator frees a copy out as it lands (R14), not at the next gradient's hook
            self._collect_grads(wait=False)
        if self._waiting:
            self._admit()
        if not self._backward:
            self._backward_starts()
            self._poll()
            self._issue_next(self.backward_order, None)  # the first as backward starts
        order = self.backward_order
        while self._next_backward < len(order) and self.backward_at[self._next_backward] <= event:
            g = order[self._next_backward]
            self._next_backward += 1
            for mp in self.users[g]:
                if mp.placement in _RELEASED:
                    self._ready(mp)
            self._issue_next(order, g)
        # at a trace tensor's unpack (``t`` None): a parameter's comes with the next event's index,
        # while the node that reads it may still be the last of the group's backward
        while t is None and self._next_frozen < len(self.frozen_done) and self.frozen_done[self._next_frozen][0] <= event:
            for mp in self.users[self.frozen_done[self._next_frozen][1]]:
                self._release(mp)  # a kept tensor on its storage fetches it again (below)
            self._next_frozen += 1
        if t is not None:
            kept = self._by_storage.get(t.untyped_storage()._cdata)
            if kept is not None and not (kept.resident and kept.fetch is None):
                self._ready(kept)

    def _backward_starts(self) -> None:
        """The first hook of a backward: when autograd's engine finishes it, every tensor comes to
        rest (``_to_rest``), so what runs between backward and ``optimizer.step()`` (clipping,
        inside Lightning's closure too) sees every gradient where the user reads it."""
        self._backward = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._charged(self._backward_ends))

    def _backward_ends(self) -> None:
        if self._rest_after_reducer_queued(self._backward_ends):
            return
        self._backward = False
        self._next_backward = 0
        self._to_rest()

    def _grad_ready(self, mp: _Param) -> None:
        """Post-accumulate hook: ``mp``'s gradient is complete for this backward."""
        if not self.in_step:
            return
        if not self._backward:
            self._backward_starts()
        if mp.placement in HOST_PLACEMENTS and self._reduced:
            self._hold(mp)  # DDP's reducer reads p.grad after this hook, and writes the mean there
        elif mp.placement in HOST_PLACEMENTS:
            g = mp.p.grad
            if g is not None and g is not mp.hgrad:  # (a second backward in one step adds to it in place)
                self._bytes(mp.nbytes)
                buf = self.backend.pool.take(mp.nbytes)
                self._grad_outs.append((mp, self.backend.copy_out_into(g.detach(), buf.view(g.dtype).view(g.shape)), buf))
                self.copied += mp.nbytes
                mp.p.grad = None  # the ticket holds the device gradient until its copy lands
        if mp.placement in ("full", "stream-full"):
            self._release(mp)
        self._collect_grads(wait=False)
        if self._waiting:
            self._admit()

    def end_step(self) -> None:
        """As the step ends (or fails): every tensor as at rest (module docstring)."""
        try:
            self._to_rest()
        finally:
            self.in_step = False
            self._by_storage = {k: v for k, v in self._by_storage.items() if v.dev is not None}

    def _to_rest(self) -> None:
        """Every tensor as at rest: at the step's end, or where the user's optimizer steps inside
        the step (Lightning's training batch), before it does. The gradients taken off ``p.grad``
        as the step began go back once (a ``zero_grad()`` after the step inside it stays)."""
        self._collect_grads(wait=True)
        self._reduced_out()
        for mp in self.params.values():
            if mp.fetch is not None:
                self.backend.wait_host(mp.fetch)
                mp.fetch = None
            if mp.out is not None:
                self.backend.wait_host(mp.out)
                mp.out = None
            mp.uses = 0
            if mp.placement == "param":
                mp.out_release = False
                self._ready(mp)  # R14: kept from its backward fetch to the next forward
            elif mp.placement in ("full", "stream-full"):
                self._release(mp)
                mp.dev = None  # a fresh storage next step; the host master is the parameter
            if mp.placement in HOST_PLACEMENTS:
                mp.p.data = present_host(mp)
                if mp.taken:
                    mp.p.grad = mp.hgrad
                    mp.taken = False
                if mp.placement == "host-step":
                    mp.dev_version = mp.p._version

    def settle(self) -> None:
        """Wait for every copy in flight (before reading what they write, and at the end)."""
        for mp in self.params.values():
            for t in (mp.fetch, mp.out, mp.back):
                if t is not None:
                    self.backend.wait_host(t)
            mp.fetch = mp.out = mp.back = None
        self._collect_grads(wait=True)

    # ------------------------------------------------------------------ what it measures
    def measured_device_bytes(self) -> int:
        """The audit's figure: state bytes the device holds now beyond the resident part, read off
        the storages themselves (a released parameter's storage has 0 bytes), not the counters."""
        total = 0
        host_keys = self._host_state
        for mp in self.params.values():
            if mp.placement in _RELEASED and mp.dev is not None:
                total += mp.dev.untyped_storage().nbytes()
            if mp.placement in HOST_PLACEMENTS:
                g = mp.p.grad
                if g is not None and g is not mp.hgrad:
                    total += g.untyped_storage().nbytes()
            if mp.placement in ("stream", "stream-full"):
                total += sum(v.untyped_storage().nbytes() for _, v in self._state_tensors(mp) if id(v) not in host_keys)
        # gradients whose copy out still holds their device storage
        return total + sum(t.src.untyped_storage().nbytes() for _, t, _ in self._grad_outs if t.src is not None)
