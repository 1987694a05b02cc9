#!/usr/bin/env python
"""Live runtime cost: hook overhead per saved tensor, step overhead with nothing evicted (target
<= 3% on the CPU backend), and the measured step time of each policy at budgets 30-80%.

    python scripts/bench_runtime.py [--backend cpu|cuda] [--model gpt --size small] [--steps 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table, write  # noqa: E402

from swapsched.run import run_runtime  # noqa: E402
from swapsched.runtime.swapper import SwapRuntime  # noqa: E402
from swapsched.zoo import build_model  # noqa: E402


def overhead_nothing_evicted(model: str, size: str, backend: str, steps: int, repeats: int) -> dict:
    """Alternate plain and runtime steps (same model, same batch) so drift hits both alike."""
    device = "cuda" if backend == "cuda" else "cpu"
    case = build_model(model, size, device=device)
    rt = SwapRuntime(budget="100%", policy="no-swap", backend=backend, model=case.model)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(rt.profile_steps + 2):
        with rt.step():
            case.loss().backward()
    plain, swapped = [], []
    for _ in range(repeats):
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            case.loss().backward()
            sync()
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with rt.step():
                case.loss().backward()
            sync()
            swapped.append(time.perf_counter() - t0)
            case.model.zero_grad(set_to_none=True)
    rep = rt.report()
    rt.close()
    p, s = statistics.median(plain), statistics.median(swapped)
    n = rt.trace.n_events
    return {"model": f"{model}-{size}", "events": n, "plain_ms": 1e3 * p, "runtime_ms": 1e3 * s,
            "overhead": s / p - 1.0, "hook_us_per_event": 1e6 * (s - p) / n, "evicted_bytes": rep.evicted_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--bandwidth", type=float, default=2e9, help="CPU backend throttle, bytes/s (default 2e9)")
    ap.add_argument("--budgets", default="30%,50%,80%")
    ap.add_argument("--policies", default="swap-all,vdnn-all,min,capuchin,default")
    ap.add_argument("--out", default="bench_results/runtime.json")
    args = ap.parse_args()

    over = [overhead_nothing_evicted(m, s, args.backend, 15, 3) for m, s in ((args.model, args.size), ("resnet", "small"))]
    print("nothing evicted (budget 100%, plan no-swap), medians of alternating steps:")
    print(table(["model", "events", "plain ms", "runtime ms", "overhead", "hook us/event", "target"],
                [[o["model"], o["events"], f"{o['plain_ms']:.2f}", f"{o['runtime_ms']:.2f}", f"{100 * o['overhead']:+.1f}%",
                  f"{o['hook_us_per_event']:.1f}", "<= 3%"] for o in over]))
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
