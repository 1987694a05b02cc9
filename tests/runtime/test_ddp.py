"""SwapRuntime under DistributedDataParallel (gloo, 2 processes on the CPU)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swapsched.runtime.calibrate import free_port
from swapsched.zoo import build_model
from tests.ranks import exit_rank


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
    exit_rank()  # tests/ranks.py: the interpreter's teardown has aborted a finished rank


def test_ddp_gradients_equal_single_process_reference(tmp_path):
    mp.start_processes(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
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
    from tests.runtime.test_recompute import X_WIDE as X  # activations outweigh the gradients (R3)
    from tests.runtime.test_recompute import Blocks

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
    exit_rank()  # tests/ranks.py: the interpreter's teardown has aborted a finished rank


@pytest.mark.parametrize(("policy", "budget"), [("default", "90%"), ("checkpoint-selective", "100%")])
def test_ddp_with_recomputed_blocks_matches_the_single_process_reference(tmp_path, policy, budget):
    from tests.runtime.test_recompute import X_WIDE as X  # the worker's batch
    from tests.runtime.test_recompute import Blocks

    mp.start_processes(_recompute_worker, args=(2, free_port(), str(tmp_path), policy, budget), nprocs=2, join=True,
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


def _state_worker(rank: int, world: int, port: int, out: str, accumulate: int) -> None:
    """DDP alone and DDP with swapsched moving the state, side by side on the same batches."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from swapsched.deploy import SwapRuntime
    from swapsched.runtime.profiler import profile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    runs = []
    for swap in (False, True):
        case = build_model("gpt", "tiny", seed=3)
        optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
        model = DDP(case.model)
        runtime = None
        if swap:
            # a byte budget no plan of the activations alone meets: the state moves (R17)
            trace = profile(build_model("gpt", "tiny", seed=3).model, case.inputs, case.loss_fn, name="gpt-tiny",
                            state="adamw")
            share = 0.5 if accumulate == 1 else 0.75  # accumulating holds the sum so far on the device too
            budget = int(trace.static_bytes * share) + 2 * (trace.min_feasible_bytes - trace.static_bytes)
            assert budget < trace.min_feasible_bytes
            runtime = SwapRuntime(budget=budget, policy="default", model=case.model, optimizer=optimizer,
                                  backend="cpu", audit=True)
        losses, modes = [], []
        for i in range(6):
            for micro in range(accumulate):
                torch.manual_seed(1000 * rank + 10 * i + micro)  # each rank its own batches
                x = torch.randint(0, 128, case.inputs[0].shape)
                sync = contextlib.nullcontext() if micro == accumulate - 1 else model.no_sync()
                with sync, (runtime.step() if runtime is not None else contextlib.nullcontext()):
                    loss = case.loss_fn(model(x))
                    loss.backward()
                losses.append(loss.detach())
                if runtime is not None:
                    report = runtime.report()
                    modes.append(report.mode)
                    if report.mode == "execute":  # every executed step within the budget, by both meters
                        assert report.state is not None and report.state.placements
                        assert report.peak_device_bytes is not None and report.peak_device_bytes <= budget
                        assert report.measured_peak_bytes is not None and report.measured_peak_bytes <= budget
            torch.nn.utils.clip_grad_norm_(case.model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if runtime is not None:
            runtime.close()
            assert "execute" in modes and "profile" in modes, modes
        runs.append({"losses": losses, "params": {n: p.detach().clone() for n, p in case.model.named_parameters()},
                     "moments": [{k: v.clone() for k, v in optimizer.state[p].items()} for p in case.model.parameters()]})
    torch.save(runs, f"{out}/state{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    exit_rank()  # tests/ranks.py: the interpreter's teardown has aborted a finished rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_ddp_with_the_state_moving_is_bit_identical_to_ddp_alone(tmp_path, accumulate):
    # DDP reduces p.grad as backward ends: a gradient copied to the host as it completed kept the
    # rank's own (8e-3 off DDP alone after 8 steps), and one accumulated there under no_sync() was
    # never reduced (replicas.py)
    mp.start_processes(_state_worker, args=(2, free_port(), str(tmp_path), accumulate), nprocs=2, join=True,
                       start_method="spawn")
    for rank in range(2):
        alone, swapped = torch.load(tmp_path / f"state{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(alone["losses"], swapped["losses"], strict=True))
        for n, p in alone["params"].items():
            assert torch.equal(p, swapped["params"][n]), n
        for a, b in zip(alone["moments"], swapped["moments"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _bucket_view_worker(rank: int, world: int, port: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from swapsched.deploy import SwapRuntime
    from swapsched.errors import UserError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    case = build_model("gpt", "tiny", seed=3)
    optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    model = DDP(case.model, gradient_as_bucket_view=True)
    with SwapRuntime(budget=1_700_000, policy="default", model=case.model, optimizer=optimizer, backend="cpu") as rt, \
            pytest.raises(UserError, match="gradient_as_bucket_view=False"), rt.step():
        case.loss_fn(model(*case.inputs)).backward()
    dist.destroy_process_group()
    exit_rank()  # tests/ranks.py: the interpreter's teardown has aborted a finished rank


@pytest.mark.timeout(120)
def test_ddp_gradients_in_bucket_views_cannot_move_and_say_so():
    mp.start_processes(_bucket_view_worker, args=(1, free_port()), nprocs=1, join=True, start_method="spawn")
