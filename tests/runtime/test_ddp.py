"""SwapRuntime under DistributedDataParallel (gloo, 2 processes on the CPU)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swapsched.zoo import build_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from swapsched.deploy import SwapRuntime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    case = build_model("mlp", "tiny", seed=0)
    model = DDP(case.model)
    torch.manual_seed(100 + rank)  # each rank its own data shard
    x, y = torch.randn(8, 256), torch.randint(0, 10, (8,))
    # batch 8: the weights' gradients outweigh the activations, and no budget below the peak fits
    # (R3): every tensor goes out all the same
    rt = SwapRuntime(budget="100%", policy="swap-all", backend="cpu", min_bytes=0, model=case.model)
    for _ in range(5):
        model.zero_grad()
        with rt.step():
            torch.nn.functional.cross_entropy(model(x), y).backward()
    assert rt.report().mode == "execute"
    torch.save({n: p.grad.clone() for n, p in case.model.named_parameters()}, f"{out}/rank{rank}.pt")
    rt.close()
    dist.barrier()  # both ranks saved their results before either tears down
    dist.destroy_process_group()


def test_ddp_gradients_equal_single_process_reference(tmp_path):
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    # reference: one process, the mean of both shards' gradients (what DDP's all-reduce computes)
    case = build_model("mlp", "tiny", seed=0)
    grads = []
    for rank in range(2):
        case.model.zero_grad()
        torch.manual_seed(100 + rank)
        x, y = torch.randn(8, 256), torch.randint(0, 10, (8,))
        torch.nn.functional.cross_entropy(case.model(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in case.model.named_parameters()})
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for n, g in got.items():
            ref = (grads[0][n] + grads[1][n]) / 2
            torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-7)
    # both ranks hold the same all-reduced gradients, bit for bit
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(r0[n], r1[n]) for n in r0)


def _recompute_worker(rank: int, world: int, port: int, out: str, policy: str, budget: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from swapsched.deploy import SwapRuntime
    from tests.runtime.test_recompute import Blocks, X

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    base = Blocks(seed=4)
    model = DDP(base)
    # a slow link: the joint planner recomputes blocks (R9), run under torch.utils.checkpoint inside DDP
    # (or each block checkpointed selectively: its cache inside DDP's backward)
    rt = SwapRuntime(budget=budget, policy=policy, backend="cpu", bandwidth=1e6, model=base, profile_steps=2)
    grads = []
    for i in range(6):
        model.zero_grad()
        torch.manual_seed(1000 * rank + i)  # each rank its own dropout masks; the checkpoint replays them
        with rt.step():
            model(X * (1 + rank)).backward()
        grads.append({n: p.grad.clone() for n, p in base.named_parameters()})
    report = rt.report()
    assert report.mode == "execute" and report.recomputed_blocks and report.plan_followed
    assert report.selective_blocks or policy != "checkpoint-selective"  # default may choose either kind
    torch.save(grads, f"{out}/rank{rank}.pt")
    rt.close()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(("policy", "budget"), [("default", "90%"), ("checkpoint-selective", "100%")])
def test_ddp_with_recomputed_blocks_matches_the_single_process_reference(tmp_path, policy, budget):
    from tests.runtime.test_recompute import Blocks, X

    mp.start_processes(_recompute_worker, args=(2, _free_port(), str(tmp_path), policy, budget), nprocs=2, join=True,
                       start_method="spawn")
    # reference: one process without swapsched, each step the mean of both ranks' gradients, with
    # the same dropout masks (the same seeds before each forward)
    ref = Blocks(seed=4)
    want = []
    for i in range(6):
        per_rank = []
        for rank in range(2):
            ref.zero_grad()
            torch.manual_seed(1000 * rank + i)
            ref(X * (1 + rank)).backward()
            per_rank.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        want.append({n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in per_rank[0]})
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    for step, (g0, g1, w) in enumerate(zip(r0, r1, want, strict=True)):
        for n in w:
            assert torch.equal(g0[n], g1[n]), (step, n)  # the all-reduce gives both ranks the same
            torch.testing.assert_close(g0[n], w[n], rtol=1e-6, atol=1e-7)
