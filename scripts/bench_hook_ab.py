#!/usr/bin/env python
"""The runtime's own time in its hooks, one checkout against another, in shuffled paired rounds.

    git worktree add /tmp/old <rev>
    python scripts/bench_hook_ab.py /tmp/old . [--rounds 8] [--model gpt --size tiny] [--out bench_results/hook_ab.json]

Each round runs both checkouts (in random order, each in a fresh process with one torch thread):
a model trained 40 steps under ``SwapRuntime(budget="60%", policy="min", backend="cpu")``, and the
median of ``report().hook_s`` over its steps 11-40 (the hooks' time, waits left out). Reported: each
checkout's median over rounds and the per-round ratio B / A (median, min, max). Run it alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table, write  # noqa: E402

STEP = """
import json, statistics, torch
torch.set_num_threads(1)
from swapsched.deploy import SwapRuntime
from swapsched.zoo import build_model
case = build_model({model!r}, {size!r}, seed=0)
opt = torch.optim.SGD(case.model.parameters(), lr=1e-3)
hooks = []
with SwapRuntime(budget="60%", policy="min", backend="cpu", model=case.model, background_planning=False) as rt:
    for i in range(40):
        with rt.step():
            case.loss().backward()
        opt.step(); opt.zero_grad()
        if i >= 10:
            hooks.append(rt.report().hook_s or 0.0)
print(json.dumps(statistics.median(hooks)))
"""


def hook_s(checkout: Path, model: str, size: str) -> float:
    """The median hook time per step of one fresh process running ``checkout``'s swapsched."""
    out = subprocess.run([sys.executable, "-c", STEP.format(model=model, size=size)], cwd=checkout, check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"})
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="the checkout compared against (e.g. a worktree of an older commit)")
    ap.add_argument("b", type=Path, help="the checkout measured")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_results/hook_ab.json")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rounds = []
    for r in range(args.rounds):
        order = ["a", "b"]
        rng.shuffle(order)
        got = {side: hook_s(getattr(args, side).resolve(), args.model, args.size) for side in order}
        rounds.append(got)
        print(f"round {r + 1}: {order[0]} first, a {1e3 * got['a']:.3f} ms, b {1e3 * got['b']:.3f} ms", file=sys.stderr)
    ratios = [x["b"] / x["a"] for x in rounds]
    summary = {"a_median_ms": 1e3 * statistics.median(x["a"] for x in rounds),
               "b_median_ms": 1e3 * statistics.median(x["b"] for x in rounds),
               "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    print(table(["A median ms", "B median ms", "B / A median", "min", "max"],
                [[f"{summary['a_median_ms']:.3f}", f"{summary['b_median_ms']:.3f}", f"{summary['ratio_median']:.3f}",
                  f"{summary['ratio_min']:.3f}", f"{summary['ratio_max']:.3f}"]]))
    write(args.out, {"a": str(args.a), "b": str(args.b), "model": args.model, "size": args.size, "rounds": rounds,
                     "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
