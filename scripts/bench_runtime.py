#!/usr/bin/env python
"""Live runtime cost: hook overhead per saved tensor, step overhead with nothing evicted (target
<= 3% on the CPU backend), and the measured step time of each policy at budgets 30-80%.

    python scripts/bench_runtime.py [--backend cpu|cuda] [--model gpt --size small] [--steps 12] [--rounds 40]
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

from swapsched.deploy import SwapRuntime  # noqa: E402
from swapsched.run import run_runtime  # noqa: E402
from swapsched.zoo import build_model  # noqa: E402


class _Held:
    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t


def overhead_nothing_evicted(model: str, size: str, backend: str, rounds: int) -> dict:
    """Step time with nothing evicted against plain training, against identity saved-tensor hooks
    (PyTorch's own cost of calling Python hooks at all: the floor any hook-based runtime pays) and
    against hooks that hold each tensor in a Python object (the floor of any runtime that keeps
    per-tensor state). The three run in a shuffled order each round, and each round's ratios are taken
    against that round's plain step, so the machine's drift hits all three alike; the median and
    quartiles of the ratios are reported."""
    device = "cuda" if backend == "cuda" else "cpu"
    case = build_model(model, size, device=device)
    rt = SwapRuntime(budget="100%", policy="no-swap", backend=backend, model=case.model)
    # the same runtime with its hooks kept on every step: what the runtime cost before a plan
    # that moves nothing ran without hooks
    kept = SwapRuntime(budget="100%", policy="no-swap", backend=backend, model=case.model, unhook=False)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def plain() -> None:
        case.loss().backward()

    def identity_hooks() -> None:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            case.loss().backward()

    def wrapper_hooks() -> None:  # what holding each saved tensor in a Python object adds
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(t.detach()), lambda h: h.t):
            case.loss().backward()

    def runtime() -> None:
        with rt.step():
            case.loss().backward()

    def runtime_hooks_kept() -> None:
        with kept.step():
            case.loss().backward()

    from swapsched.runtime.swapper import UNHOOK_AFTER

    for _ in range(rt.profile_steps + rt.retime_steps + UNHOOK_AFTER + 1):  # to its unhooked steps
        runtime()
        runtime_hooks_kept()
        case.model.zero_grad(set_to_none=True)
    variants = {"plain": plain, "identity hooks": identity_hooks, "wrapper hooks": wrapper_hooks, "runtime": runtime,
                "runtime, hooks kept": runtime_hooks_kept}
    times: dict[str, list[float]] = {k: [] for k in variants}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for k in order:
            sync()
            t0 = time.perf_counter()
            variants[k]()
            sync()
            times[k].append(time.perf_counter() - t0)
            case.model.zero_grad(set_to_none=True)
    rep = rt.report()
    rt.close()
    kept.close()

    def ratios(k: str) -> tuple[float, float, float]:
        q = statistics.quantiles([a / b - 1.0 for a, b in zip(times[k], times["plain"], strict=False)], n=4)
        return q[1], q[0], q[2]

    n = rt.trace.n_events
    return {"model": f"{model}-{size}", "events": n, "rounds": rounds,
            "plain_ms": 1e3 * statistics.median(times["plain"]),
            "runtime_ms": 1e3 * statistics.median(times["runtime"]),
            "overhead": ratios("runtime")[0], "overhead_iqr": ratios("runtime")[1:],
            "identity_hooks_overhead": ratios("identity hooks")[0],
            "wrapper_hooks_overhead": ratios("wrapper hooks")[0],
            "hooks_kept_overhead": ratios("runtime, hooks kept")[0], "unhooked": rep.unhooked,
            "hook_python_us_per_call": _hook_python_us(rt_case=case, backend=backend),
            "evicted_bytes": rep.evicted_bytes, "plan_followed": rep.plan_followed}


def _hook_python_us(rt_case, backend: str) -> float:
    """The runtime's own Python per hook call: one step's pack/unpack calls recorded, then replayed
    straight into the runtime's hooks outside autograd (warm caches, so a lower bound)."""
    # unhook=False: the hooks stay on every step (a plan that moves nothing would else take them off)
    rt = SwapRuntime(budget="100%", policy="no-swap", backend=backend, model=rt_case.model, unhook=False)
    for _ in range(rt.profile_steps):
        with rt.step():
            rt_case.loss().backward()
    calls: list[tuple[str, Any]] = []

    def pack(t: torch.Tensor) -> int:
        calls.append(("pack", t))
        return len(calls) - 1

    def unpack(k: int) -> torch.Tensor:
        calls.append(("unpack", k))
        return calls[k][1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        rt_case.loss().backward()
    rt_case.model.zero_grad(set_to_none=True)
    per_step = []
    for _ in range(50):
        with rt.step() as active:
            ex = active._exec
            packed: dict[int, Any] = {}
            t0 = time.perf_counter()
            for j, (kind, x) in enumerate(calls):
                if kind == "pack":
                    packed[j] = ex.pack(x)
                else:
                    ex.unpack(packed[x])
            per_step.append(time.perf_counter() - t0)
        assert rt.report().mode == "execute", "the replayed step must follow the trace"
    rt.close()
    return 1e6 * statistics.median(per_step) / len(calls)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=40, help="rounds of the nothing-evicted comparison")
    ap.add_argument("--bandwidth", type=float, default=2e9, help="CPU backend throttle, bytes/s (default 2e9)")
    ap.add_argument("--budgets", default="30%,50%,80%")
    ap.add_argument("--policies", default="swap-all,vdnn-all,min,capuchin,default")
    ap.add_argument("--out", default="bench_results/runtime.json")
    ap.add_argument("--nothing-evicted-only", action="store_true", help="only the nothing-evicted comparison")
    args = ap.parse_args()

    models = dict.fromkeys([(args.model, args.size), (args.model, "medium"), ("resnet", "small"), ("resnet", "medium")])
    over = [overhead_nothing_evicted(m, s, args.backend, args.rounds) for m, s in models]
    print("nothing evicted (budget 100%, plan no-swap): median over rounds of step / plain step - 1, [quartiles]")
    print(table(["model", "events", "plain ms", "runtime ms", "runtime overhead", "hooks kept", "identity hooks",
                 "wrapper hooks", "hook python us/call", "target"],
                [[o["model"], o["events"], f"{o['plain_ms']:.2f}", f"{o['runtime_ms']:.2f}",
                  f"{100 * o['overhead']:+.1f}% [{100 * o['overhead_iqr'][0]:+.0f}, {100 * o['overhead_iqr'][1]:+.0f}]",
                  f"{100 * o['hooks_kept_overhead']:+.1f}%",
                  f"{100 * o['identity_hooks_overhead']:+.1f}%", f"{100 * o['wrapper_hooks_overhead']:+.1f}%",
                  f"{o['hook_python_us_per_call']:.2f}", "<= 3%"]
                 for o in over]))
    if args.nothing_evicted_only:
        write(args.out, {"nothing_evicted": over})
        return
    bw = args.bandwidth if args.backend == "cpu" else None
    rows, runs = [], []
    for budget in args.budgets.split(","):
        for pol in args.policies.split(","):
            r = run_runtime(args.model, pol, budget, args.steps, size=args.size, backend=args.backend, bandwidth=bw)
            runs.append({"budget": budget, "policy": pol, **{k: v for k, v in r.to_dict().items() if k not in ("extra", "step_s")}})
            rows.append([budget, pol, f"{1e3 * r.step_s_median:.2f}",
                         f"{1e3 * r.predicted_step_s:.2f}" if r.predicted_step_s else "-",
                         f"{r.peak_device_bytes / 2**20:.2f}", f"{r.budget_bytes / 2**20:.2f}", "yes" if r.loss_matches else "NO"])
    print(f"\n{args.model}-{args.size} on the {args.backend} backend" + (f", link {bw:.2g} B/s" if bw else ""))
    print(table(["budget", "policy", "step ms", "predicted ms", "peak MiB", "budget MiB", "loss matches"], rows))
    write(args.out, {"backend": args.backend, "bandwidth": bw, "nothing_evicted": over, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
