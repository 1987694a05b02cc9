"""The host buffers the runtime copies into (:class:`HostPool`): reused by exact size, pinned on
CUDA, and held within the runtime's host budget (R11). Each backend (``backends.py``) owns one;
who returns a buffer, and when, is that module's docstring.
"""

from __future__ import annotations

import threading

import torch

from swapsched.runtime.transients import runtime_allocation

__all__ = ["HostPool"]


class HostPool:
    """Reusable host buffers by exact size, so steady-state steps allocate nothing.

    Steps repeat the same tensor sizes, so exact-size reuse hits every time after the first step.
    With ``pin=True`` (CUDA) the buffers are page-locked; ``cudaHostAlloc`` synchronizes the device,
    which is why it must happen only while the pool warms up."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}
        self.allocated_bytes = 0
        self.lock = threading.Lock()
        # R11: the most bytes the pool may hold (the runtime's host budget; None: unlimited). Cached
        # buffers of other sizes are released to make room; what is in use, the step keeps within it
        self.limit: int | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            bufs = self.free.get(nbytes)
            if bufs:
                return bufs.pop()
            need = self.held_bytes(nbytes)
            if self.limit is not None:
                for size in sorted(self.free, reverse=True):
                    while self.free[size] and self.allocated_bytes + need > self.limit:
                        self.allocated_bytes -= self.held_bytes(self.free[size].pop().numel())
            self.allocated_bytes += need
        with runtime_allocation():
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def held_bytes(self, nbytes: int) -> int:
        """What a buffer of ``nbytes`` really holds: PyTorch's pinned (CachingHostAllocator) blocks
        are rounded up to a power of two; pageable ones are the size asked for."""
        return 1 << max(int(nbytes) - 1, 0).bit_length() if self.pin and nbytes > 0 else int(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.free.setdefault(buf.numel(), []).append(buf)

    def discard(self, buf: torch.Tensor) -> None:
        """Never reuse ``buf`` (a copy that did not complete may still write it)."""
        with self.lock:
            self.allocated_bytes -= self.held_bytes(buf.numel())

    @property
    def idle_bytes(self) -> int:
        with self.lock:
            return sum(self.held_bytes(b.numel()) for bs in self.free.values() for b in bs)
