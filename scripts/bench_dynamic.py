#!/usr/bin/env python
"""Variable shapes: does every batch run a plan? Steps of variable length under the live runtime.

    python scripts/bench_dynamic.py [--steps 40] [--budgets 50%,70%,90%] [--bandwidth 1e9] [--rounds 2]
                                    [--policy min] [--no-background] [--seed 0] [--out bench_results/dynamic.json]

Cases (CPU backend, copies throttled to ``--bandwidth``):
- ``encoder``: a 4-layer transformer encoder (d 128, 4 heads; its attention saves scores quadratic
  in the length) on token batches of 8 whose length is drawn log-uniform from 16-256 each step, as
  a collator padding each batch to its longest sequence makes them;
- ``convnet``: a 6-block CNN on batches of 16 images whose side is drawn from {24, 32, 40}.

Each budget is that percentage of the longest step's activation peak, given to the runtime in bytes.

Per case and budget, the length sequence is trained three ways in shuffled order each round:
swapsched (``--policy``), swapsched on static shapes at the mean length, and
``torch.autograd.graph.save_on_cpu`` (a plain memcpy here, not the throttled link: its row is not
comparable on time). Every step of each is timed beside the same step of a plain copy, in
alternating order, which also checks the losses bit for bit: each ratio pairs a step with plain
training at the same step, same length and same moment, since this machine's noise moves a step's
time by more than the effects measured.
Reported: the share of steps after the first five that executed a plan (predicted shapes counted
apart), the median step over plain training's (the median of per-step ratios) and the total time
over plain's, the same for the static run, their ratios (dynamic over static), the share of steps
that copied anything in each (at one budget in bytes the mean length may need no swap where the
long steps do, and dynamic over static then prices that too), the most any step's peak exceeded
the budget by the runtime's audit meter, and the seconds the runtime planned on the training
loop's thread (the critical path: ``planning_s`` of its reports, the policy's plans there and its
own layouts of new and predicted shapes; a new shape's policy plan is made on the runtime's planner
thread unless ``--no-background``) with their share of training, over the whole run and after the
first five steps.
Run it alone: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table, write  # noqa: E402

from swapsched.agents.learned import LearnedPolicy  # noqa: E402
from swapsched.agents.registry import get_policy  # noqa: E402
from swapsched.budget import parse_budget  # noqa: E402
from swapsched.deploy import SwapRuntime  # noqa: E402


class Encoder(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 128, layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


class ConvNet(nn.Module):
    def __init__(self, c: int = 32):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
                                    for _ in range(6))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for b in self.blocks:
            h = h + b(h)
        return nn.functional.cross_entropy(self.head(h.mean((2, 3))), torch.zeros(x.shape[0], dtype=torch.long))


def _encoder_batch(n: int) -> torch.Tensor:
    return torch.randint(0, 1000, (8, n), generator=torch.Generator().manual_seed(n))


def _image_batch(n: int) -> torch.Tensor:
    return torch.randn(16, 3, n, n, generator=torch.Generator().manual_seed(n))


CASES = {
    "encoder": (Encoder, _encoder_batch, lambda rng: int(round(math.exp(rng.uniform(math.log(16), math.log(256)))))),
    "convnet": (ConvNet, _image_batch, lambda rng: rng.choice([24, 32, 40])),
}


class TimedPolicy:
    """The policy, with the seconds its plans took: on the training loop's thread (between steps,
    on the critical path) and on the runtime's planner thread (in the background) apart."""

    def __init__(self, name: str):
        self.inner = get_policy(name)
        self.name = self.inner.name
        self.on_path_s = self.background_s = 0.0
        self.calls = 0

    def plan(self, trace, budget, hardware):
        t0 = time.perf_counter()
        try:
            return self.inner.plan(trace, budget, hardware)
        finally:
            dt = time.perf_counter() - t0
            if threading.current_thread() is threading.main_thread():
                self.on_path_s += dt
            else:
                self.background_s += dt
            self.calls += 1


def _train(cls, batch, lengths, wrap=None, runtime=None, model=None):
    """Train a copy (``model``, else a fresh one) inside ``wrap()`` or ``runtime.step()`` beside a
    plain copy, step by step, the two in alternating order: per step (seconds, the plain copy's
    seconds at the same step, the runtime's report or None); raises if a loss differs. Timing
    both in the same step pairs each ratio against the same machine state: this machine's noise
    moves a step's time by more than the effects measured. The seconds of a runtime step include
    what the runtime does after it (planning, re-timing)."""
    torch.manual_seed(0)
    a = model if model is not None else cls()
    torch.manual_seed(0)
    b = cls()
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (a, b)]
    out = []
    for i, n in enumerate(lengths):
        x = batch(n)
        times = {}
        for who in (("way", "plain") if i % 2 == 0 else ("plain", "way")):
            ctx = (runtime.step() if runtime is not None else (wrap() if wrap else torch.enable_grad())) \
                if who == "way" else torch.enable_grad()
            t0 = time.perf_counter()
            with ctx:
                loss = (a if who == "way" else b)(x)
                loss.backward()
            times[who] = (time.perf_counter() - t0, loss)
        if not torch.equal(times["way"][1], times["plain"][1]):
            raise SystemExit(f"losses differ at length {n}")
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        out.append((times["way"][0], times["plain"][0], runtime.report() if runtime is not None else None))
    return out


