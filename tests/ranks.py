"""Tests on several gloo ranks of this machine: how a worker joins and leaves the process group,
and how a test starts the ranks and reads what each saved."""

from __future__ import annotations

import os
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
    saved (no collective is left waiting: each reaches the barrier)."""
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(worker: Callable[..., None], tmp_path: Path, *args: Any, world: int = 2) -> list[Any]:
    """``worker(rank, world, port, out, *args)`` on ``world`` ranks; what each rank left, in rank order."""
    mp.start_processes(worker, args=(world, free_port(), str(tmp_path), *args), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
