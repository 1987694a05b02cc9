"""The device storage of each parameter the state mover places (R14, R17): a fetch resizes it
back and copies the host's bytes into it, ahead of the parameter's use where the budget has room
(in issue order, R6), and letting go resizes it to 0 once no copy reads it; the bytes it holds
beyond the state's resident part are counted for the executing step.

:class:`DeviceStorages` is the layer of :class:`~swapsched.runtime.state_mover.StateMover` that
does this; the mover decides when (its hooks, ``state_mover.py``'s docstring).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from swapsched.runtime.state_grads import GradientsToHost
from swapsched.runtime.state_rest import _alias, _Param, present_dev, present_out
from swapsched.runtime.transients import runtime_allocation

__all__ = ["DeviceStorages"]


class DeviceStorages(GradientsToHost):
    """Fetching and letting go of placed parameters' device storages (module docstring)."""

    _waiting: list[_Param]  # fetches waiting for room, in issue order (R6)
    room: Callable[[], int] | None  # the room a fetch may take now (the executing step's)
    eager: bool  # fetch on demand in the calling thread (the profiling steps')
    on_bytes: Callable[[int], None] | None  # told each change of the bytes held beyond the resident part

    # ------------------------------------------------------------------ accounting
    def _bytes(self, delta: int) -> None:
        self.transient += delta
        if self.transient > self.peak_transient:
            self.peak_transient = self.transient
        if self.on_bytes is not None and delta:
            self.on_bytes(delta)

    # ------------------------------------------------------------------ device storage of a parameter
    def _device_copy(self, host: torch.Tensor | None) -> torch.Tensor:
        """An uninitialized device tensor shaped as ``host`` (the copy into it follows)."""
        assert host is not None, "a parameter fetched from the host has its host master"
        with runtime_allocation():  # the state's bytes: counted by its placement, not as the step's
            return torch.empty(host.shape, dtype=host.dtype, device=self.device)

    def _release(self, mp: _Param) -> None:
        """Let ``mp``'s device bytes go (a copy still reading them: once it lands)."""
        if not mp.resident or mp.dev is None:
            return
        if mp.out is not None and not self.backend.done(mp.out):
            mp.out_release = True
            return
        if mp.fetch is not None:  # a fetch nobody waited for: its bytes must land before they go
            self.backend.wait_host(mp.fetch)
            mp.fetch = None
        mp.dev.untyped_storage().resize_(0)
        mp.resident = False
        self._bytes(-mp.nbytes)

    def _prefetch(self, mp: _Param) -> None:
        """R14: ``mp``'s fetch ahead of its use, issued once the budget has room for it (R6: in
        issue order, behind any fetch already waiting)."""
        if self.eager or (mp.resident and mp.dev is not None) or mp in self._waiting:
            return
        if self._waiting or (self.room is not None and self.room() < mp.nbytes):
            self._waiting.append(mp)
            return
        self._fetch(mp)

    def _admit(self) -> None:
        """The fetches waiting for room that now have it, in issue order (R6)."""
        while self._waiting and (self.room is None or self.room() >= self._waiting[0].nbytes):
            self._fetch(self._waiting.pop(0))

    def _fetch(self, mp: _Param) -> None:
        """Issue ``mp``'s copy onto the device (into its own storage: saved views see it)."""
        if mp in self._waiting:  # needed now: ahead of the fetches waiting for room
            self._waiting.remove(mp)
        if mp.resident and mp.dev is not None:
            if mp.out is not None and mp.out_release:  # its copy out is still reading it: it stays
                mp.out_release = False
            return
        if mp.dev is None:
            mp.dev = self._device_copy(mp.host)
            if self.in_step:
                mp.p.data = mp.dev
            self._by_storage[mp.dev.untyped_storage()._cdata] = mp
        else:
            mp.dev.untyped_storage().resize_(mp.nbytes)
        mp.resident = True
        self._bytes(mp.nbytes)
        self.copied += mp.nbytes
        if self.eager:
            _alias(mp.dev).copy_(present_out(mp))
            return
        # the host master, or (param) the copy made after forward: the same buffer
        mp.fetch = self.backend.copy_in_into(present_out(mp), _alias(mp.dev))

    def _ready(self, mp: _Param) -> None:
        """``mp`` on the device, its bytes there, before the compute reads them."""
        self._fetch(mp)
        if mp.fetch is not None:
            self.backend.wait_for_use(mp.fetch)
            mp.fetch = None
        if self.in_step and mp.p.data is not mp.dev:
            mp.p.data = present_dev(mp)

    def _poll(self) -> None:
        """Retire the copies out that landed (their storages go, their host buffers are complete)
        and admit the fetches that now have room."""
        self._admit()
        for mp in self.params.values():
            if mp.out is not None and self.backend.done(mp.out):
                self.backend.wait_host(mp.out)  # raises a failed copy's error
                mp.out = None
                if mp.out_release:
                    mp.out_release = False
                    self._release(mp)
