"""The simulated step's two copy engines (R6), as ``simulator.py`` and ``state_exec.py`` use them,
and the disk's two (R19).

Each direction has one engine whose copies run FIFO, each after the one queued before it; a copy
costs the link's latency plus its bytes over the rank's share of the host's bandwidth (R11), and
one that finds its engine idle pays ``copy_wake_s`` more. Where the executor has one transfer
stream (R10: ``copy_streams == 1``) both directions queue on it.
"""

from __future__ import annotations

from swapsched.hardware import Hardware

__all__ = ["CopyEngines", "DiskEngines"]


class CopyEngines:
    """When each engine is next free, and the span of each copy issued on it (module docstring)."""

    def __init__(self, hardware: Hardware):
        self.d2h_free = 0.0
        self.h2d_free = 0.0
        self.lat, self.wake = hardware.copy_latency_s, hardware.copy_wake_s
        self.inv_d2h = 1.0 / hardware.link_bytes_per_s("d2h")  # R11: a rank's share of the host's bandwidth
        self.inv_h2d = 1.0 / hardware.link_bytes_per_s("h2d")
        self.one_stream = hardware.copy_streams == 1  # R10: both directions queue on one transfer stream

    def span(self, d2h: bool, at: float, nbytes: int) -> tuple[float, float]:
        """R6: (start, end) of a copy ready at ``at``, FIFO behind its engine's queue (R10: one stream for
        both), the engine then busy until its end; one that finds its engine idle ends ``copy_wake_s`` later."""
        free = max(self.d2h_free, self.h2d_free) if self.one_stream else self.d2h_free if d2h else self.h2d_free
        start = max(at, free)
        end = start + self.lat + nbytes * (self.inv_d2h if d2h else self.inv_h2d) + (self.wake if start > free else 0.0)
        if d2h or self.one_stream:
            self.d2h_free = end
        if not d2h or self.one_stream:
            self.h2d_free = end
        return start, end


class DiskEngines:
    """R19: the disk's read and write engines, each FIFO and independent of the link (a disk
    request goes between the disk and the host's staging buffers); a request costs the disk's
    latency plus its bytes over the rank's share of the drives (``Hardware.disk_bytes_per_s``).
    ``write_free``: the writes the last step left under way (in this step's clock)."""

    def __init__(self, hardware: Hardware, write_free: float = 0.0):
        self.read_free, self.write_free = 0.0, write_free
        self.lat = hardware.disk_latency_s
        self.inv_read = 1.0 / hardware.disk_bytes_per_s("read")
        self.inv_write = 1.0 / hardware.disk_bytes_per_s("write")

    def span(self, write: bool, at: float, nbytes: int) -> tuple[float, float]:
        """(start, end) of a request ready at ``at``, FIFO behind its engine's queue."""
        start = max(at, self.write_free if write else self.read_free)
        end = start + self.lat + nbytes * (self.inv_write if write else self.inv_read)
        if write:
            self.write_free = end
        else:
            self.read_free = end
        return start, end
