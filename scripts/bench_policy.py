#!/usr/bin/env python
"""The learned planner against the heuristics, the local search, the genetic search and the bound.

    python scripts/bench_policy.py [--budgets 30%,50%,70%,80%,90%,95%] [--hardware a100-pcie4,h100-pcie5,gh200-c2c]
                                   [--long-search 30] [--long-cases 12] [--deep-layers 128] [--out bench_results/policy.json]

Cases: the corpus's held-out split (families the shipped policy never trained on, and sizes it never
saw) x budgets x hardware, plus one deep GPT profiled on meta (``--deep-layers`` blocks, over 2,000
saved tensors). Per case: ``default`` (network + search), ``default-greedy`` (the plan editor alone), ``default-ppo`` (the PPO policy alone),
``local-search`` (same planning time as ``default``), min, capuchin, vdnn-all, swapadvisor at 1 s,
swapadvisor at ``--long-search`` s on the first ``--long-cases`` cases, the R8 floor and the proven
bound (``agents/bound.py``). Reported: the geometric mean of each planner's step time over the best
single-pass heuristic's (min, capuchin, vdnn-all), overall, per budget band and worst case; OOMs;
planning times. Run it alone on the machine: the searches are time-boxed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _bench import table, write  # noqa: E402

from swapsched.agents.bound import lower_bound  # noqa: E402
from swapsched.agents.registry import get_policy  # noqa: E402
from swapsched.budget import BudgetError, parse_budget  # noqa: E402
from swapsched.env.corpus import load_corpus  # noqa: E402
from swapsched.env.simulator import analytic_floor, simulate  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402
from swapsched.trace import Trace  # noqa: E402

SINGLE_PASS = ["min", "capuchin", "vdnn-all"]
PLANNERS = ["default", "default-greedy", "default-ppo", "local-search", "min", "capuchin", "vdnn-all", "swapadvisor-1s"]


def deep_gpt_trace(layers: int) -> Trace:
    """A GPT of ``layers`` blocks (d_model 1024, seq 1024, batch 8) profiled on meta, roofline-timed."""
    from swapsched.runtime.profiler import profile
    from swapsched.zoo import Transformer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(50304, 1024, layers, 1024, 16, causal=True)
        x = torch.zeros(8, 1024, dtype=torch.long)
    tr = profile(model, (x,), lambda out: out.float().pow(2).mean(), device="meta", name=f"gpt-{layers}l-meta")
    return tr


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="30%,50%,70%,80%,90%,95%")
    ap.add_argument("--hardware", default="a100-pcie4,h100-pcie5,gh200-c2c")
    ap.add_argument("--long-search", type=float, default=30.0, help="seconds of the long swapadvisor run")
    ap.add_argument("--long-cases", type=int, default=12, help="cases that get the long swapadvisor run")
    ap.add_argument("--deep-layers", type=int, default=128, help="blocks of the deep GPT (0: leave it out)")
    ap.add_argument("--bound-seconds", type=float, default=10.0)
    ap.add_argument("--traces", help="comma list of corpus names instead of the held-out split")
    ap.add_argument("--out", default="bench_results/policy.json")
    args = ap.parse_args()
    traces = load_corpus(names=args.traces.split(",")) if args.traces else load_corpus(split="test")
    if args.deep_layers:
        t0 = time.perf_counter()
        traces.append(deep_gpt_trace(args.deep_layers))
        print(f"profiled {traces[-1].name}: {traces[-1].n_tensors} saved tensors, {traces[-1].n_events} events "
              f"in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    hws = [load_hardware(h) for h in args.hardware.split(",")]
    budgets = args.budgets.split(",")
    pols = {"default": get_policy("default"), "default-greedy": get_policy("default-greedy"), "default-ppo": get_policy("default-ppo"),
            "local-search": None, "min": get_policy("min"), "capuchin": get_policy("capuchin"),
            "vdnn-all": get_policy("vdnn-all"), "swapadvisor-1s": get_policy("swapadvisor", search_seconds=1.0)}
    rows = []
    n_case = 0
    for tr in traces:
        for b in budgets:
            try:
                budget = parse_budget(b, tr)
            except BudgetError:
                continue
            for hw in hws:
                row: dict = {"trace": tr.name, "tensors": tr.n_tensors, "budget": b, "hardware": hw.name,
                             "ideal_s": tr.ideal_s, "step_s": {}, "plan_s": {}, "oom": {}}
                for name in PLANNERS:
                    pol = pols[name]
                    if name == "local-search":  # the same planning time default took on this case
                        from swapsched.agents.local_search import LocalSearch

                        pol = LocalSearch(search_seconds=row["plan_s"]["default"])
                    t0 = time.perf_counter()
                    plan = pol.plan(tr, budget, hw)
                    row["plan_s"][name] = time.perf_counter() - t0
                    r = simulate(tr, plan, hw, budget)
                    row["step_s"][name] = r.iteration_s
                    row["oom"][name] = r.oom
                if n_case < args.long_cases:
                    t0 = time.perf_counter()
                    plan = get_policy("swapadvisor", search_seconds=args.long_search).plan(tr, budget, hw)
                    row["plan_s"]["swapadvisor-long"] = time.perf_counter() - t0
                    r = simulate(tr, plan, hw, budget)
                    row["step_s"]["swapadvisor-long"], row["oom"]["swapadvisor-long"] = r.iteration_s, r.oom
                row["floor_s"] = analytic_floor(tr, budget, hw)
                bd = lower_bound(tr, budget, hw, time_limit_s=args.bound_seconds)
                row["bound_s"], row["bound_status"], row["bound_solve_s"] = bd.bound_s, bd.status, bd.solve_s
                feasible = [row["step_s"][p] for p in SINGLE_PASS if not row["oom"][p]]
                row["best_single_pass_s"] = min(feasible) if feasible else None
                rows.append(row)
                n_case += 1
                best = row["best_single_pass_s"]
                print(f"{tr.name:28s} {b:>4} {hw.name:11s} " + " ".join(
                    f"{p}={row['step_s'][p] / best:.3f}" if best and not row["oom"][p] else f"{p}=OOM"
                    for p in PLANNERS) + f" bound={row['bound_s'] / best:.3f}" if best else "", flush=True)
    # ratios to the best single-pass heuristic
    cols = [*PLANNERS, "swapadvisor-long", "floor", "bound"]

    def ratio(row: dict, p: str) -> float | None:
        best = row["best_single_pass_s"]
        if best is None:
            return None
        if p in ("floor", "bound"):
            return row[f"{p}_s"] / best
        if p not in row["step_s"] or row["oom"][p]:
            return None
        return row["step_s"][p] / best

    bands = {"all": lambda b: True, "< 70%": lambda b: float(b[:-1]) < 70, ">= 70%": lambda b: float(b[:-1]) >= 70}
    summary = []
    for p in cols:
        entry: dict = {"planner": p}
        for band, keep in bands.items():
            rs = [ratio(r, p) for r in rows if keep(r["budget"])]
            ok = [x for x in rs if x is not None]
            entry[band] = geomean(ok)
            if band == "all":
                entry["worst"] = max(ok) if ok else math.nan
                entry["cases"] = len(ok)
                entry["oom"] = sum(1 for r in rows if p in r["oom"] and r["oom"][p])
        times = [r["plan_s"][p] for r in rows if p in r.get("plan_s", {})]
        small = [r["plan_s"][p] for r in rows if p in r.get("plan_s", {}) and r["tensors"] <= 500]
        large = [r["plan_s"][p] for r in rows if p in r.get("plan_s", {}) and r["tensors"] > 2000]
        entry["plan_s_mean"] = sum(times) / len(times) if times else math.nan
        entry["plan_s_max_le500"] = max(small) if small else math.nan
        entry["plan_s_max_gt2000"] = max(large) if large else math.nan
        summary.append(entry)
    print()
    print(f"{len(rows)} cases; step time / best single-pass heuristic (min, capuchin, vdnn-all), geometric mean")
    print(table(["planner", "all", "< 70%", ">= 70%", "worst", "cases", "OOM", "plan s (mean)", "max <=500 t", "max >2000 t"],
                [[s["planner"], f"{s['all']:.3f}", f"{s['< 70%']:.3f}", f"{s['>= 70%']:.3f}", f"{s['worst']:.3f}",
                  s["cases"], s["oom"], f"{s['plan_s_mean']:.2f}", f"{s['plan_s_max_le500']:.2f}",
                  f"{s['plan_s_max_gt2000']:.2f}"] for s in summary]))
    ls = [r["step_s"]["default"] / r["step_s"]["local-search"] for r in rows
          if not r["oom"]["default"] and not r["oom"]["local-search"]]
    print(f"default / local-search at the same planning time: geomean {geomean(ls):.4f} over {len(ls)} cases")
    write(args.out, {"budgets": budgets, "hardware": [h.name for h in hws], "traces": [t.name for t in traces],
                     "summary": summary, "default_over_local_search": geomean(ls), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
