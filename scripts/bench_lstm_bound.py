#!/usr/bin/env python
"""Is the joint floor loose, or do the planners miss? The LSTM LM outside the zoo, with optimal's proven bound.

    python scripts/bench_lstm_bound.py [--budgets 50%] [--hardware h100-pcie5] [--seconds 120]
                                       [--out bench_results/lstm_bound.json]

For each budget and hardware: ``optimal`` given ``--seconds`` (its best plan and the lower bound it
proves, ``agents/optimal.py``), ``default``, and R8's joint floor, each as step over the ideal step.
Run it alone: optimal and default are time-boxed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table, write  # noqa: E402
from _outside_zoo import outside_zoo_traces  # noqa: E402

from swapsched.agents.registry import get_policy  # noqa: E402
from swapsched.budget import parse_budget, smallest_feasible  # noqa: E402
from swapsched.env.floors import joint_floor  # noqa: E402
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="50%")
    ap.add_argument("--hardware", default="h100-pcie5")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--out", default="bench_results/lstm_bound.json")
    args = ap.parse_args()
    tr = outside_zoo_traces(["lstm-lm-4x1024-b64-s64"])[0]
    rows = []
    for name in args.hardware.split(","):
        hw = load_hardware(name)
        for b in args.budgets.split(","):
            budget = parse_budget(b, tr)
            t0 = time.perf_counter()
            plan = get_policy(f"optimal:{args.seconds:g}s").plan(tr, budget, hw)
            best = simulate(tr, plan, hw, budget)
            default = simulate(tr, get_policy("default").plan(tr, budget, hw), hw, budget)
            ideal = best.ideal_s
            rows.append({"hardware": name, "budget": b, "optimal": best.iteration_s / ideal, "status": plan.meta.get("status"),
                         "bound": plan.meta["bound_s"] / ideal, "default": default.iteration_s / ideal,
                         "joint_floor": joint_floor(tr, budget, hw) / ideal, "seconds": time.perf_counter() - t0})
    write(args.out, {"trace": tr.name, "tensors": tr.n_tensors, "smallest_feasible_pct": smallest_feasible(tr)[1], "rows": rows})
    print(table(["hardware", "budget", "optimal", "status", "proven bound", "default", "joint floor"],
                [[r["hardware"], r["budget"], f"{r['optimal']:.4f}", r["status"], f"{r['bound']:.4f}", f"{r['default']:.4f}",
                  f"{r['joint_floor']:.4f}"] for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
