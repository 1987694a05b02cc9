"""R19, live: tensors resting in files on a local disk, read and written off the Python thread.

:class:`DiskStore` keeps each key's tensors (a state group's optimizer state) in one file, each
tensor's whole storage at an offset aligned to ``ALIGN``.

- **Where the files live.** Under the user's directory, in a directory of the run's own
  (``swapsched-<pid>-<random>``): a second run on the same directory never reads the first one's
  files. The directory is removed at :meth:`close` and at interpreter exit.
- **How bytes move.** Through at most ``STAGING_SLOTS`` staging buffers at once, each aligned to
  ``ALIGN`` and the size of its key's file (pinned where the backend pins; a buffer of the same
  size is used again): with ``O_DIRECT`` where the filesystem allows it (no page cache: the host
  holds only the slots), else buffered I/O, said once. One reader thread and one writer thread
  (``os.preadv`` / ``os.pwritev`` release the GIL), each FIFO as the simulator's engines
  (``env/disk_tier.py``); a read of a key waits for its write in flight.
- **What holds the bytes.** :meth:`write` copies the tensors into a slot and lets their storages
  go (each tensor keeps its shape's record here and is empty until :meth:`load`); the slot holds
  the bytes until the write lands. A failed write (a full disk) puts them back into the tensors
  before :class:`DiskError` is raised, so the state stays whole in memory.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from swapsched.budget import parse_budget
from swapsched.env.state_parts import STAGING_SLOTS
from swapsched.errors import UserError
from swapsched.hardware import Hardware
from swapsched.runtime.transients import runtime_allocation
from swapsched.runtime.worker_threads import one_torch_thread

__all__ = ["DiskStore", "DiskError", "ALIGN", "measure_disk", "with_disk"]

#: Direct I/O's alignment of buffers, offsets and lengths (the logical block of NVMe drives and
#: the page of the host)
ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DiskError(UserError):
    """The disk tier cannot read or write its files (a full disk, an I/O error)."""


def _check_platform() -> None:
    """The disk tier's reads and writes are ``os.preadv`` and ``os.pwritev`` (they release the GIL)."""
    if not (hasattr(os, "preadv") and hasattr(os, "pwritev")):
        raise UserError("the disk tier reads and writes with os.preadv and os.pwritev, which this platform lacks "
                        "(they need Linux, FreeBSD or macOS 11+); leave disk= out here")


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _let_go(t: torch.Tensor) -> None:
    """``t`` empty: its storage goes (where nothing else holds it)."""
    t.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


@dataclass
class _Tensor:
    """Where one tensor's storage lies in its key's file, and how to put it back."""

    t: torch.Tensor
    offset: int  # in the file
    nbytes: int  # its storage's
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _Slot:
    """One aligned staging buffer."""

    def __init__(self, nbytes: int, pin: bool):
        with runtime_allocation():  # host memory: no meter of the device counts it (transients.py)
            self.raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
        skip = (-self.raw.data_ptr()) % ALIGN
        self.view = self.raw[skip: skip + nbytes]
        self.array = self.view.numpy()  # what os.preadv / os.pwritev fill and drain


