"""``swapsched run MODEL --world-size N [--compare]``: a zoo model trained under FSDP2 on N gloo
ranks of this machine (R18, live), each rank with its own batch.

``default`` wraps the model with :func:`swapsched.fully_shard` (rank 0's plan of the units, FSDP2
carrying out each unit's offload) and trains it under a :class:`~swapsched.SwapRuntime`, which
plans the activations live (and streams the optimizer state of the units left on the device,
``state.SHARD_PLACEMENTS``). ``--compare`` adds the peers of R18, each wrapped and carried out by
FSDP2 itself, every block checkpointed as their plans say: ``fsdp`` (no offload),
``fsdp-offload`` (``CPUOffloadPolicy`` on every unit) and ``fsdp-partial`` (the largest units
offloaded first, as few as fit the budget, as pytorch#188120 proposes), in shuffled interleaved
rounds. Every method trains the same weights on the same batches; each row says whether its
parameters at the end equal the first method's bit for bit.

The budget is a rank's: bytes, or a share (``"50%"``) of the rank's static bytes (its shard of the
parameters, gradients and AdamW state). On the CPU backend host and device are one memory: FSDP2's
offload moves nothing there, so the step times compare the methods' compute and collectives, not
their copies (the simulator times those: ``swapsched compare --world-size``).
"""

from __future__ import annotations

import contextlib
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from swapsched.budget import parse_budget
from swapsched.errors import UserError
from swapsched.run import round_ratios

__all__ = ["ShardedRow", "run_sharded", "format_sharded", "SHARDED_METHODS"]

#: The methods of ``--world-size N --compare``, ``default`` first
SHARDED_METHODS = ("default", "fsdp", "fsdp-offload", "fsdp-partial")
#: Steps every method runs before it is timed (the runtime's profiling steps and its first plan)
WARM_STEPS = 6


@dataclass(frozen=True)
class ShardedRow:
    """One method of a sharded run: its median step (the slowest rank's) over the first method's
    in the same rounds (``ratio``, with the lowest and highest round's), the most device bytes a
    rank held (``peak_bytes``: ``run``'s meter, on every method; ``runtime_peak_bytes`` and
    ``audit_peak_bytes``: the runtime's own accounting and its audit meter, ``default`` only),
    the units FSDP2 offloaded, and whether its parameters ended equal to the first method's."""

    method: str
    step_s_median: float
    ratio: float
    ratio_low: float
    ratio_high: float
    peak_bytes: int
    runtime_peak_bytes: int | None
    audit_peak_bytes: int | None
    budget_bytes: int
    fits: bool
    offloaded: int
    units: int
    bit_identical: bool
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_sharded(model: str, budget: str, world_size: int, *, size: str | None = None, batch_size: int | None = None,
                seq_len: int | None = None, compare: bool = False, rounds: int = 3, round_steps: int = 2,
                seed: int = 0) -> tuple[ShardedRow, ...]:
    """Train ``model`` on ``world_size`` gloo ranks as the module docstring says; a row per method."""
    import torch.multiprocessing as mp

    from swapsched.runtime.calibrate import free_port

    if world_size < 2:
        raise UserError(f"--world-size {world_size}: a sharded run needs at least 2 ranks")
    if rounds < 1 or round_steps < 1:
        raise UserError("rounds and round steps must be at least 1")
    methods = SHARDED_METHODS if compare else SHARDED_METHODS[:1]
    spec = dict(model=model, size=size, batch_size=batch_size, seq_len=seq_len, budget=budget, methods=methods,
                rounds=rounds, round_steps=round_steps, seed=seed)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world_size, free_port(), tmp, spec), nprocs=world_size, join=True,
                           start_method="spawn")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    if isinstance(ranks[0], str):  # a refusal, the same on every rank
        raise UserError(ranks[0])
    rows = []
    first = ranks[0][methods[0]]
    for name in methods:
        mine = ranks[0][name]
        if mine.get("refused"):
            rows.append(ShardedRow(name, float("nan"), float("nan"), float("nan"), float("nan"), 0, None, None,
                                   mine["budget"], False, 0, 0, False, mine["refused"]))
            continue
        peaks = [r[name] for r in ranks]
        peak = max(p["peak"] for p in peaks)
        runtime_peak = max(p["runtime_peak"] for p in peaks) if mine["runtime_peak"] is not None else None
        audit_peak = max(p["audit_peak"] for p in peaks) if mine["audit_peak"] is not None else None
        rows.append(ShardedRow(
            name, *round_ratios(mine["times"], first["times"]), peak, runtime_peak, audit_peak, mine["budget"],
            max(peak, runtime_peak or 0) <= mine["budget"], mine["offloaded"], mine["units"], all(r[name]["params"] == r[methods[0]]["params"] for r in ranks),
            mine.get("note", "")))
    return tuple(rows)


