"""Tests on several gloo ranks of this machine: how a worker joins and leaves the process group,
and how a test starts the ranks and reads what each saved."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swapsched.runtime.calibrate import free_port


def join_gloo(rank: int, world: int, port: int, **options: Any) -> None:
    """A worker's start: this rank in a gloo group of ``world`` on this machine, one thread each."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, **options)
    torch.set_num_threads(1)


def leave(result: Any, out: str, rank: int) -> None:
    """A worker's end: its result saved for the test, then the group torn down once every rank has
    saved (no collective is left waiting: each reaches the barrier), and the process gone."""
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    exit_rank()


def exit_rank() -> None:
    """A worker's last line, after its group is torn down: the process exits at once, its output
    flushed. The interpreter's own teardown has aborted a spawned gloo rank whose work was done
    ("terminate called without an active exception": a C++ thread still joinable as static objects
    are destroyed), which failed the test after every rank had saved its result."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker: Callable[..., None], tmp_path: Path, *args: Any, world: int = 2) -> list[Any]:
    """``worker(rank, world, port, out, *args)`` on ``world`` ranks; what each rank left, in rank order."""
    mp.start_processes(worker, args=(world, free_port(), str(tmp_path), *args), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