class DiskStore:
    """Tensors at rest in files under ``directory`` (module docstring); ``pin``: pinned staging
    and storages (the CUDA backend)."""

    def __init__(self, directory: str | Path, *, pin: bool = False):
        _check_platform()
        root = Path(directory).expanduser()
        if not root.is_dir():
            raise UserError(f"disk directory {str(root)!r} does not exist; create it on the drive to use (a local NVMe "
                            "drive, not a network filesystem)")
        self.dir = Path(tempfile.mkdtemp(prefix=f"swapsched-{os.getpid()}-", dir=root))
        self.pin = pin
        self.direct = _supports_direct(self.dir)
        if not self.direct:
            warnings.warn(f"the filesystem of {root} does not take direct I/O (O_DIRECT): the disk tier reads and "
                          "writes through the page cache, which holds host memory beyond the host budget", stacklevel=3)
        # their copies into and out of staging run on one thread each (worker_threads.py)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="swapsched-disk-read", initializer=one_torch_thread)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="swapsched-disk-write", initializer=one_torch_thread)
        self._lock = threading.Lock()
        self._free: list[_Slot] = []
        self._alive: list[_Slot] = []  # every staging buffer, free or in use
        self._layout: dict[str, list[_Tensor]] = {}  # keys whose file is current
        self._memory: set[str] = set()  # ... whose tensors hold their bytes in memory too
        self._writes: dict[str, tuple[Future[None], _Slot]] = {}
        self._reads: dict[str, tuple[Future[None], _Slot]] = {}
        self.read_bytes = self.written_bytes = 0
        self.wait_s = 0.0  # the calling thread waiting for the disk
        self._closed = False
        atexit.register(self.close)

    # ------------------------------------------------------------------ what it holds
    def __contains__(self, key: str) -> bool:
        """Whether ``key`` rests on the disk now (its tensors empty)."""
        return key in self._layout and key not in self._memory

    @property
    def resting_bytes(self) -> int:
        """What rests on the disk now."""
        return sum(x.nbytes for key, layout in self._layout.items() if key not in self._memory for x in layout)

    @property
    def staging_bytes(self) -> int:
        """The staging buffers alive now (host memory, R11)."""
        return sum(slot.raw.numel() for slot in self._alive)

    # ------------------------------------------------------------------ staging
    def _slot(self, nbytes: int) -> _Slot:
        """A staging buffer of ``nbytes``: a free one of that size, else a new one while fewer
        than ``STAGING_SLOTS`` are alive (a free one of another size let go for it), else the
        one the oldest write in flight frees is waited for."""
        nbytes = _up(nbytes)
        while True:
            same = next((slot for slot in self._free if slot.view.numel() == nbytes), None)
            if same is not None:
                self._free.remove(same)
                return same
            if self._free and len(self._alive) >= STAGING_SLOTS:
                self._alive.remove(self._free.pop())
            if len(self._alive) < STAGING_SLOTS:
                slot = _Slot(nbytes, self.pin)
                self._alive.append(slot)
                return slot
            if not self._writes:
                raise AssertionError("every staging buffer is taken by reads ahead")  # callers read one ahead
            self._finish_write(next(iter(self._writes)))

    # ------------------------------------------------------------------ writes
    def write(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        """``tensors``' bytes to ``key``'s file (issued); their storages go at once, the slot
        holding the bytes until the write lands (module docstring)."""
        self._check_open()
        self._quiesce(key)
        layout, offset = [], 0
        for t in tensors:
            nbytes = t.untyped_storage().nbytes()
            layout.append(_Tensor(t, offset, nbytes, int(t.storage_offset()), tuple(t.shape), tuple(t.stride())))
            offset += _up(nbytes)
        slot = self._slot(offset)
        with torch.no_grad():
            for x in layout:
                slot.view[x.offset: x.offset + x.nbytes].copy_(_bytes_of(x.t.untyped_storage()))
                _let_go(x.t)  # the slot holds its bytes until the write lands
        self._layout[key] = layout
        self._memory.discard(key)
        self._writes[key] = (self._writer.submit(self._pwrite, key, slot, offset), slot)
        self.written_bytes += offset

    def _quiesce(self, key: str) -> None:
        """Nothing of ``key``'s in flight: a read ahead of it dropped (its file is about to change
        or be forgotten: the bytes are stale), its write landed."""
        if key in self._reads:
            future, slot = self._reads.pop(key)
            future.result()
            self._free.append(slot)
        if key in self._writes:
            self._finish_write(key)

    def _pwrite(self, key: str, slot: _Slot, nbytes: int) -> None:
        fd = os.open(self.dir / f"{key}.bin", os.O_WRONLY | os.O_CREAT | (_O_DIRECT if self.direct else 0), 0o600)
        try:
            done = 0
            while done < nbytes:
                done += os.pwritev(fd, [slot.array[done:nbytes].data], done)
        finally:
            os.close(fd)

    def _finish_write(self, key: str) -> None:
        """Wait for ``key``'s write; a failed one puts the bytes back into its tensors and raises."""
        future, slot = self._writes.pop(key)
        t0 = time.perf_counter()
        try:
            future.result()
        except OSError as exc:
            self._restore(key, slot)
            self._layout.pop(key)  # the file is not current: the tensors are the state
            self._memory.discard(key)
            self._free.append(slot)
            why = "the disk is full" if exc.errno == errno.ENOSPC else str(exc)
            raise DiskError(f"writing {key!r} to {self.dir}: {why}; its state is back in host memory (lower the disk "
                            "budget or free space)") from exc
        finally:
            self.wait_s += time.perf_counter() - t0
        self._free.append(slot)

    # ------------------------------------------------------------------ reads
    def prefetch(self, key: str) -> None:
        """Issue ``key``'s read into a staging slot (after its write in flight), if it rests on the disk."""
        if key not in self or key in self._reads:
            return
        self._check_open()
        layout = self._layout[key]
        nbytes = layout[-1].offset + _up(layout[-1].nbytes) if layout else 0
        slot = self._slot(nbytes)
        written = self._writes.get(key, (None, None))[0]
        self._reads[key] = (self._reader.submit(self._pread, key, slot, nbytes, written), slot)

    def _pread(self, key: str, slot: _Slot, nbytes: int, written: Future[None] | None) -> None:
        if written is not None:
            written.result()
        fd = os.open(self.dir / f"{key}.bin", os.O_RDONLY | (_O_DIRECT if self.direct else 0))
        try:
            done = 0
            while done < nbytes:
                got = os.preadv(fd, [slot.array[done:nbytes].data], done)
                if got == 0:
                    raise OSError(errno.EIO, f"{key}.bin ends at {done} of {nbytes} bytes")
                done += got
        finally:
            os.close(fd)

    def load(self, key: str) -> None:
        """``key``'s tensors whole again from the disk (read now where no read was issued ahead);
        its file stays current until they change (``release`` lets them go again unwritten)."""
        if key not in self:
            return
        if key not in self._reads:
            self.prefetch(key)
        future, slot = self._reads.pop(key)
        t0 = time.perf_counter()
        try:
            future.result()
        except OSError as exc:
            self._free.append(slot)
            raise DiskError(f"reading {key!r} from {self.dir}: {exc}") from exc
        finally:
            self.wait_s += time.perf_counter() - t0
        if key in self._writes:  # landed before the read began
            self._finish_write(key)
        self._restore(key, slot)
        self._free.append(slot)
        self.read_bytes += sum(_up(x.nbytes) for x in self._layout[key])

    def _restore(self, key: str, slot: _Slot | None) -> None:
        """``key``'s tensors given storages again, filled from ``slot`` (None: left as allocated)."""
        with torch.no_grad(), runtime_allocation():  # host memory, as the slots
            for x in self._layout[key]:
                storage = torch.empty(x.nbytes, dtype=torch.uint8, pin_memory=self.pin).untyped_storage()
                if slot is not None:
                    _bytes_of(storage).copy_(slot.view[x.offset: x.offset + x.nbytes])
                x.t.set_(storage, x.storage_offset, x.shape, x.stride)
        self._memory.add(key)

    def release(self, key: str) -> None:
        """``key``'s tensors, loaded and unchanged, let go again: their file is current."""
        if key in self._layout and key in self._memory:
            with torch.no_grad():
                for x in self._layout[key]:
                    _let_go(x.t)
            self._memory.discard(key)

    def allocate(self, key: str) -> None:
        """``key``'s tensors given storages to be filled (not read: a copy will overwrite them
        and ``write`` follow); its file is stale from now."""
        if key in self:
            self._quiesce(key)
            self._restore(key, None)
            self._layout.pop(key)
            self._memory.discard(key)

    def load_all(self) -> None:
        """Every key back in memory (a checkpoint reads the state; a change of plan hands it over)."""
        keys = [key for key in self._layout if key in self]
        for k, key in enumerate(keys):
            if k + 1 < len(keys):
                self.prefetch(keys[k + 1])  # one read ahead: a staging buffer each
            self.load(key)

    def forget(self, key: str) -> None:
        """``key``'s file no longer holds its tensors (they were replaced: a loaded state dict)."""
        self._quiesce(key)
        self._layout.pop(key, None)
        self._memory.discard(key)

    def settle(self) -> None:
        """Every write landed (a step's end, before its report)."""
        for key in list(self._writes):
            self._finish_write(key)

    # ------------------------------------------------------------------ the end
    def _check_open(self) -> None:
        if self._closed:
            raise UserError("the runtime's disk store is closed (SwapRuntime.close() ran)")

    def close(self) -> None:
        """Wait for what is in flight, let the threads go and remove the run's directory (what
        rests there is gone: bring it back first with :meth:`load_all`)."""
        if self._closed:
            return
        self._closed = True
        for ex in (self._reader, self._writer):
            ex.shutdown(wait=True)
        self._writes.clear()
        self._reads.clear()
        self._free.clear()
        self._alive.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.close)