WAYS = ("runtime", "runtime-static", "save_on_cpu")
WARMUP = 5  # steps left out of every ratio and share


def _median_ratio(steps: list) -> float:
    """The median over the steps after the warm-up of each one's time over the plain step beside it."""
    return statistics.median(dt / plain for dt, plain, _ in steps[WARMUP:])


def _total_ratio(steps: list) -> float:
    """The time of the steps after the warm-up over the plain steps' beside them."""
    late = steps[WARMUP:]
    return sum(dt for dt, _, _ in late) / sum(plain for _, plain, _ in late)


def run_case(name: str, budget: str, steps: int, bandwidth: float, policy: str, seed: int, rounds: int,
             background: bool) -> dict:
    """The three ways of training ``name``'s length sequence, in shuffled order each round, each
    step timed beside plain training; ratios per round (median over the steps after the warm-up,
    and total time over total time), then their median and range over the rounds."""
    cls, batch, draw = CASES[name]
    rng = random.Random(seed)
    lengths = [draw(rng) for _ in range(steps)]
    static_len = int(round(statistics.mean(lengths)))
    # the budget in bytes for the whole run: the percentage of the longest step's activation peak
    # (a relative budget given to the runtime is resolved against its first profiled step, whose
    # length is a draw: at 50% a longer step could not fit it, and the runtime refuses it)
    torch.manual_seed(0)
    probe_model = cls()
    with SwapRuntime(budget="100%", policy=None, backend="cpu", model=probe_model, profile_steps=1, retime_steps=0) as probe:
        with probe.step():
            probe_model(batch(max(lengths))).backward()
        budget_bytes = parse_budget(budget, probe.trace)
    order = random.Random(seed + 1)
    per_round = []
    for _ in range(rounds):
        got, policies = {}, {}
        for way in order.sample(WAYS, len(WAYS)):
            seq = [static_len] * steps if way.endswith("static") else lengths
            if way.startswith("runtime"):
                timed = TimedPolicy(policy)
                torch.manual_seed(0)
                model = cls()
                inner = timed.inner
                # a learned search policy's own greedy plan starts each new shape, as SwapRuntime("default") has it
                quick = (LearnedPolicy(inner.checkpoint, mode="greedy")
                         if isinstance(inner, LearnedPolicy) and inner.mode == "search" else None)
                with SwapRuntime(budget=budget_bytes, policy=timed, backend="cpu", bandwidth=bandwidth, model=model,
                                 audit=True, background_planning=background, quick_policy=quick) as rt:
                    got[way] = _train(cls, batch, seq, runtime=rt, model=model)
                policies[way] = timed
            else:
                got[way] = _train(cls, batch, seq, wrap=lambda: torch.autograd.graph.save_on_cpu(pin_memory=False))

        late = list(zip(lengths, got["runtime"], strict=True))[WARMUP:]
        per_round.append({
            # the median weighs every step alike, so the short steps, where the hooks' fixed cost
            # is largest, decide it; the total ratio weighs them by their time
            "ratio": _median_ratio(got["runtime"]), "total": _total_ratio(got["runtime"]),
            "static": _median_ratio(got["runtime-static"]), "static_total": _total_ratio(got["runtime-static"]),
            "soc": _median_ratio(got["save_on_cpu"]),
            # steps that copied at all: at one budget in bytes, long steps swap and the mean
            # length may not, so dynamic over static also prices the long steps' swapping
            "swapped": sum(r.copies > 0 for _, _, r in got["runtime"][WARMUP:]) / (steps - WARMUP),
            "static_swapped": sum(r.copies > 0 for _, _, r in got["runtime-static"][WARMUP:]) / (steps - WARMUP),
            "late": [(n, (dt, rep)) for n, (dt, _, rep) in late], "timed": policies["runtime"],
            "train_s": sum(dt for dt, _, _ in got["runtime"]),
            "train_late_s": sum(dt for dt, _, _ in got["runtime"][WARMUP:]),
            "plan_s": sum(r.planning_s for _, _, r in got["runtime"]),
            "plan_late_s": sum(r.planning_s for _, _, r in got["runtime"][WARMUP:]),
        })
    first = per_round[0]
    late, timed = first["late"], first["timed"]
    executed = [r for _, (_, r) in late if r.mode == "execute"]
    over = max(((r.measured_peak_bytes or 0) - r.budget_bytes) / r.budget_bytes
               for rd in per_round for _, (_, r) in rd["late"] if r.budget_bytes)

    def spread(key: str) -> dict:
        xs = [rd[key] for rd in per_round]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    over_static = [rd["ratio"] / rd["static"] for rd in per_round]
    total_over_static = [rd["total"] / rd["static_total"] for rd in per_round]
    return {
        "case": name, "budget": budget, "budget_bytes": budget_bytes, "longest": max(lengths), "steps": steps, "rounds": rounds, "distinct_lengths": len(set(lengths)),
        "mean_length": static_len,
        "executed_share": len(executed) / len(late),
        "predicted_share": sum(r.shape_predicted for r in executed) / len(late),
        "profiled_after_warmup": sum(r.mode == "profile" for _, (_, r) in late),
        "diverged": sum(r.mode == "diverged" for _, (_, r) in late),
        "step_over_plain": spread("ratio"), "static_over_plain": spread("static"),
        "over_static": {"median": statistics.median(over_static), "min": min(over_static), "max": max(over_static)},
        "mean_step_over_plain": spread("total"), "static_mean_step_over_plain": spread("static_total"),
        "mean_over_static": {"median": statistics.median(total_over_static), "min": min(total_over_static),
                             "max": max(total_over_static)},
        "save_on_cpu_over_plain": spread("soc"),
        "swapped_share": spread("swapped"), "static_swapped_share": spread("static_swapped"),
        "worst_over_budget": over,
        # on the path: what the runtime's reports say it spent planning on the loop's thread (the
        # policy there, and its own layouts of new and predicted shapes)
        "planning_on_path_s": statistics.median(rd["plan_s"] for rd in per_round),
        "policy_on_path_s": statistics.median(rd["timed"].on_path_s for rd in per_round),
        "planning_background_s": statistics.median(rd["timed"].background_s for rd in per_round),
        "planning_share": statistics.median(rd["plan_s"] / rd["train_s"] for rd in per_round),
        "planning_after_warmup_s": statistics.median(rd["plan_late_s"] for rd in per_round),
        "planning_share_after_warmup": statistics.median(rd["plan_late_s"] / rd["train_late_s"] for rd in per_round),
        "plans": timed.calls, "summary": str(late[-1][1][1].run),
        # executed steps after the warm-up by the plan they ran: borrowed from a size near them, the
        # learned planner's (made on the loop's thread), the policy's searched one
        "plan_sources": {src: sum(r.mode == "execute" and r.plan_source == src for _, (_, r) in late)
                         for src in ("borrowed", "learned", "searched")},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--budgets", default="50%,70%,90%")
    ap.add_argument("--bandwidth", type=float, default=1e9)
    ap.add_argument("--policy", default="min")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the three ways, each round in shuffled order")
    ap.add_argument("--no-background", action="store_true", help="plan new shapes between steps, not on a thread")
    ap.add_argument("--out", default="bench_results/dynamic.json")
    args = ap.parse_args()
    if args.steps < 10:
        ap.error("--steps must be at least 10 (5 warm-up steps are left out)")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; choose from {', '.join(CASES)}")
    from tqdm import tqdm

    work = [(c, b.strip()) for c in cases for b in args.budgets.split(",")]
    rows = [run_case(c, b, args.steps, args.bandwidth, args.policy, args.seed, args.rounds, not args.no_background)
            for c, b in tqdm(work, desc="cases", file=sys.stderr)]

    def rng(x: dict) -> str:
        return f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})"

    print(table(["case", "budget", "lengths", "executed", "of which predicted", "profiled", "diverged", "step/plain",
                 "static/plain", "dynamic/static", "total: dynamic/static", "swapped steps (static)", "save_on_cpu/plain*",
                 "worst over budget", "planning on path", "after step 5", "ran on: borrowed/learned/searched"],
                [[r["case"], r["budget"], r["distinct_lengths"], f"{100 * r['executed_share']:.0f}%",
                  f"{100 * r['predicted_share']:.0f}%", r["profiled_after_warmup"], r["diverged"],
                  rng(r["step_over_plain"]), rng(r["static_over_plain"]), rng(r["over_static"]),
                  rng(r["mean_over_static"]),
                  f"{100 * r['swapped_share']['median']:.0f}% ({100 * r['static_swapped_share']['median']:.0f}%)",
                  rng(r["save_on_cpu_over_plain"]), f"{100 * r['worst_over_budget']:+.1f}%",
                  f"{r['planning_on_path_s']:.2f} s ({100 * r['planning_share']:.1f}%)",
                  f"{r['planning_after_warmup_s']:.2f} s ({100 * r['planning_share_after_warmup']:.1f}%)",
                  "/".join(str(r["plan_sources"][s]) for s in ("borrowed", "learned", "searched"))] for r in rows]))
    print("* save_on_cpu copies by plain memcpy here, not over the throttled link: not comparable on time")
    print("ratios: each step over the plain step beside it; median over the steps after the first five, then median "
          "(range) over the rounds; total: time after the first five over plain's, dynamic over static")
    write(args.out, {"args": vars(args), "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
