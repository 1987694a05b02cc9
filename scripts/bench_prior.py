#!/usr/bin/env python
"""Does the learned move prior ever make the search worse than the unguided one?

    python scripts/bench_prior.py [--budgets 30%,50%,70%,80%,90%,95%] [--hardware a100-pcie4,h100-pcie5,gh200-c2c]
                                  [--swap] [--no-outside-zoo] [--out bench_results/prior.json]

The cases of ``bench_policy.py`` (the corpus's held-out split and, unless ``--no-outside-zoo``, the
four architectures outside the zoo): per case ``default`` with its move prior and
``default-unguided``, the same planner in the same time with moves drawn uniformly (``--swap``:
``default-swap`` against ``default-swap-unguided`` as well). Reported: the guided over the unguided
step time (geometric mean, worst, best) and the cases where guided is worse by more than 0.1%.
Both searches are time-boxed, so a case can differ by the machine's noise; run it alone.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import geomean, table, write  # noqa: E402

from swapsched.agents.evaluate import feasible_cases  # noqa: E402
from swapsched.agents.learned import LearnedPolicy  # noqa: E402
from swapsched.env.corpus import load_corpus  # noqa: E402
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="30%,50%,70%,80%,90%,95%")
    ap.add_argument("--hardware", default="a100-pcie4,h100-pcie5,gh200-c2c")
    ap.add_argument("--swap", action="store_true", help="also compare the swap-only planners")
    ap.add_argument("--no-outside-zoo", action="store_true", help="leave out scripts/_outside_zoo.py's architectures")
    ap.add_argument("--out", default="bench_results/prior.json")
    args = ap.parse_args()
    traces = load_corpus(split="test")
    if not args.no_outside_zoo:
        from _outside_zoo import outside_zoo_traces

        traces.extend(outside_zoo_traces())
    hws = [load_hardware(h) for h in args.hardware.split(",")]
    pairs = [(LearnedPolicy("default", mode="search"), LearnedPolicy("default", mode="search", guided=False))]
    if args.swap:
        pairs.append((LearnedPolicy("default", mode="search", recompute=False),
                      LearnedPolicy("default", mode="search", recompute=False, guided=False)))
    rows = []
    for tr, b, budget, hw in feasible_cases(traces, args.budgets.split(","), hws):
        for guided, unguided in pairs:
            a = simulate(tr, guided.plan(tr, budget, hw), hw, budget)
            u = simulate(tr, unguided.plan(tr, budget, hw), hw, budget)
            rows.append({"trace": tr.name, "budget": b, "hardware": hw.name, "planner": guided.name,
                         "guided_s": a.iteration_s, "unguided_s": u.iteration_s, "oom": a.oom or u.oom})
            print(f"{tr.name:28s} {b:>4} {hw.name:11s} {guided.name}: {a.iteration_s / u.iteration_s:.4f}", flush=True)
    summary = []
    for guided, _ in pairs:
        rs = [r for r in rows if r["planner"] == guided.name and not r["oom"]]
        ratios = [r["guided_s"] / r["unguided_s"] for r in rs]
        worse = [r for r, x in zip(rs, ratios, strict=True) if x > 1.001]
        summary.append({"planner": guided.name, "cases": len(rs),
                        "geomean": geomean(ratios),
                        "worst": max(ratios, default=math.nan), "best": min(ratios, default=math.nan),
                        "worse_by_more_than_0.1%": [(r["trace"], r["budget"], r["hardware"], r["guided_s"] / r["unguided_s"])
                                                    for r in worse]})
    print()
    print("guided (the move prior) over unguided (uniform moves), same planner and planning time")
    print(table(["planner", "cases", "geomean", "worst", "best", "worse > 0.1%"],
                [[s["planner"], s["cases"], f"{s['geomean']:.4f}", f"{s['worst']:.4f}", f"{s['best']:.4f}",
                  len(s["worse_by_more_than_0.1%"])] for s in summary]))
    for s in summary:
        for t, b, h, x in s["worse_by_more_than_0.1%"]:
            print(f"  {s['planner']}: {t} {b} {h}: {x:.4f}")
    write(args.out, {"summary": summary, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