def _supports_direct(directory: Path) -> bool:
    """Whether a file in ``directory`` takes ``O_DIRECT`` reads and writes of aligned blocks."""
    if not _O_DIRECT:
        return False
    probe = directory / ".direct-probe"
    slot = _Slot(ALIGN, False)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | _O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [slot.array.data], 0)
        os.preadv(fd, [slot.array.data], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def measure_disk(directory: str | Path, nbytes: int = 256 * 2**20, block: int = 16 * 2**20) -> tuple[float, float, float, bool]:
    """R19: (read bytes/s, write bytes/s, latency s, direct I/O) of the drive under
    ``directory``: ``nbytes`` written and read back in ``block``-sized sequential requests, as the
    runtime's threads issue them (direct I/O where the filesystem takes it; else the page cache
    is dropped between the write and the read), and the median of 8 reads of one ``ALIGN`` block."""
    _check_platform()
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise UserError(f"disk directory {str(root)!r} does not exist")
    where = Path(tempfile.mkdtemp(prefix="swapsched-calibrate-", dir=root))
    try:
        direct = _supports_direct(where)
        flags = _O_DIRECT if direct else 0
        block = _up(min(block, nbytes))
        slot = _Slot(block, False)
        slot.view.fill_(7)
        path = where / "probe.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o600)
        try:
            t0 = time.perf_counter()
            for off in range(0, _up(nbytes), block):
                os.pwritev(fd, [slot.array.data], off)
            os.fsync(fd)
            write_s = time.perf_counter() - t0
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for off in range(0, _up(nbytes), block):
                os.preadv(fd, [slot.array.data], off)
            read_s = time.perf_counter() - t0
            small = _Slot(ALIGN, False)
            lat = []
            for k in range(8):
                t0 = time.perf_counter()
                os.preadv(fd, [small.array.data], (k * 7919 * ALIGN) % _up(nbytes))
                lat.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
        total = _up(nbytes) // block * block
        return total / read_s, total / write_s, sorted(lat)[len(lat) // 2], direct
    finally:
        shutil.rmtree(where, ignore_errors=True)


def with_disk(hardware: Hardware, directory: str | Path, budget: str | int | None) -> Hardware:
    """R19: ``hardware`` with the disk tier on under ``directory``: its rates as the profile gives
    them, else measured there now (:func:`measure_disk`, about a second); its budget ``budget``
    (bytes), else nine tenths of the filesystem's free space."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise UserError(f"disk directory {str(root)!r} does not exist; create it on the drive to use")
    if isinstance(budget, str) and budget.strip().endswith("%"):
        raise UserError(f"disk_budget {budget!r}: give bytes, like '1TiB' (what this rank's state may rest on the drive)")
    nbytes = parse_budget(budget) if budget is not None else int(0.9 * shutil.disk_usage(root).free)
    if hardware.disk_read_bytes_per_s is None or hardware.disk_write_bytes_per_s is None:
        read, write, latency, _ = measure_disk(root, nbytes=64 * 2**20)
        hardware = replace(hardware, disk_read_bytes_per_s=read, disk_write_bytes_per_s=write, disk_latency_s=latency)
    return hardware.with_host(disk_budget_bytes=nbytes)
