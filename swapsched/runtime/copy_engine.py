"""One copy in flight (:class:`Ticket`), and the emulated device's copy engines that run them on
the CPU backend (``backends.CpuBackend``): a thread per direction, its copies one at a time in
issue order (R6), each throttled to a link's latency and bandwidth.

Who keeps what alive during a copy is ``backends.py``'s docstring.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swapsched.runtime.worker_threads import one_torch_thread

__all__ = ["CopyError", "Ticket", "CopyEngine"]


class CopyError(RuntimeError):
    """A swap copy failed or did not complete in time; the swapper names the tensor."""


@dataclass(eq=False)
class Ticket:
    """One copy in flight. ``src`` is held until the copy completes (see the module docstring)."""

    nbytes: int
    src: Any
    dst: Any
    after: Ticket | None = None  # a swap-in never starts before its swap-out completed (R6)
    done_event: Any = None  # threading.Event (CPU) or torch.cuda.Event (CUDA)
    start_s: float = 0.0
    end_s: float = 0.0
    error: BaseException | None = field(default=None, repr=False)
    device: Any = None  # the device side of the copy (CUDA: whose streams ran it)


class CopyEngine(threading.Thread):
    """One emulated DMA engine: runs its copies one at a time, in issue order (R6), each taking
    at least ``latency + bytes / bandwidth`` seconds when throttled."""

    def __init__(self, name: str, bytes_per_s: float | None, latency_s: float):
        super().__init__(name=name, daemon=True)
        self.bytes_per_s, self.latency_s = bytes_per_s, latency_s
        self.carry_s = 0.0  # how late the last copy ended, owed by the next one queued behind it
        self.queue: deque[tuple[Ticket, Callable[[], object]]] = deque()
        self.cv = threading.Condition()
        self.stopped = False
        self.start()

    def submit(self, t: Ticket, copy: Callable[[], object]) -> None:
        with self.cv:
            self.queue.append((t, copy))
            self.cv.notify()

    def run(self) -> None:
        one_torch_thread()  # its copies' thread team would slow the training loop (worker_threads.py)
        while True:
            with self.cv:
                while not self.queue and not self.stopped:
                    self.cv.wait()
                if self.stopped and not self.queue:
                    return
                t, copy = self.queue.popleft()
            if t.after is not None:
                t.after.done_event.wait()
            t.start_s = time.perf_counter()
            try:
                if t.after is not None and t.after.error is not None:
                    # the host copy was never written: copying it in would hand back wrong data
                    raise CopyError(f"its swap-out failed ({t.after.error})")
                copy()
            except BaseException as exc:  # surfaced to the step by the swapper
                t.error = exc
            if self.bytes_per_s:
                # a sleep ends late (timer slack, the wake-up: ~0.1 ms here, as long as a small
                # copy itself): what a busy engine overshot is taken off its next copy, so that
                # copies queued back to back keep the link's rate (a lone copy still ends late)
                target = t.start_s + self.latency_s + t.nbytes / self.bytes_per_s - self.carry_s
                delay = target - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                with self.cv:
                    busy = bool(self.queue)
                self.carry_s = max(0.0, time.perf_counter() - target) if busy else 0.0
            t.end_s = time.perf_counter()
            # the closure holds the copy's source and destination: this thread lets go of them
            # before it says the copy is done, so a swap-out's source can die as soon as the
            # swapper drops the ticket (the swapper counts a storage until it dies)
            done = t.done_event
            del t, copy
            done.set()

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify()
