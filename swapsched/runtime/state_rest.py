"""The training state between steps (R17): where each placed tensor rests, the user's optimizer
step of the placed groups, a forward outside a step (evaluation), and everything back on the
device when the mover goes.

At rest ``host-step``, ``full`` and ``stream-full`` parameters have ``p.data`` and ``p.grad``
equal to their host tensors (what the user reads and changes between steps); ``device``, ``param``
and ``stream`` parameters rest on the device. A forward outside ``runtime.step()`` (evaluation,
under ``no_grad`` or ``inference_mode``) fetches a group's parameters for it, synchronously, and
puts them back to rest after.

**The optimizer's step** runs each group where its placement steps it, around the user's own
``optimizer.step()``, and back where it rests after.

``host-step`` and ``full`` step on the host as they rest (``p.data``, ``p.grad`` and the state are
the host tensors: the user's optimizer runs its CPU kernel on them); ``stream`` has its state, and
``stream-full`` its parameter, gradient and state, streamed in for a step on the device and
streamed out after; ``host-step``'s updated master is copied back to its device copy, which the
next forward waits for (R16). A step given a closure (Lightning's) runs forward and backward
inside it: the groups are placed after the closure returns.

:class:`StateAtRest` is the half of :class:`~swapsched.runtime.state_mover.StateMover` that acts
between steps (the other half acts within them) and reports what was off the device; the
records of each placed parameter (:class:`_Param`) live here too.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from swapsched.env.state_parts import resident_parts
from swapsched.errors import UserError
from swapsched.runtime.backends import Backend, Ticket
from swapsched.runtime.reports import StateStepReport
from swapsched.runtime.shards import like, local_of
from swapsched.runtime.state_disk import StateOnDisk
from swapsched.state import StateGroup

__all__ = ["StateAtRest", "Handover", "to_device", "HOST_PLACEMENTS"]

#: Placements whose master parameter, gradient and optimizer state live on the host at rest
HOST_PLACEMENTS = frozenset({"host-step", "full", "stream-full"})
#: ... whose parameter leaves the device between its uses within a step
_RELEASED = frozenset({"param", "full", "stream-full"})
#: ... that step on the host (the rest on the device)
_HOST_STEPPED = frozenset({"host-step", "full"})

def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements through a tensor of its own (copies into it leave ``t``'s version)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


@dataclass(eq=False)
class _Param:
    """One parameter the mover places, with what it holds for it."""

    p: nn.Parameter
    name: str
    group: str
    placement: str
    nbytes: int
    host: torch.Tensor | None = None  # the host master (placements that keep one)
    dev: torch.Tensor | None = None  # the device tensor p.data is while on the device
    resident: bool = True  # dev's storage holds the bytes
    fetch: Ticket | None = None  # a copy into dev in flight
    out: Ticket | None = None  # a copy out of dev in flight (``param``: its storage goes when it lands)
    out_release: bool = False  # let dev go once ``out`` lands
    back: Ticket | None = None  # host-step: the host master's copy back into dev (R16)
    dev_version: int = -1  # the host master's version dev was copied from (a reload changes it)
    hgrad: torch.Tensor | None = None  # the gradient kept on the host
    uses: int = 0  # forward scopes of groups using it now (a tied weight: more than one)
    taken: bool = False  # the host gradient is off p.grad for this step's backward (_take_grad)
    step_grad: torch.Tensor | None = None  # stream-full: the host gradient while the device steps it



@dataclass(frozen=True)
class Handover:
    """What a mover leaves the next (a change of plan): the parameters resting on the host (by
    ``id``: their host master, which ``p.data`` is, and ``p.grad`` their host gradient) and the ids
    of the optimizer-state tensors that are host buffers. No step of the change holds the whole
    state on the device."""

    host: dict[int, torch.Tensor]
    host_state: frozenset[int]


def to_device(optimizer: torch.optim.Optimizer, device: torch.device, handover: Handover, keep: set[int]) -> None:
    """Every parameter ``handover`` left on the host that ``keep`` (the next mover's parameters)
    does not hold, with its gradient and optimizer state, back on ``device``."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in keep:
                    continue
                on_host = id(p) in handover.host
                if on_host:
                    grad, p.grad = p.grad, None
                    p.data = p.data.to(device, copy=True)
                    if grad is not None:
                        p.grad = grad.to(device, copy=True)
                st = optimizer.state.get(p, {})
                for k, v in list(st.items()):  # a host-placed group's state, or a streamed group's
                    if torch.is_tensor(v) and v.dim() > 0 and (on_host or id(local_of(v)) in handover.host_state):
                        st[k] = like(v, local_of(v).to(device, copy=True))


class StateAtRest:
    """The state between steps (module docstring); :class:`StateMover` supplies the parameters,
    the accounting and the step's own transitions it uses."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    backend: Backend
    device: torch.device
    placement: dict[str, str]
    peak_transient: int
    params: dict[int, _Param]
    users: dict[str, list[_Param]]
    transient: int
    _handles: list[Any]
    _by_storage: dict[int, _Param]
    in_step: bool
    copied: int
    optimizer_step_s: float | None
    _t_step: float
    _host_state: set[int]
    _streamed: dict[int, torch.Tensor]
    disk: StateOnDisk | None  # R19: the groups whose optimizer state rests on the disk
    _disk_stepping: bool  # stepping them one at a time (state_disk.py): our hooks stand aside

    def _bytes(self, delta: int) -> None:
        raise NotImplementedError

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _device_copy(self, host: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def _release(self, mp: _Param) -> None:
        raise NotImplementedError

    def _fetch(self, mp: _Param) -> None:
        raise NotImplementedError

    def _ready(self, mp: _Param) -> None:
        raise NotImplementedError

    def _host_step_ready(self, mp: _Param) -> None:
        raise NotImplementedError

    def _to_rest(self) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ what it reports
    def report(self, groups: Sequence[StateGroup]) -> StateStepReport:
        by_name = {g.name: g for g in groups}
        off = [0, 0, 0]
        for name, where in self.placement.items():
            g = by_name.get(name)
            if g is None:
                continue
            resident = resident_parts(where)  # the simulator's table (R14): one home for it
            for i, part in enumerate(("param_bytes", "grad_bytes", "optim_bytes")):
                if part not in resident:
                    off[i] += getattr(g, part)
        return StateStepReport(
            placements=tuple(sorted(self.placement.items())), param_bytes_off=off[0], grad_bytes_off=off[1],
            optimizer_bytes_off=off[2], host_stepped=tuple(sorted(g for g, w in self.placement.items() if w in _HOST_STEPPED)),
            optimizer_step_s=self.optimizer_step_s, copied_bytes=self.copied, peak_transient_bytes=self.peak_transient,
            **({} if self.disk is None else self.disk.report()))

    # ------------------------------------------------------------------ at rest
    def _check_host_step(self) -> None:
        """Every optimizer group with a parameter stepped on the host can step there: its class and
        hyperparameters are tried on a one-element host tensor (a fused kernel the host lacks fails)."""
        host_ids = {id(mp.p) for mp in self.params.values() if mp.placement in _HOST_STEPPED}
        for grp in self.optimizer.param_groups:
            if not any(id(p) in host_ids for p in grp["params"]):
                continue
            probe = torch.zeros(1, requires_grad=True)
            hyper = {k: v for k, v in grp.items() if k != "params"}
            accepted = inspect.signature(type(self.optimizer).__init__).parameters
            try:
                opt = type(self.optimizer)([probe], **{k: v for k, v in hyper.items() if k in accepted})
                opt.param_groups[0].update(hyper)  # what the class sets itself (AdamW's decoupled_weight_decay)
                probe.grad = torch.ones(1)
                opt.step()
            except Exception as exc:  # the class cannot step on the host: said, nothing moved yet
                raise UserError(f"{type(self.optimizer).__name__} with {hyper} cannot step on the host ({exc}); "
                                "use a class or setting with a CPU kernel (for example fused=False), or a budget "
                                "whose plan steps on the device") from exc

    def _to_rest_at_install(self, handover: Handover | None) -> None:
        """Each placed parameter as it is at rest (module docstring), its optimizer state where its
        placement keeps it: from the device (a runtime made mid-run finds the state there), or
        from where the last mover left it (``handover``: what rests on the host stays there)."""
        if handover is not None:
            self._host_state |= handover.host_state
        with torch.no_grad():
            for mp in self.params.values():
                p = mp.p
                on_host = handover.host.get(id(p)) if handover is not None else None
                if on_host is not None and mp.placement not in HOST_PLACEMENTS:  # back to the device it rests on
                    grad, p.grad = p.grad, None
                    p.data = on_host.to(self.device, copy=True)
                    p.grad = None if grad is None else grad.to(self.device, copy=True)
                    on_host = None
                mp.dev = p.data
                if mp.placement in HOST_PLACEMENTS:
                    if on_host is not None:  # the last mover's host master and gradient: kept as they are
                        mp.host, mp.hgrad = on_host, p.grad
                        if mp.placement == "host-step":
                            mp.dev = on_host.to(self.device, copy=True)
                    else:
                        mp.host = self._host_buffer(p)
                        mp.host.copy_(p.data)
                        if p.grad is not None:
                            mp.hgrad = self._host_buffer(p.grad)
                            mp.hgrad.copy_(p.grad)
                    p.data = mp.host
                    p.grad = mp.hgrad
                    mp.dev_version = p._version
                    if mp.placement != "host-step":  # host-step keeps its device copy all step
                        mp.dev = None
                        mp.resident = False
                elif mp.placement == "param":  # on the device at rest, beyond the resident part (R14)
                    self._by_storage[p.untyped_storage()._cdata] = mp
                    self.transient += mp.nbytes
                if mp.placement in ("stream", *HOST_PLACEMENTS):
                    self._state_to_host(mp)
                else:  # param: its state on the device
                    st = self.optimizer.state.get(p, {})
                    for k, v in list(self._state_tensors(mp)):
                        if id(v) in self._host_state:
                            st[k] = like(st[k], v.to(self.device, copy=True))

    def hand_over(self) -> Handover:
        """Take the hooks off and leave every tensor where it rests, for the next placement's mover
        (``to_device`` brings back what no placement keeps on the host)."""
        self.settle()
        if self.disk is not None:  # R19: what rests on the disk back in host memory first
            self.disk.remove()
            self.disk = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mp in self.params.values():
            if mp.placement == "param":
                self._ready(mp)  # R14: it rests on the device
        out = Handover({id(mp.p): present_host(mp) for mp in self.params.values() if mp.placement in HOST_PLACEMENTS},
                       frozenset(self._host_state))
        self.params.clear()
        self._by_storage.clear()
        return out

    def remove(self) -> None:
        """Take the hooks off and put every parameter, gradient and state back on the device."""
        to_device(self.optimizer, self.device, self.hand_over(), keep=set())

    def host_bytes(self) -> int:
        """The bytes of the parameters, gradients and optimizer state resting on the host now."""
        total = 0
        for mp in self.params.values():
            if mp.placement in HOST_PLACEMENTS:
                total += mp.nbytes + (mp.nbytes if mp.p.grad is not None else 0)
            total += sum(v.numel() * v.element_size() for _, v in self._state_tensors(mp) if id(v) in self._host_state)
        return total

    def staging_bytes(self) -> int:
        """R19: the host's staging buffers for the disk now."""
        return 0 if self.disk is None else self.disk.store.staging_bytes

    def _enter_at_rest(self, g: str) -> None:
        """A forward outside ``runtime.step()`` (evaluation): the group's parameters on the device
        for it, synchronously, and back to rest after (``_leave_at_rest``). Under
        ``inference_mode`` (Lightning's validation) too: what it makes must outlive it."""
        with torch.no_grad(), torch.inference_mode(False):
            for mp in self.users[g]:
                if mp.placement == "host-step":
                    self.in_step = True  # the device copy is kept; put the parameter on it as a step would
                    try:
                        self._host_step_ready(mp)
                    finally:
                        self.in_step = False
                elif mp.placement in HOST_PLACEMENTS:  # param: on the device at rest already
                    self._fetch(mp)
                    if mp.fetch is not None:
                        self.backend.wait_host(mp.fetch)
                        mp.fetch = None
                    mp.p.data = present_dev(mp)

    def _leave_at_rest(self, g: str) -> None:
        for mp in self.users[g]:  # (resizing a storage is no in-place update: allowed under inference_mode)
            if mp.placement in HOST_PLACEMENTS:
                if mp.placement != "host-step":
                    self._release(mp)
                    mp.dev = None
                mp.p.data = present_host(mp)

    # ------------------------------------------------------------------ the optimizer's step

    def _step_pre_hook(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Before the user's ``optimizer.step()``: each group where it steps. A step given a
        closure (Lightning's) runs forward and backward inside it: the groups are placed after it."""
        if self._disk_stepping:
            return None
        # args as torch's step wrapper passes them: the optimizer itself first, then step's own
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._before_optimizer_step()
            return None

        def closure_then_place() -> Any:
            loss = closure()
            self._before_optimizer_step()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_place}
        return (args[0], closure_then_place, *args[2:]), kwargs

    def _before_optimizer_step(self) -> None:
        """Each group where its placement steps it: ``stream`` and ``stream-full`` on the device,
        their state (and, for ``stream-full``, parameter and gradient) streamed in; ``host-step``
        and ``full`` on the host, as they are at rest; ``param`` on the device, as at rest."""
        self._t_step = time.perf_counter()
        if self.in_step:  # stepped inside runtime.step() (Lightning): backward's work first comes to rest
            self._to_rest()
        self.settle()
        if self.disk is not None:
            self.disk.begin()
            self.disk.step_on_host()  # R19: host-stepped groups on the disk, one at a time
        tickets: list[Ticket] = []
        with torch.no_grad():
            for mp in self.params.values():
                if self.disk is not None and mp.placement in ("stream", "stream-full"):
                    self.disk.before_stream_in(mp.group)
                if mp.placement == "stream":
                    tickets += self._state_in(mp)
                elif mp.placement == "stream-full":
                    mp.dev = self._device_copy(mp.host)
                    tickets.append(self.backend.copy_in_into(present_host(mp), _alias(mp.dev)))
                    mp.resident = True
                    self._bytes(mp.nbytes)
                    dgrad, mp.step_grad = None, mp.p.grad  # at rest: the host gradient (None after zero_grad)
                    if mp.step_grad is not None:
                        dgrad = self._device_copy(mp.step_grad)
                        tickets.append(self.backend.copy_in_into(mp.step_grad, dgrad))
                        self._bytes(mp.nbytes)
                    self.copied += mp.nbytes * (2 if dgrad is not None else 1)
                    tickets += self._state_in(mp)
                    mp.p.data = mp.dev
                    mp.p.grad = dgrad
        on_disk = self.disk is not None and self.disk.streaming
        for t in tickets:
            (self.backend.wait_host if on_disk else self.backend.wait_for_use)(t)
        if on_disk and self.disk is not None:
            self.disk.streamed_in()  # their host copies go: the files are current

    def _after_optimizer_step(self) -> None:
        """The stepped tensors back where they rest: streamed state out, ``stream-full``'s
        parameter out to its master, ``host-step``'s master copied back to its device copy (R16:
        the next forward waits for it)."""
        if self._disk_stepping:
            return
        tickets: list[tuple[str, Ticket]] = []  # (group, copy): a group's copies one after another
        with torch.no_grad():
            for mp in self.params.values():
                if mp.placement in ("stream", "stream-full"):
                    if self.disk is not None:
                        self.disk.before_stream_out(mp.group)
                    tickets += [(mp.group, t) for t in self._state_out(mp)]
                if mp.placement == "stream-full":
                    tickets.append((mp.group, self.backend.copy_out_into(_alias(present_dev(mp)), present_host(mp))))
                    self.copied += mp.nbytes
                elif mp.placement == "host-step":
                    mp.back = self.backend.copy_in_into(present_host(mp), _alias(present_dev(mp)))
                    self.copied += mp.nbytes
            for k, (g, t) in enumerate(tickets):
                self.backend.wait_host(t)
                if self.disk is not None and (k + 1 == len(tickets) or tickets[k + 1][0] != g):
                    self.disk.streamed_out(g)  # R19: its last copy out landed: written as the others land
            for mp in self.params.values():
                if mp.placement == "stream-full":
                    if mp.p.grad is not None:
                        self._bytes(-mp.nbytes)
                    self._release(mp)
                    mp.dev = None
                    mp.p.grad = None
                    mp.p.data = present_host(mp)
                    mp.p.grad, mp.step_grad = mp.step_grad, None
                elif mp.placement == "host-step":
                    mp.dev_version = mp.p._version
        if self.disk is not None:
            self.disk.after_step()
        self.optimizer_step_s = time.perf_counter() - self._t_step

    def _state_tensors(self, mp: _Param) -> Iterable[tuple[str, torch.Tensor]]:
        """The optimizer's per-element state of ``mp`` (a scalar step count stays where it is),
        each as the tensor holding its bytes (a shard's local tensor, R18: ``like`` puts one back)."""
        for k, v in self.optimizer.state.get(mp.p, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                yield k, local_of(v)

    def _state_to_host(self, mp: _Param) -> None:
        """``mp``'s optimizer state into host buffers, synchronously (at install)."""
        st = self.optimizer.state.get(mp.p)
        for k, v in list(self._state_tensors(mp)):
            if id(v) not in self._host_state:
                h = self._host_buffer(v)
                h.copy_(v)
                st[k] = like(st[k], h)  # type: ignore[index]
                self._host_state.add(id(h))

    def _state_in(self, mp: _Param) -> list[Ticket]:
        """``mp``'s state from its host tensors into device copies (issued; the step waits; R19:
        a group read from the disk is let go once its copies have landed)."""
        st = self.optimizer.state[mp.p]
        out = []
        for k, v in list(self._state_tensors(mp)):
            if id(v) not in self._host_state:  # created on the device (the first step), or reloaded there
                continue
            d = self._device_copy(v)
            out.append(self.backend.copy_in_into(v, d))
            nbytes = v.numel() * v.element_size()
            self._bytes(nbytes)
            self.copied += nbytes
            st[k] = like(st[k], d)
            self._streamed[id(d)] = v
        if self.disk is not None:
            self.disk.landing(mp.group, out)
        return out

    def _state_out(self, mp: _Param) -> list[Ticket]:
        """``mp``'s state back into its host tensors (new host tensors where it was made on the device)."""
        st = self.optimizer.state[mp.p]
        out = []
        for k, v in list(self._state_tensors(mp)):
            if id(v) in self._host_state:
                continue
            h = self._streamed.pop(id(v), None)
            was_streamed = h is not None
            if h is None:  # made on the device by the first step, or reloaded there
                h = self._host_buffer(v)
                self._host_state.add(id(h))
            out.append(self.backend.copy_out_into(v, h))
            nbytes = v.numel() * v.element_size()
            self.copied += nbytes
            if was_streamed:
                self._bytes(-nbytes)
            st[k] = like(st[k], h)  # v stays alive in the ticket until the copy lands
        return out

def present_host(mp: _Param) -> torch.Tensor:
    assert mp.host is not None, f"parameter {mp.name} ({mp.placement}) has its host master"
    return mp.host


def present_dev(mp: _Param) -> torch.Tensor:
    assert mp.dev is not None, f"parameter {mp.name} ({mp.placement}) has its device tensor"
    return mp.dev


def present_out(mp: _Param) -> torch.Tensor:
    """Where a fetch copies from: the host master, or a ``param`` placement's copy made after forward."""
    assert mp.host is not None, f"parameter {mp.name} has a host copy before it is fetched"
    return mp.host
