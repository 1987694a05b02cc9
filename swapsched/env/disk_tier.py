"""R19, the disk tier inside the simulated step: which groups rest what on the disk, the host's
staging buffers, and the disk's reads and writes, as :class:`~swapsched.env.state_exec.StateExecution`
asks for them.

- A group placed on the disk (``SwapPlan.disk``) rests there the parts ``state_parts.disk_parts``
  names, as far as the disk budget holds them (``state_parts.held``: one it cannot hold rests
  them on the host, counted in ``skipped``).
- Every read and write passes through one of ``STAGING_SLOTS`` host staging buffers in flight,
  each its group's size: the host budget counts the ``STAGING_SLOTS`` largest groups' bytes on
  the disk (R11, ``state_parts.staging_bytes``). A read takes a slot
  once one is free and the group's copy on the disk is current (its last write landed: what the
  previous step left under way is carried); the slot is held until the bytes have gone on (to
  the device, or through the host's step and back to the disk).
- Reads are issued as early as a slot allows: the runtime reads ahead of the step that needs
  them in the same order (``runtime/disk_store.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from swapsched.env.copy_engines import DiskEngines
from swapsched.env.state_parts import STAGING_SLOTS, Held, part_bytes
from swapsched.hardware import Hardware

__all__ = ["DiskTier"]


def _key(j: int) -> int:
    """The carry's key for group ``j``'s copy on the disk (the parameters' own keys are ``j``)."""
    return -(j + 1)


class DiskTier:
    """The disk tier of one simulated step (module docstring)."""

    def __init__(self, groups: Sequence[Any], held: Held, hardware: Hardware, carry: dict[int, float]):
        self.parts: list[tuple[str, ...]] = list(held.parts)  # as the budgets hold them (state_parts.held)
        self.skipped = held.disk_skipped
        self.disk_bytes = sum(part_bytes(g, p) for g, p in zip(groups, self.parts, strict=True))
        self.groups = groups
        self.staging_bytes = held.staging
        self.engines: DiskEngines | None = None
        self.ready = {j: carry.get(_key(j), 0.0) for j in range(len(groups))}
        if self.staging_bytes:
            self.engines = DiskEngines(hardware, write_free=max(self.ready.values(), default=0.0))
        self.slots = [0.0] * min(STAGING_SLOTS, sum(1 for p in self.parts if p))  # when each buffer is next free
        self.next_ready: dict[int, float] = {}
        self.read_bytes = self.written_bytes = 0
        self.reads: list[tuple[float, float, int]] = []
        self.writes: list[tuple[float, float, int]] = []

    def nbytes(self, j: int, parts: Sequence[str] | None = None) -> int:
        """What of group ``j`` (of ``parts``, else all it rests there) is on the disk."""
        on = self.parts[j] if parts is None else tuple(p for p in parts if p in self.parts[j])
        return part_bytes(self.groups[j], on)

    def read(self, j: int, nbytes: int, at: float = 0.0) -> float:
        """Read ``nbytes`` of group ``j`` into a staging slot, ready no earlier than ``at`` (and
        as a slot and its current copy allow); its end. The caller gives the slot back (``release``)."""
        assert self.engines is not None
        slot = heapq.heappop(self.slots)
        start, end = self.engines.span(False, max(at, slot, self.ready[j]), nbytes)
        self.read_bytes += nbytes
        self.reads.append((start, end, j))
        return end

    def release(self, t: float) -> None:
        """A staging slot is free again at ``t``."""
        heapq.heappush(self.slots, t)

    def write(self, j: int, nbytes: int, at: float, *, held: bool = False) -> float:
        """Write ``nbytes`` of group ``j`` from staging once they are there (``at``); the slot
        (``held``: the one its read took, else the next free) is free when the write lands,
        and the group's copy on the disk is current then (carried into the next step)."""
        assert self.engines is not None
        if not held:
            at = max(at, heapq.heappop(self.slots))
        start, end = self.engines.span(True, at, nbytes)
        self.release(end)
        self.written_bytes += nbytes
        self.writes.append((start, end, j))
        self.next_ready[_key(j)] = end
        return end
