"""Does a long run stay flat? Thousands of training steps of one model under the runtime on the CPU
backend, with the optimizer: at every step boundary the accounted device bytes (zero between steps),
the host pool's size and idle bytes, the process RSS and the thread count. Writes JSON and prints a
table every ``--every`` steps; exits 1 if anything grew.

    python scripts/soak.py [--model mlp] [--size tiny] [--policy capuchin] [--budget 60%]
        [--steps 2000] [--every 250] [--out bench_results/soak.json]

Flat means: the accounting back at zero and every host buffer back in the pool after every step,
and from step 100 on (profiling, re-timing and re-planning long done) the same pool size, the same
thread count, and RSS at the end within ``--rss-slack`` (default 1 MiB) of RSS at step 100.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import torch
from _bench import table, write

from swapsched.budget import format_bytes
from swapsched.deploy import SwapRuntime
from swapsched.zoo import build_model


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(model: str, size: str, policy: str, budget: str, steps: int, every: int) -> dict:
    case = build_model(model, size, seed=0)
    opt = torch.optim.SGD(case.model.parameters(), lr=1e-3)
    rt = SwapRuntime(budget=budget, policy=policy, backend="cpu", bandwidth=4e9, model=case.model)
    pool = rt.backend.pool
    rows, problems = [], []
    pool_size = threads = rss_100 = None
    try:
        for i in range(1, steps + 1):
            with rt.step():
                ex = rt._exec
                case.loss().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rep = rt.report()
            used = getattr(ex, "used", 0)  # the executed step's accounting after it ended
            if used != 0:
                problems.append(f"step {i}: {used} bytes still accounted after the step")
            if pool.idle_bytes != pool.allocated_bytes:
                problems.append(f"step {i}: {pool.allocated_bytes - pool.idle_bytes} host bytes not back in the pool")
            # step 100 is the reference: profiling, re-timing and re-planning are long done
            if i == 100:
                pool_size, threads, rss_100 = pool.allocated_bytes, threading.active_count(), rss_bytes()
            elif i > 100 and pool.allocated_bytes != pool_size:
                problems.append(f"step {i}: host pool {pool.allocated_bytes} B, was {pool_size} B at step 100")
            elif i > 100 and threading.active_count() != threads:
                problems.append(f"step {i}: {threading.active_count()} threads, were {threads} at step 100")
            if i % every == 0 or i == steps:
                rows.append({"step": i, "mode": rep.mode, "step_ms": 1e3 * rep.step_s, "accounted_bytes": used,
                             "pool_bytes": pool.allocated_bytes, "pool_idle_bytes": pool.idle_bytes,
                             "rss_bytes": rss_bytes(), "threads": threading.active_count(),
                             "peak_bytes": rep.peak_device_bytes, "budget_bytes": rep.budget_bytes})
    finally:
        rt.close()
    return {"model": f"{model}-{size}", "policy": policy, "budget": budget, "steps": steps, "rows": rows,
            "rss_at_100_bytes": rss_100, "rss_at_end_bytes": rows[-1]["rss_bytes"], "problems": problems[:20],
            "n_problems": len(problems)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--policy", default="capuchin")
    ap.add_argument("--budget", default="60%")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--rss-slack", type=float, default=2**20, help="bytes RSS may move after step 100 (default 1 MiB)")
    ap.add_argument("--out", default="bench_results/soak.json")
    args = ap.parse_args(argv)
    if args.steps < 100:
        ap.error("--steps must be at least 100 (RSS is compared with step 100)")
    res = soak(args.model, args.size, args.policy, args.budget, args.steps, args.every)
    drift = res["rss_at_end_bytes"] - res["rss_at_100_bytes"]
    res["rss_drift_bytes"] = drift
    res["flat"] = res["n_problems"] == 0 and abs(drift) <= args.rss_slack
    print(table(["step", "mode", "ms", "accounted", "pool", "pool idle", "RSS", "threads"],
                [[r["step"], r["mode"], f"{r['step_ms']:.2f}", r["accounted_bytes"], format_bytes(r["pool_bytes"]),
                  format_bytes(r["pool_idle_bytes"]), format_bytes(r["rss_bytes"]), r["threads"]] for r in res["rows"]]))
    print(f"RSS {format_bytes(res['rss_at_100_bytes'])} at step 100, {format_bytes(res['rss_at_end_bytes'])} at step "
          f"{args.steps} (drift {drift / 2**20:+.2f} MiB); {res['n_problems']} problems; flat: {res['flat']}")
    for p in res["problems"]:
        print("  " + p)
    write(args.out, res)
    return 0 if res["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
