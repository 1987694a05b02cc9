#!/usr/bin/env python
"""The joint keep / swap / recompute planner against swap-only planning, checkpointing, Capuchin and the bound.

    python scripts/bench_policy.py [--budgets 30%,50%,70%,80%,90%,95%] [--hardware a100-pcie4,h100-pcie5,gh200-c2c]
                                   [--deep-layers 128] [--bound-seconds 5] [--outside-zoo [--no-corpus]]
                                   [--out bench_results/policy.json]

Cases: the corpus's held-out split (families the shipped policy never trained on, and sizes it never
saw) x budgets x hardware, plus one deep GPT profiled on meta (``--deep-layers`` blocks, over 2,000
saved tensors); ``--outside-zoo`` adds four architectures outside the zoo profiled on meta
(``scripts/_outside_zoo.py``). Per case: ``default`` (joint), ``default-swap`` (the same planner, swap only),
``default-greedy`` (the learned parts alone: the block chooser and the plan editor, no search), ``default-greedy-guarded``
(the same, then the best in simulation of it and a few cheap candidates), ``local-search`` (swap only, the planning time
``default-swap`` took), ``checkpoint-all``, ``checkpoint-selective``, ``capuchin`` (its hybrid) and ``capuchin-swap``, min,
vdnn-all, swapadvisor at 1 s, the joint floor and the proven joint bound (``agents/bound.py``).

The reference is the best *technique* on each case: the best of the swap-only plans (min,
capuchin-swap, vdnn-all, default-swap, local-search, swapadvisor), checkpoint-all, checkpoint-selective and capuchin's
hybrid. Reported: each planner's step time over that reference (geometric mean, per budget band and
per link kind, worst case), its OOMs and planning times; ``default`` against the bound; and the
swap-only comparison ``default-swap`` / ``local-search`` and / swapadvisor. Run it alone on the
machine: the searches are time-boxed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _bench import geomean, table, write  # noqa: E402

from swapsched.agents.bound import lower_bound  # noqa: E402
from swapsched.agents.evaluate import feasible_cases  # noqa: E402
from swapsched.agents.joint import LocalSearch  # noqa: E402
from swapsched.agents.registry import get_policy  # noqa: E402
from swapsched.env.corpus import load_corpus  # noqa: E402
from swapsched.env.floors import joint_floor  # noqa: E402
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402
from swapsched.trace import Trace  # noqa: E402

SWAP_ONLY = ["min", "capuchin-swap", "vdnn-all", "default-swap", "local-search", "swapadvisor-1s"]
TECHNIQUES = [*SWAP_ONLY, "checkpoint-all", "checkpoint-selective", "capuchin"]
PLANNERS = ["default", "default-swap", "default-greedy", "default-greedy-guarded", "local-search", "checkpoint-all", "checkpoint-selective", "capuchin",
            "capuchin-swap",
            "min", "vdnn-all", "swapadvisor-1s"]


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="30%,50%,70%,80%,90%,95%")
    ap.add_argument("--hardware", default="a100-pcie4,h100-pcie5,gh200-c2c")
    ap.add_argument("--deep-layers", type=int, default=128, help="blocks of the deep GPT (0: leave it out)")
    ap.add_argument("--bound-seconds", type=float, default=5.0)
    ap.add_argument("--traces", help="comma list of corpus names instead of the held-out split")
    ap.add_argument("--outside-zoo", action="store_true",
                    help="add the architectures outside the zoo (scripts/_outside_zoo.py), profiled on meta")
    ap.add_argument("--no-corpus", action="store_true", help="leave out the corpus traces (with --outside-zoo)")
    ap.add_argument("--out", default="bench_results/policy.json")
    args = ap.parse_args()
    traces = [] if args.no_corpus else load_corpus(names=args.traces.split(",")) if args.traces else load_corpus(split="test")
    if args.outside_zoo:
        from _outside_zoo import outside_zoo_traces

        traces.extend(outside_zoo_traces())
    if args.deep_layers:
        t0 = time.perf_counter()
        traces.append(deep_gpt_trace(args.deep_layers))
        print(f"profiled {traces[-1].name}: {traces[-1].n_tensors} saved tensors, {traces[-1].n_events} events "
              f"in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    hws = [load_hardware(h) for h in args.hardware.split(",")]
    budgets = args.budgets.split(",")
    pols = {n: get_policy(n) for n in PLANNERS if n not in ("local-search", "swapadvisor-1s")}
    pols["swapadvisor-1s"] = get_policy("swapadvisor", search_seconds=1.0)
    rows = []
    for tr, b, budget, hw in feasible_cases(traces, budgets, hws):
        row: dict = {"trace": tr.name, "tensors": tr.n_tensors, "blocks": len(tr.segments), "budget": b,
                     "hardware": hw.name, "ideal_s": tr.ideal_s, "step_s": {}, "plan_s": {}, "oom": {},
                     "recompute_s": {}, "moved_bytes": {}}
        for name in PLANNERS:
            # local-search gets the planning time default-swap took on this case
            pol = LocalSearch(search_seconds=row["plan_s"]["default-swap"]) if name == "local-search" else pols[name]
            t0 = time.perf_counter()
            plan = pol.plan(tr, budget, hw)
            row["plan_s"][name] = time.perf_counter() - t0
            r = simulate(tr, plan, hw, budget)
            row["step_s"][name], row["oom"][name] = r.iteration_s, r.oom
            row["recompute_s"][name], row["moved_bytes"][name] = r.recompute_s, r.d2h_bytes
        row["floor_s"] = joint_floor(tr, budget, hw)
        bd = lower_bound(tr, budget, hw, time_limit_s=args.bound_seconds)
        row["bound_s"], row["bound_status"], row["bound_solve_s"] = bd.bound_s, bd.status, bd.solve_s
        feasible = [row["step_s"][p] for p in TECHNIQUES if not row["oom"][p]]
        row["best_technique_s"] = min(feasible) if feasible else None
        rows.append(row)
        best = row["best_technique_s"]
        print(f"{tr.name:28s} {b:>4} {hw.name:11s} " + (" ".join(
            f"{p}={row['step_s'][p] / best:.3f}" if not row["oom"][p] else f"{p}=OOM"
            for p in PLANNERS) + f" bound={row['bound_s'] / best:.3f}" if best else "no technique fits"), flush=True)
    cols = [*PLANNERS, "floor", "bound"]

    def ratio(row: dict, p: str) -> float | None:
        best = row["best_technique_s"]
        if best is None:
            return None
        if p in ("floor", "bound"):
            return row[f"{p}_s"] / best
        if row["oom"][p]:
            return None
        return row["step_s"][p] / best

    def pcie(row: dict) -> bool:
        return "pcie" in row["hardware"]

    bands = {"all": lambda r: True, "30-70% PCIe": lambda r: float(r["budget"][:-1]) <= 70 and pcie(r),
             ">= 80%": lambda r: float(r["budget"][:-1]) >= 80, "PCIe": pcie, "C2C": lambda r: not pcie(r)}
    summary = []
    for p in cols:
        entry: dict = {"planner": p}
        for band, keep in bands.items():
            ok = [x for x in (ratio(r, p) for r in rows if keep(r)) if x is not None]
            entry[band] = geomean(ok)
            if band == "all":
                entry["worst"] = max(ok) if ok else math.nan
                entry["cases"] = len(ok)
                entry["oom"] = sum(1 for r in rows if p in r["oom"] and r["oom"][p])
        times = [r["plan_s"][p] for r in rows if p in r["plan_s"]]
        small = [r["plan_s"][p] for r in rows if p in r["plan_s"] and r["tensors"] <= 500]
        large = [r["plan_s"][p] for r in rows if p in r["plan_s"] and r["tensors"] > 2000]
        entry["plan_s_mean"] = sum(times) / len(times) if times else math.nan
        entry["plan_s_max_le500"] = max(small) if small else math.nan
        entry["plan_s_max_gt2000"] = max(large) if large else math.nan
        summary.append(entry)
    print()
    print(f"{len(rows)} cases; step time / the best technique on the case (best swap-only plan, checkpoint-all, checkpoint-selective, "
          "capuchin's hybrid), geometric mean")
    print(table(["planner", *bands, "worst", "cases", "OOM", "plan s (mean)", "max <=500 t", "max >2000 t"],
                [[s["planner"], *(f"{s[b]:.3f}" for b in bands), f"{s['worst']:.3f}", s["cases"], s["oom"],
                  f"{s['plan_s_mean']:.2f}", f"{s['plan_s_max_le500']:.2f}", f"{s['plan_s_max_gt2000']:.2f}"]
                 for s in summary]))

    def _spread(xs: list[float]) -> tuple[float, float, int]:
        return geomean(xs), max(xs, default=math.nan), len(xs)

    def over(a: str, b: str) -> tuple[float, float, int]:
        return _spread([r["step_s"][a] / r["step_s"][b] for r in rows if not r["oom"][a] and not r["oom"][b]])

    worse = [r for r in rows if r["best_technique_s"] and (r["oom"]["default"] or r["step_s"]["default"] > r["best_technique_s"] * (1 + 1e-9))]
    to_bound = [r["step_s"]["default"] / r["bound_s"] for r in rows if not r["oom"]["default"]]
    pairs = {"default / bound": (geomean(to_bound), max(to_bound, default=math.nan), len(to_bound)),
             "default-swap / local-search": over("default-swap", "local-search"),
             "default-swap / swapadvisor-1s": over("default-swap", "swapadvisor-1s"),
             "default-greedy / best swap-only": _spread([r["step_s"]["default-greedy"] / min(r["step_s"][p] for p in SWAP_ONLY if not r["oom"][p])
                                                         for r in rows if not r["oom"]["default-greedy"] and any(not r["oom"][p] for p in SWAP_ONLY)]),
             # the target for the learned part alone: within 2% of the best single technique
             "default-greedy / best technique": _spread([r["step_s"]["default-greedy"] / r["best_technique_s"] for r in rows
                                                         if not r["oom"]["default-greedy"] and r["best_technique_s"]]),
             # issue 36: the learned parts alone within 3% of default (geomean), none worse than 1.25x;
             # the guarded variant (best of cheap candidates in simulation) apart
             "default-greedy / default": over("default-greedy", "default"),
             "default-greedy-guarded / default": over("default-greedy-guarded", "default"),
             "default-greedy-guarded / best technique": _spread([r["step_s"]["default-greedy-guarded"] / r["best_technique_s"]
                                                                 for r in rows if not r["oom"]["default-greedy-guarded"]
                                                                 and r["best_technique_s"]])}
    print()
    print(table(["ratio", "geomean", "worst", "cases"], [[k, f"{g:.4f}", f"{w:.4f}", n] for k, (g, w, n) in pairs.items()]))
    print(f"cases where default is worse than the best technique: {len(worse)}"
          + "".join(f"\n  {r['trace']} {r['budget']} {r['hardware']}: {r['step_s']['default'] / r['best_technique_s']:.4f}" for r in worse))
    write(args.out, {"budgets": budgets, "hardware": [h.name for h in hws], "traces": [t.name for t in traces],
                     "summary": summary, "ratios": {k: {"geomean": g, "worst": w, "cases": n} for k, (g, w, n) in pairs.items()},
                     "default_worse_than_best_technique": [(r["trace"], r["budget"], r["hardware"]) for r in worse],
                     "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
