"""Host-placed gradients within a step (R17): taken off ``p.grad`` before autograd first
accumulates into it, copied out as they complete and added to the gradient kept on the host,
and, under a DDP that reduces the step's gradients (R17 "Under DDP", ``replicas.py``), held on the
device through backward (the sum accumulated on the host under ``no_sync()`` put back on it
first) until DDP's finalize has written the mean into it, which then goes to the host.
:class:`GradientsToHost` is :class:`~swapsched.runtime.state_mover.StateMover`'s base for them;
the mover calls these from its hooks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from swapsched.errors import UserError
from swapsched.runtime.backends import Ticket
from swapsched.runtime.replicas import reducing_replica
from swapsched.runtime.state_rest import HOST_PLACEMENTS, StateAtRest, _Param
from swapsched.runtime.transients import runtime_allocation

__all__ = ["GradientsToHost"]


class GradientsToHost(StateAtRest):
    """Host-placed gradients within a step (module docstring)."""

    # gradients on their way to the host, in issue order: (parameter, copy, host buffer)
    _grad_outs: deque[tuple[_Param, Ticket, torch.Tensor]]
    # this step's forward ran inside a DDP that reduces its gradients; the rest after DDP's
    # finalize is queued; the parameters whose gradients are held on the device for it
    _reduced: bool
    _rest_after_reducer: bool
    _held: dict[int, _Param]

    def _take_grad(self, mp: _Param) -> None:
        """Before autograd accumulates ``mp``'s first gradient of the step (a hook on the
        parameter, after any ``zero_grad()`` the user calls, Lightning's between forward and
        backward too): the gradient kept on the host leaves ``p.grad``, and backward's is added to
        it there (``_collect_grads``)."""
        if not self.in_step or mp.taken or mp.placement not in HOST_PLACEMENTS:
            return
        g = mp.p.grad
        if g is not mp.hgrad:  # zero_grad() let it go, or the user set one of their own
            if mp.hgrad is not None and mp.hgrad._base is not None:
                self.backend.pool.discard(mp.hgrad._base)  # the user's to keep or drop: never reused
            mp.hgrad = None
            if g is not None:
                mp.hgrad = self._host_buffer(g)
                mp.hgrad.copy_(g)
        mp.p.grad = None
        mp.taken = True
        if self._reduced:
            self._sum_for_reducer(mp)

    def land_gradient(self) -> bool:
        """R4 with R14: the oldest gradient on its way to the host waited for, and its device
        storage let go, where the executing step needs the room (the simulator frees it as its
        copy lands); False where none is on its way."""
        if not self._grad_outs:
            return False
        self.backend.wait_host(self._grad_outs[0][1])
        self._collect_grads(wait=False)
        return True

    def _collect_grads(self, wait: bool) -> None:
        """The gradients whose copies landed (all of them, with ``wait``) added to the host's, in
        the order they were copied out (one engine runs them in that order, R6)."""
        outs = self._grad_outs
        while outs and (wait or self.backend.done(outs[0][1])):
            mp, ticket, buf = outs.popleft()
            self.backend.wait_host(ticket)
            g = buf.view(mp.p.dtype).view(mp.p.shape)
            if mp.hgrad is None:
                mp.hgrad = g  # the buffer becomes the host gradient
            else:
                mp.hgrad.add_(g)  # as AccumulateGrad adds: the earlier sum plus this one
                self.backend.pool.give(buf)
            self._bytes(-mp.nbytes)

    def _rest_after_reducer_queued(self, rest: Callable[[], None]) -> bool:
        """At backward's end, under a reducing DDP: ``rest`` queued again, once, so that it runs
        after DDP's finalize_backward (queued at DDP's last bucket, after this callback; one queued
        from a callback runs after every one queued before it). True where it was."""
        if self._reduced and not self._rest_after_reducer:
            self._rest_after_reducer = True
            torch.autograd.Variable._execution_engine.queue_callback(rest)
            return True
        self._rest_after_reducer = False
        return False

    def _forward_starts(self) -> None:
        """The model's forward pre-hook: whether DDP all-reduces this forward's gradients."""
        if not self.in_step:
            return
        ddp = reducing_replica(self.model)
        if ddp is None:
            return
        if ddp.gradient_as_bucket_view and any(mp.placement in HOST_PLACEMENTS for mp in self.params.values()):
            # each p.grad is a view of DDP's buckets, which stay on the device: moving it frees nothing
            raise UserError("DistributedDataParallel(gradient_as_bucket_view=True) keeps every gradient in its "
                            "buckets on the device, so gradients cannot leave it: wrap the model with "
                            "gradient_as_bucket_view=False, or give a budget the state meets on the device")
        self._reduced = True

    def _hold(self, mp: _Param) -> None:
        """``mp``'s gradient stays on the device until backward ends (DDP reduces it there)."""
        if id(mp.p) not in self._held:
            self._held[id(mp.p)] = mp
            self._bytes(mp.nbytes)

    def _sum_for_reducer(self, mp: _Param) -> None:
        """Before autograd's first accumulation into ``mp``'s gradient in a reduced backward:
        DDP reduces ``p.grad`` as this backward leaves it, so the sum of the steps accumulated on
        the host under ``no_sync()`` goes back on it, for autograd to add this backward's to (as
        DDP alone: ``g1 + g2``, then the mean of that over the ranks)."""
        self._hold(mp)
        if mp.hgrad is not None:
            with runtime_allocation():  # counted by _hold as the state's bytes
                dev = torch.empty(mp.hgrad.shape, dtype=mp.hgrad.dtype, device=self.device)
            self.backend.wait_for_use(self.backend.copy_in_into(mp.hgrad, dev))
            self.copied += mp.nbytes
            mp.p.grad = dev

    def _reduced_out(self) -> None:
        """The gradients held for DDP (after its finalize: the mean over the ranks) to the host,
        as the gradient kept there (it held the sum so far, which the mean includes)."""
        held, self._held = self._held, {}
        for mp in held.values():
            g = mp.p.grad
            if g is not None and g is not mp.hgrad:
                if mp.hgrad is None:
                    mp.hgrad = self._host_buffer(g)
                self.backend.wait_host(self.backend.copy_out_into(g.detach(), mp.hgrad))
                self.copied += mp.nbytes
                mp.p.grad = None  # the device gradient goes; p.grad is the host's as it comes to rest
            self._bytes(-mp.nbytes)