def _rank(rank: int, world: int, port: int, out: str, spec: dict[str, Any]) -> None:
    """One rank: every method built, warmed and timed in shuffled rounds (the same order on every
    rank), its result saved for :func:`run_sharded`."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        methods = {name: _Sharded(name, spec, rank) for name in spec["methods"]}
    except UserError as exc:  # the budget: refused alike on every rank (fully_shard broadcasts it)
        torch.save(str(exc), Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()
        return
    live = [m for m in methods.values() if m.refused is None]
    for m in live:
        for i in range(WARM_STEPS):
            m.step(i)
    order = random.Random(spec["seed"])
    for r in range(spec["rounds"]):
        for m in order.sample(live, len(live)):
            m.times.append([m.step(WARM_STEPS + r * spec["round_steps"] + k, timed=True)
                            for k in range(spec["round_steps"])])
    torch.save({name: m.result() for name, m in methods.items()}, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


class _Sharded:
    """One method on this rank: its model wrapped by FSDP2 as the method says, its AdamW, and
    what wraps its step (the runtime's, or every block checkpointed)."""

    def __init__(self, name: str, spec: dict[str, Any], rank: int):
        import swapsched
        from swapsched.run import _checkpoint_blocks, make_optimizer
        from swapsched.runtime.profiler import static_bytes_of
        from swapsched.zoo import build_model

        shape = dict(size=spec["size"], batch_size=spec["batch_size"], seq_len=spec["seq_len"])
        self.name = name
        self.refused: str | None = None
        self.times: list[list[float]] = []
        self.case = build_model(spec["model"], seed=0, **shape)
        self.batches = build_model(spec["model"], seed=100 + rank, **shape).inputs  # this rank's data
        per_rank = static_bytes_of(self.case.model, make_optimizer(self.case.model, "adamw")) // torch.distributed.get_world_size()
        budget = spec["budget"]
        self.budget = (int(per_rank * float(budget.strip()[:-1]) / 100) if isinstance(budget, str) and budget.strip().endswith("%")
                       else parse_budget(budget))
        self.runtime: Any = None
        try:
            self.planned = swapsched.fully_shard(self.case.model, self.case.inputs, self.case.loss_fn, budget=self.budget,
                                                 policy=name)
        except UserError as exc:
            if name == "default":
                raise
            self.refused = f"does not fit: {str(exc).split(';')[0]}"
            return
        self.optimizer = make_optimizer(self.case.model, "adamw")
        if name == "default":
            self.runtime = swapsched.SwapRuntime(budget=self.budget, model=self.case.model, optimizer=self.optimizer,
                                                 backend="cpu", audit=True)
        else:  # the peers' plans checkpoint every block (agents/state_search.py)
            _checkpoint_blocks(self.case.model)
        self.peak = 0
        self.runtime_peak: int | None = None
        self.audit_peak: int | None = None

    def step(self, i: int, timed: bool = False) -> float:
        """Step ``i`` on this rank's batch ``i`` (the same on every method): its seconds, the
        slowest rank's."""
        from swapsched.run import DeviceMeter

        torch.manual_seed(i)
        x = self.batches[0][torch.randperm(self.batches[0].shape[0])]  # batch i of this rank's data
        meter = DeviceMeter(self.case.model, self.optimizer, "cpu")
        t0 = time.perf_counter()
        with meter.step(), self.runtime.step() if self.runtime is not None else contextlib.nullcontext():
            loss = self.case.loss_fn(self.case.model(x, *self.case.inputs[1:]))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.case.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        torch.distributed.all_reduce(took, op=torch.distributed.ReduceOp.MAX)
        if timed:
            self.peak = max(self.peak, meter.peak)
            if self.runtime is not None:
                rep = self.runtime.report()
                self.runtime_peak = max(self.runtime_peak or 0, rep.peak_device_bytes or 0)
                self.audit_peak = max(self.audit_peak or 0, rep.measured_peak_bytes or 0)
        return float(took)

    def result(self) -> dict[str, Any]:
        if self.refused is not None:
            return {"refused": self.refused, "budget": self.budget}
        if self.runtime is not None:
            self.runtime.close()
        params = [p.full_tensor() for p in self.case.model.parameters()]
        return {"times": self.times, "peak": self.peak, "runtime_peak": self.runtime_peak, "audit_peak": self.audit_peak,
                "budget": self.budget, "offloaded": len(self.planned.offloaded), "units": len(self.planned.units),
                "params": [p.detach().numpy().tobytes() for p in params]}


def format_sharded(rows: tuple[ShardedRow, ...], world_size: int) -> str:
    """The table of :func:`run_sharded`, and ``default`` against the fastest peer that fits."""
    from swapsched.budget import format_bytes
    from swapsched.report import format_grid

    def peak(b: int | None) -> str:
        return format_bytes(b) if b is not None else "-"

    table = format_grid(
        ["method", "step ms (median)", "vs default", "over rounds", "peak (run's meter)", "runtime / audit", "fits",
         "units offloaded", "bit-identical", "note"],
        [[r.method, f"{1e3 * r.step_s_median:.2f}", f"{r.ratio:.2f}x", f"{r.ratio_low:.2f}-{r.ratio_high:.2f}",
          peak(r.peak_bytes), f"{peak(r.runtime_peak_bytes)} / {peak(r.audit_peak_bytes)}", "yes" if r.fits else "no",
          f"{r.offloaded}/{r.units}", "yes" if r.bit_identical else "NO", r.note] if r.units else
         [r.method, "-", "-", "-", "-", "-", "no", "-", "-", r.note] for r in rows])
    peers = [r for r in rows[1:] if r.units and r.fits]
    lines = [f"{world_size} gloo ranks; a rank's budget {format_bytes(rows[0].budget_bytes)}; the slowest rank's step "
             "(forward, backward, clipping, AdamW); peaks are the most a rank held", table]
    if peers and rows[0].units:
        best = min(peers, key=lambda r: r.step_s_median)
        lines.append(f"default / fastest fitting peer ({best.method}): {rows[0].step_s_median / best.step_s_median:.2f}x "
                     "(on the CPU backend FSDP2's offload moves nothing: the copies are not in these times)")
    return "\n".join(lines)
