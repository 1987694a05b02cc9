#!/usr/bin/env python
"""The corpus at budgets 30-90%: every planner against the exact reference (plan, proven bound, gap).

    python scripts/bench_baselines.py [--hardware h100-pcie5] [--optimal-seconds 60] [--search-seconds 1]
                                      [--policies min,capuchin,swapadvisor,default] [--out bench_results/baselines.json]

Per trace x budget x hardware: ``optimal``'s proven lower bound (``bound_s``), its plan's simulated
step and the gap between them, its solve time, and min, capuchin, swapadvisor and ``default``; then
the summary per policy, the held-out traces alone, and on random small traces the distance of every
policy to the exhaustive optimum.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
from _bench import table, write  # noqa: E402

from swapsched.agents.evaluate import compare, summarize  # noqa: E402
from swapsched.env.corpus import load_corpus  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402
from swapsched.report import format_summary  # noqa: E402


def small_traces(n: int, seed: int = 0) -> list:
    """Random traces of 3-5 tensors (forward packs, backward unpacks in reverse with repeats):
    small enough for the exact optimum, with gaps and sizes spread like the corpus' ratios."""
    from swapsched.trace import Event, TensorInfo, Trace

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(3, 6))
        sizes = (rng.lognormal(17, 1.0, k)).astype(int) + 1  # ~25 MB median
        fwd = [Event("pack", t, float(rng.uniform(1e-4, 2e-3))) for t in range(k)]
        bwd = [Event("unpack", t, float(rng.uniform(2e-4, 4e-3))) for t in reversed(range(k))]
        tensors = tuple(TensorInfo(t, int(b)) for t, b in enumerate(sizes))
        out.append(Trace(f"small-{i}", "measured", "synthetic", 0, 1e-4, tensors, tuple(fwd + bwd)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="30%,50%,70%,90%")
    ap.add_argument("--hardware", default="h100-pcie5")
    ap.add_argument("--optimal-seconds", type=float, default=60.0, help="time limit of optimal per case")
    ap.add_argument("--policies", default="min,capuchin,swapadvisor,default")
    ap.add_argument("--search-seconds", type=float, default=1.0)
    ap.add_argument("--split", choices=["all", "train", "test"], default="all")
    ap.add_argument("--small", type=int, default=40, help="random small traces for the distance to the exact optimum")
    ap.add_argument("--out", default="bench_results/baselines.json")
    args = ap.parse_args()
    traces = load_corpus(split=None if args.split == "all" else args.split)
    hws = [load_hardware(h) for h in args.hardware.split(",")]
    budgets = args.budgets.split(",")
    optimal = f"optimal:{args.optimal_seconds:g}s"
    policies = [*args.policies.split(","), optimal]
    rows = compare(traces, budgets, hws, policies, search_seconds=args.search_seconds)
    by = {(*r.case, r.policy): r for r in rows}
    ref_rows = []
    for r in rows:
        if r.policy != optimal or r.result is None:
            continue
        gap = (r.result.iteration_s - r.bound_s) / r.result.iteration_s
        cells = [r.trace, r.budget, r.hardware, f"{100 * r.floor_overhead:.1f}%", f"{100 * (r.bound_s / r.result.ideal_s - 1):.1f}%",
                 f"{100 * r.overhead:.1f}%", f"{100 * gap:.2f}%", f"{r.plan_s:.1f}"]
        for p in policies[:-1]:
            o = by.get((*r.case, p))
            cells.append("n/a" if o is None or o.overhead is None else f"{100 * o.overhead:.1f}%")
        ref_rows.append(cells)
    print(table(["trace", "budget", "hardware", "floor", "bound", "optimal", "gap", "solve s", *policies[:-1]], ref_rows))
    gaps = [(r.result.iteration_s - r.bound_s) / r.result.iteration_s for r in rows if r.policy == optimal and r.result]
    small_gaps = [g for g, r in zip(gaps, [r for r in rows if r.policy == optimal and r.result], strict=True)
                  if next(t for t in traces if t.name == r.trace).n_tensors <= 200]
    print(f"proven gap: median {100 * float(np.median(gaps)):.2f}%, max {100 * max(gaps):.2f}%; "
          f"<= 2% in {sum(g <= 0.02 for g in small_gaps)} of {len(small_gaps)} cases with <= 200 tensors")
    summary = summarize(rows, policies)
    print(f"{len(traces)} traces x {len(budgets)} budgets x {len(hws)} hardware = {len(traces) * len(budgets) * len(hws)} cases")
    print(format_summary(summary))
    held = {t.name for t in load_corpus(split="test")}
    held_rows = [r for r in rows if r.trace in held]
    held_summary = summarize(held_rows, policies)
    print("\nheld-out traces only (never seen by the learned policy):")
    print(format_summary(held_summary))
    # the yardstick: distance to the exact optimum on traces small enough to solve
    small = small_traces(args.small)
    small_rows = compare(small, ["40%", "60%", "80%"], hws[:1], policies, search_seconds=args.search_seconds)
    best = {(r.trace, r.budget): r.overhead for r in small_rows if r.policy == optimal and r.solved}
    gaps = []
    for p in policies:
        d = [r.overhead - best[(r.trace, r.budget)] for r in small_rows
             if r.policy == p and r.overhead is not None and (r.trace, r.budget) in best]
        ooms = sum(1 for r in small_rows if r.policy == p and r.oom)
        gaps.append({"policy": p, "mean_gap_to_optimal": float(np.mean(d)) if d else None,
                     "max_gap_to_optimal": float(np.max(d)) if d else None,
                     "optimal_in": int(sum(1 for x in d if x <= 1e-9)), "cases": len(best), "oom": ooms})
    print(f"\n{len(small)} random small traces x 3 budgets on {hws[0].name}: overhead above the exact optimum")
    print(table(["policy", "mean gap", "max gap", "optimal in", "OOM"],
                [[g["policy"], "-" if g["mean_gap_to_optimal"] is None else f"{100 * g['mean_gap_to_optimal']:.1f} pts",
                  "-" if g["max_gap_to_optimal"] is None else f"{100 * g['max_gap_to_optimal']:.1f} pts",
                  f"{g['optimal_in']}/{g['cases']}", g["oom"]] for g in gaps]))
    write(args.out, {"budgets": budgets, "hardware": [h.name for h in hws], "search_seconds": args.search_seconds,
                     "optimal_seconds": args.optimal_seconds, "summary": [s.to_dict() for s in summary], "held_out_summary": [s.to_dict() for s in held_summary],
                     "small_vs_optimal": gaps, "rows": [r.to_dict() for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
