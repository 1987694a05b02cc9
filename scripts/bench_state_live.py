"""The whole training state moved in real training (R13-R17), on the CPU backend: ``default``
against the state offloaders' placements, each executed by the runtime, and the plain loop.

A GPT of the zoo (``--size 100m``: 12 layers, width 768, about 93M parameters) trains with AdamW
and gradient clipping at a byte budget of half its static bytes (parameters, gradients, AdamW
state) plus its activation floor (the smallest budget the activations alone need above the
static bytes), as ``swapsched profile --optimizer adamw`` measures them. Methods, each on its own
copy of the model from one seed, stepped in shuffled interleaved rounds:

- ``plain``: no runtime (it does not fit the budget: the reference for losses and time);
- ``default``: the state placed jointly with the activations;
- ``zero-offload``, ``fsdp-offload``, ``ao-offload``: ZeRO-Offload's, FSDP2 CPUOffloadPolicy's
  and torchao CPUOffloadOptimizer's placements (agents/state_search.PEERS), executed by the
  runtime: their own code offloads from a CUDA device and does not run on this machine.

Rounds alternate: in the even ones every runtime runs with its audit meter on (``audit=True``),
which measures what the device holds, in the odd ones with it off, and only those are timed (the
meter's dispatch mode slows every op). Per method: the median iteration (forward, backward,
clipping and ``optimizer.step()``) over plain's in the same timed rounds (median, low and high
round), the largest peak under the runtime's accounting on executed steps and under the audit
meter on the audited ones, against the budget, whether every loss, parameter and AdamW moment
equals plain's bit for bit, and the simulator's predicted step against the measured iteration.

    python scripts/bench_state_live.py --out bench_results/state_live.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table, write  # noqa: E402

from swapsched.budget import format_bytes  # noqa: E402
from swapsched.deploy import SwapRuntime  # noqa: E402
from swapsched.runtime.profiler import profile  # noqa: E402
from swapsched.zoo import ModelCase, build_model  # noqa: E402

PEERS = ("zero-offload", "fsdp-offload", "ao-offload")


class Method:
    def __init__(self, name: str, case: ModelCase, runtime: SwapRuntime | None, opt: torch.optim.Optimizer):
        self.name, self.case, self.runtime, self.opt = name, case, runtime, opt
        self.losses: list[float] = []
        self.times: list[list[float]] = []  # the timed rounds' (audit meter off)
        self.reports: list[tuple[bool, Any]] = []  # (audited, report) per step

    def step(self, audit: bool) -> float:
        if self.runtime is not None:
            self.runtime.audit = audit
        t0 = time.perf_counter()
        if self.runtime is not None:
            with self.runtime.step():
                loss = self.case.loss()
                loss.backward()
        else:
            loss = self.case.loss()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.case.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        self.losses.append(loss.item())
        if self.runtime is not None:
            self.reports.append((audit, self.runtime.report()))
        return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100m", help="zoo GPT size (default 100m)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds, every other one audited and the rest timed (default 10)")
    ap.add_argument("--round-steps", type=int, default=5, help="steps per method per round (default 5: 50 steps in all)")
    ap.add_argument("--bandwidth", type=float, default=None, help="throttle the emulated link, bytes/s (default: unthrottled)")
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu", help="cuda: real copies, peaks by the runtime and torch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_results/state_live.json")
    args = ap.parse_args()

    device = "cuda" if args.backend == "cuda" else "cpu"
    probe = build_model("gpt", args.size, seed=args.seed, device=device)
    trace = profile(probe.model, probe.inputs, probe.loss_fn, name=f"gpt-{args.size}", state="adamw")
    floor = trace.min_feasible_bytes - trace.static_bytes
    budget = trace.static_bytes // 2 + floor
    params = sum(p.numel() for p in probe.model.parameters())
    del probe
    print(f"gpt-{args.size}: {params / 1e6:.1f}M parameters, static {format_bytes(trace.static_bytes)}, activation floor "
          f"{format_bytes(floor)}, budget {format_bytes(budget)} ({budget} B)", file=sys.stderr)

    def method(name: str, policy: str | None) -> Method:
        case = build_model("gpt", args.size, seed=args.seed, device=device)
        opt = torch.optim.AdamW(case.model.parameters(), lr=1e-4)
        rt = None if policy is None else SwapRuntime(budget=budget, policy=policy, model=case.model, optimizer=opt,
                                                     backend=args.backend, bandwidth=args.bandwidth)
        return Method(name, case, rt, opt)

    methods = [method("plain", None), method("default", "default"), *(method(p, p) for p in PEERS)]
    rng = random.Random(args.seed)
    try:
        for r in range(args.rounds):
            order = list(methods)
            rng.shuffle(order)
            audited = r % 2 == 0  # the first round, audited, holds the profiling steps: never timed
            for m in order:
                times = [m.step(audited) for _ in range(args.round_steps)]
                if not audited:
                    m.times.append(times)
            print(f"round {r + 1}/{args.rounds}{' (audited)' if audited else ''}: "
                  + ("" if audited else ", ".join(f"{m.name} {statistics.median(m.times[-1]):.2f} s" for m in methods)),
                  file=sys.stderr)
        # what a user reads after training: parameters and AdamW's moments, the state back on the device
        finals = {}
        for m in methods:
            if m.runtime is not None:
                m.runtime.close()
            finals[m.name] = ([p.detach().clone() for p in m.case.model.parameters()],
                              [v.clone() for p in m.case.model.parameters() for v in m.opt.state[p].values()])
    finally:
        for m in methods:
            if m.runtime is not None:
                m.runtime.close()
    plain = methods[0]
    rows, out_rows = [], []
    for m in methods:
        ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(m.times, plain.times, strict=True)]
        executed = [r for _, r in m.reports if r.mode == "execute"]
        audited = [r for a, r in m.reports if a and r.mode == "execute"]
        same = m.losses == plain.losses and all(torch.equal(a, b) for a, b in zip(finals[m.name][0], finals["plain"][0], strict=True)) \
            and all(torch.equal(a, b) for a, b in zip(finals[m.name][1], finals["plain"][1], strict=True))
        peak = max((r.peak_device_bytes or 0) for r in executed) if executed else None
        measured = max((r.measured_peak_bytes or 0) for r in audited) if audited else None
        within = (all((r.peak_device_bytes or 0) <= budget for r in executed)
                  and all((r.measured_peak_bytes or 0) <= budget for r in audited)) if executed else None
        iters = [t for ts in m.times for t in ts]
        pred = executed[-1].predicted_step_s if executed else None
        last = executed[-1].state if executed else None
        rec = {"method": m.name, "ratio": statistics.median(ratios), "ratio_low": min(ratios), "ratio_high": max(ratios),
               "iteration_s": statistics.median(iters), "bit_identical": same, "executed_steps": len(executed),
               "audited_steps": len(audited),
               "peak_bytes": peak, "measured_peak_bytes": measured, "within_budget_every_step": within,
               "predicted_s": pred, "placements": list(last.placements) if last else None,
               "host_stepped": len(last.host_stepped) if last else None}
        out_rows.append(rec)
        rows.append([m.name, f"{rec['ratio']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})", f"{rec['iteration_s']:.2f}",
                     "-" if pred is None else f"{pred:.2f} ({pred / rec['iteration_s']:.2f}x)",
                     "-" if peak is None else format_bytes(peak), "-" if measured is None else format_bytes(measured),
                     "-" if within is None else ("yes" if within else "NO"), "yes" if same else "NO",
                     "-" if last is None else f"{len(last.placements)} moved, {len(last.host_stepped)} on host"])
    print(table(["method", "iteration / plain", "s", "predicted s", "peak", "audit peak", "within budget", "bit-identical",
                 "state"], rows))
    write(args.out, {"model": f"gpt-{args.size}", "parameters": params, "budget_bytes": budget,
                     "static_bytes": trace.static_bytes, "activation_floor_bytes": floor, "rounds": args.rounds,
                     "round_steps": args.round_steps, "bandwidth": args.bandwidth, "rows": out_rows})


if __name__ == "__main__":
    main()
