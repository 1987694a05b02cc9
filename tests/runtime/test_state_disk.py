"""runtime/state_disk.py and disk_store.py: the optimizer state resting on the disk (R19) trains
bit-identically to the plain loop under every placement that keeps it on the host, really
leaves memory between steps, and its files live and die with the run."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from swapsched.errors import UserError
from swapsched.runtime.backends import CpuBackend
from swapsched.runtime.disk_store import DiskError, DiskStore
from swapsched.runtime.state_mover import StateMover
from tests.ranks import exit_rank
from tests.runtime.test_state_mover import TiedLM, _placement, assert_same_run, train

ON_DISK = ("host-step", "full", "stream", "stream-full")


@pytest.fixture(scope="module")
def plain() -> dict[str, dict[str, Any]]:
    return {}


@pytest.mark.parametrize("variant", ["clip", "scheduler", "param-groups", "state-dict", "accumulate", "eval-between"])
@pytest.mark.parametrize("where", ON_DISK)
def test_the_state_on_the_disk_trains_bit_identically(where: str, variant: str, tmp_path: Path,
                                                      plain: dict[str, dict[str, Any]]) -> None:
    if variant not in plain:
        plain[variant] = train(None, variant)
    store = DiskStore(tmp_path)
    placement = _placement(where)
    tiers = {g: "optim" for g, w in placement.items() if w != "device"}
    try:
        moved = train(placement, variant, disk=(store, tiers))
        assert_same_run(moved, plain[variant])
        assert store.written_bytes > 0 and store.read_bytes > 0  # it went there and came back
    finally:
        store.close()
    assert not store.dir.exists()


def test_between_steps_the_state_is_in_its_file_and_not_in_memory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backend, store = CpuBackend(), DiskStore(tmp_path)
    mover = StateMover(model, opt, backend, (), {"layers.0": "host-step", "layers.1": "stream"},
                       disk=(store, {"layers.0": "optim", "layers.1": "optim"}))
    try:
        x = torch.randint(0, 40, (4, 6))
        for _ in range(2):
            from tests.runtime.test_state_mover import Harness

            Harness(mover).train_step(model, x)
            opt.step()
            opt.zero_grad()
        store.settle()
        for block in (model.layers[0], model.layers[1]):
            for p in block.parameters():
                assert opt.state[p]["exp_avg"].numel() == 0 and opt.state[p]["exp_avg_sq"].numel() == 0
                assert opt.state[p]["step"].item() == 2  # the scalar step count stays in memory
        w = model.layers[0].up.weight
        expected = sum(2 * p.numel() * 4 for b in (model.layers[0], model.layers[1]) for p in b.parameters())
        assert store.resting_bytes == expected and w.numel() > 0
        assert sorted(f.name for f in store.dir.iterdir()) == ["layers.0.bin", "layers.1.bin"]
        assert sum(f.stat().st_size for f in store.dir.iterdir()) >= expected
        report = mover.report(())
        assert report.disk_bytes == expected and report.disk_written_bytes >= expected
        assert report.disk_read_bytes >= expected  # the second step read what the first wrote
        mover.remove()  # everything back in memory (and on the device)
        assert opt.state[w]["exp_avg"].numel() == w.numel()
    finally:
        store.close()
        backend.shutdown()


def test_a_second_run_on_the_same_directory_never_reads_the_first_ones_files(tmp_path: Path) -> None:
    a, b = DiskStore(tmp_path), DiskStore(tmp_path)
    try:
        assert a.dir != b.dir and a.dir.parent == b.dir.parent == tmp_path
        x = torch.ones(1000)
        a.write("g", [x])
        assert "g" not in b
        b.load("g")  # nothing of b's: nothing read
        assert b.read_bytes == 0
    finally:
        a.close()
        b.close()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_the_state_whole_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskStore(tmp_path)

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    x = torch.arange(5000, dtype=torch.float32)
    try:
        store.write("g", [x])
        with pytest.raises(DiskError, match="the disk is full; its state is back in host memory"):
            store.settle()
        assert torch.equal(x, torch.arange(5000, dtype=torch.float32)) and "g" not in store
    finally:
        store.close()


def test_bad_directories_and_tiers_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        DiskStore(tmp_path / "missing")
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backend, store = CpuBackend(), DiskStore(tmp_path)
    try:
        with pytest.raises(UserError, match="rests the optimizer state there"):
            StateMover(model, opt, backend, (), {"layers.0": "full"}, disk=(store, {"layers.0": "state"}))
        with pytest.raises(UserError, match="rests nothing on the host"):
            StateMover(model, opt, backend, (), {"layers.0": "param"}, disk=(store, {"layers.0": "optim"}))
        # refused before anything moved: the model still trains on the device, its state there
        assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_state_dict_pre_hooks
    finally:
        store.close()
        backend.shutdown()


def test_swap_runtime_rests_on_the_disk_what_the_host_budget_cannot_hold(tmp_path: Path) -> None:
    """SwapRuntime with a host budget of a quarter of the state and a directory: ``default`` rests
    optimizer state on the disk, training is bit-identical to the plain loop, both budgets hold
    by the runtime's meters (the device's by the independent audit too), and close() removes the
    run's files."""
    import copy

    import torch.nn as nn

    import swapsched
    from swapsched.runtime.profiler import static_bytes_of

    torch.manual_seed(0)
    width = 128
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(16)])
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    state = 16 * sum(p.numel() for p in model.parameters())
    host_budget = state // 4
    rt = swapsched.SwapRuntime(budget=int(0.6 * static_bytes_of(model, opt)), model=model, optimizer=opt,
                               host_budget=host_budget, disk=tmp_path, audit=True)
    x = torch.randn(64, width)
    try:
        for _ in range(7):
            with rt.step():
                loss = model(x).square().mean()
                loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = ref(x).square().mean()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert loss.item() == ref_loss.item()
            r = rt.report()
            if r.mode == "execute":
                assert r.host_peak_bytes <= host_budget and r.peak_device_bytes <= r.budget_bytes
                assert r.measured_peak_bytes is not None and r.measured_peak_bytes <= r.budget_bytes
        assert r.mode == "execute"
        assert rt.plan is not None and rt.plan.disk and all(t == "optim" for _, t in rt.plan.disk)
        assert r.state is not None and r.state.disk_bytes > 0 and r.state.disk_read_bytes > 0
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    finally:
        rt.close()
    assert list(tmp_path.iterdir()) == []


