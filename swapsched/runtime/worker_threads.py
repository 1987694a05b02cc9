"""Torch's ops on the runtime's own threads run on one thread each.

The runtime starts threads of its own: the emulated device's copy engines, the planner that
plans in the background, the disk's reader and writer. The first torch op that one of them runs
in parallel (a large ``copy_``, the learned policy's forward) gives it an OpenMP thread team of
its own, as many threads as cores, and that team stays for as long as the thread lives. Measured
on this 2-core machine (``docs/RESULTS.md``, session 31): a training step of gpt small took
12 ms; beside one idle thread that had once run a 16 MB ``copy_``, 24-28 ms, until the thread
ended. Two teams on two cores take turns spinning, and the training loop's compute is what waits.

:func:`one_torch_thread` is each such thread's first call. The OpenMP and MKL thread counts it
sets are the calling thread's own, so the training loop keeps its count. torch also keeps the
count in a process-wide figure from which a thread that has run no op yet takes its count
(``at::init_num_threads``); that figure is put back from a thread made for the purpose, so that
threads the user starts later keep theirs.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["one_torch_thread"]


def one_torch_thread() -> None:
    """Make torch's ops on the calling thread (one of the runtime's own) run on one thread,
    leaving every other thread's count as it was (module docstring)."""
    before = torch.get_num_threads()  # this thread's, taken from the process-wide figure
    torch.set_num_threads(1)
    if before != 1:
        # the process-wide figure back, set from a thread that then ends (its own count goes with it)
        restore = threading.Thread(target=torch.set_num_threads, args=(before,), name="swapsched-thread-count")
        restore.start()
        restore.join()