def test_the_runtime_carries_out_what_the_host_budget_holds_of_a_plan() -> None:
    """R11: a peer's plan placing every group on the host (ZeRO-Offload's) under a host budget of
    a quarter of the state is carried out as the simulator runs it: the groups the host cannot
    hold stay on the device, and the host holds at most its budget."""
    import torch.nn as nn

    import swapsched
    from swapsched.runtime.profiler import static_bytes_of

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(16)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    host_budget = 16 * sum(p.numel() for p in model.parameters()) // 4
    rt = swapsched.SwapRuntime(budget=int(0.9 * static_bytes_of(model, opt)), policy="zero-offload", model=model,
                               optimizer=opt, host_budget=host_budget)
    x = torch.randn(64, 128)
    try:
        for _ in range(5):
            with rt.step():
                model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        r = rt.report()
        assert rt.plan is not None and 0 < len(rt.plan.state) < 16  # some groups, not all, on the host
        assert r.mode == "execute" and 0 < r.host_peak_bytes <= host_budget
    finally:
        rt.close()


def test_the_run_s_files_go_at_interpreter_exit_without_close(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import torch\nfrom swapsched.runtime.disk_store import DiskStore\n"
            f"s = DiskStore({str(tmp_path)!r})\ns.write('g', [torch.ones(4096)])\nprint(s.dir)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    made = Path(out.stdout.strip())
    assert made.parent == tmp_path and not made.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_pinned_staging_and_storages_round_trip_on_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    store = DiskStore(tmp_path, pin=True)
    try:
        x = torch.randn(1 << 20).pin_memory()
        want = x.clone()
        store.write("g", [x])
        store.load("g")
        assert torch.equal(x, want) and x.is_pinned()
        assert torch.equal(x.cuda(non_blocking=True).cpu(), want)
    finally:
        store.close()


def _ddp_disk_worker(rank: int, world: int, port: int, out: str) -> None:
    """DDP alone and DDP with the optimizer state resting on the disk, on the same batches."""
    import contextlib
    import copy

    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import swapsched
    from swapsched.runtime.profiler import static_bytes_of

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(16)])
    runs = []
    for disk in (False, True):
        net = copy.deepcopy(base)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        model = DDP(net)
        rt = None
        if disk:
            state = 16 * sum(p.numel() for p in net.parameters())
            where = Path(out) / f"disk{rank}"
            where.mkdir()
            rt = swapsched.SwapRuntime(budget=int(0.6 * static_bytes_of(net, opt)), model=net, optimizer=opt,
                                       backend="cpu", host_budget=state // 4, disk=where)
        losses = []
        for i in range(6):
            torch.manual_seed(100 * rank + i)  # each rank its own batch
            x = torch.randn(64, 128)
            with rt.step() if rt is not None else contextlib.nullcontext():
                loss = model(x).square().mean()
                loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        if rt is not None:
            on_disk = bool(rt.plan is not None and rt.plan.disk)
            rt.close()
            assert on_disk
        runs.append({"losses": losses, "params": [p.detach().clone() for p in net.parameters()],
                     "moments": [{k: v.clone() for k, v in opt.state[p].items()} for p in net.parameters()]})
    torch.save(runs, f"{out}/ddp{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    exit_rank()  # tests/ranks.py: the interpreter's teardown has aborted a finished rank


@pytest.mark.timeout(300)
def test_ddp_with_the_optimizer_state_on_the_disk_is_bit_identical_to_ddp_alone(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from swapsched.runtime.calibrate import free_port

    mp.start_processes(_ddp_disk_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        alone, on_disk = torch.load(tmp_path / f"ddp{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(alone["losses"], on_disk["losses"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(alone["params"], on_disk["params"], strict=True))
        for a, b in zip(alone["moments"], on_disk["moments"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
