#!/usr/bin/env python
"""Experiment (issue 36): how far the block chooser's choices reach, and how much one network's
choices vary with its seed against an ensemble's.

It collects the chooser's training data once as ``train_search`` does (the train and generated
splits less the validation families; the default config's hardware, cases and seed), fits one
network per seed, and then compares ``default-greedy`` with each network and with ensembles of
them. The cases are the held-out split and the architectures outside the zoo, at
30/50/70/90% on a100-pcie4, h100-pcie5 and gh200-c2c. Each is measured over ``default`` (the
searched planner, with the shipped checkpoint) and over the best single technique on the case.

It also reports the reach of the choice family: the best of the 49 choices per case (MIN around
the chosen blocks, before the editor) over ``default``. It shows that best for the first 25 alone,
the prefixes of the ranking that session 13 had, and for all 49, which add the variants without
the block forward runs last. The shipped chooser is not touched.

    python scripts/exp_chooser_members.py [--seeds 0,1,2,3,4] [--ensembles "0,1,2;1,2,3;0,1,2,3,4"]
                                          [--out bench_results/exp_chooser_members.json]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import geomean, table, write  # noqa: E402

from swapsched.agents import blocks  # noqa: E402
from swapsched.agents.evaluate import feasible_cases  # noqa: E402
from swapsched.agents.registry import get_policy  # noqa: E402
from swapsched.agents.train import load_train_config  # noqa: E402
from swapsched.env.corpus import corpus_index, load_corpus  # noqa: E402
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402

TECHNIQUES = ("min", "capuchin", "capuchin-swap", "checkpoint-all", "checkpoint-selective", "vdnn-all")
BUDGETS = ("30%", "50%", "70%", "90%")
HARDWARE = ("a100-pcie4", "h100-pcie5", "gh200-c2c")
PREFIX_CHOICES = 25  # session 13's family: none, then prefixes of the ranking in three ways


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--ensembles", default="0,1,2;1,2,3;0,1,2,3,4", help="semicolon-separated seed lists")
    ap.add_argument("--out", default="bench_results/exp_chooser_members.json")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    ensembles = [[int(s) for s in e.split(",")] for e in args.ensembles.split(";")]
    if any(s not in seeds for e in ensembles for s in e):
        ap.error("every ensemble's seeds must be among --seeds")
    config = load_train_config(Path(__file__).resolve().parent.parent / "swapsched/configs/train/default.yaml")
    family = {r["name"]: r["family"] for r in corpus_index()}
    traces = [t for split in (config.corpus_split, *config.search_extra_splits) for t in load_corpus(split=split)
              if family.get(t.name) not in config.validation_families]
    t0 = time.perf_counter()
    x, costs = blocks.collect(traces, [load_hardware(h) for h in config.hardware], cases_per_trace=config.blocks_cases_per_trace,
                              budget_range=config.budget_range, seed=config.seed + 2, progress=True)
    collect_s = time.perf_counter() - t0
    nets, fit_s = {}, {}
    for s in seeds:
        t0 = time.perf_counter()
        nets[s] = blocks.fit(x, costs, hidden=config.blocks_hidden, seed=s, members=1)
        fit_s[s] = time.perf_counter() - t0
    choosers = {f"seed {s}": nets[s] for s in seeds}
    for e in ensembles:
        choosers["ensemble " + ",".join(map(str, e))] = blocks.BlockChooser(
            tuple(np.concatenate(ws) for ws in zip(*(nets[s].weights for s in e), strict=True)), nets[e[0]].mean, nets[e[0]].std)
    print(f"collected {len(costs)} cases in {collect_s:.0f} s; one network fits in {np.mean(list(fit_s.values())):.0f} s",
          file=sys.stderr)

    from _outside_zoo import outside_zoo_traces

    searched, greedy = get_policy("default"), get_policy("default-greedy")
    rows = []
    for set_name, trs in (("held-out", load_corpus(split="test")), ("outside-zoo", outside_zoo_traces())):
        for tr, b, budget, hw in feasible_cases(trs, BUDGETS, [load_hardware(h) for h in HARDWARE]):
            fits = [r.iteration_s for r in (simulate(tr, get_policy(p).plan(tr, budget, hw), hw, budget) for p in TECHNIQUES)
                    if not r.oom]
            ref = simulate(tr, searched.plan(tr, budget, hw), hw, budget)
            if not fits or ref.oom:
                continue
            row = {"set": set_name, "trace": tr.name, "budget": b, "hardware": hw.name,
                   "best_technique_s": min(fits), "default_s": ref.iteration_s, "greedy_s": {}}
            if tr.segments:
                steps = [simulate(tr, blocks.joint_plan(tr, budget, hw, blocks.states_of(tr, c), "c"), hw, budget,
                                  validate=False) for c in range(len(blocks.CHOICES))]
                ok = [r.iteration_s if not r.oom else math.inf for r in steps]
                row["reach_25_s"], row["reach_49_s"] = min(ok[:PREFIX_CHOICES]), min(ok)
            for label, ch in choosers.items():
                greedy._chooser = ch
                r = simulate(tr, greedy.plan(tr, budget, hw), hw, budget)
                row["greedy_s"][label] = math.inf if r.oom else r.iteration_s
            rows.append(row)
            print(f"{set_name:11s} {tr.name:28s} {b:>4} {hw.name:11s} "
                  + " ".join(f"{k}={v / row['default_s']:.3f}" for k, v in row["greedy_s"].items()), flush=True)

    summary = []
    for label in choosers:
        entry = {"chooser": label}
        for set_name in ("held-out", "outside-zoo"):
            sub = [r for r in rows if r["set"] == set_name]
            over = [r["greedy_s"][label] / r["default_s"] for r in sub]
            entry[set_name] = {"over_default": geomean(over), "worst_over_default": max(over),
                               "over_best_technique": geomean([r["greedy_s"][label] / r["best_technique_s"] for r in sub]),
                               "cases": len(sub)}
        summary.append(entry)
    reach = {}
    for set_name in ("held-out", "outside-zoo"):
        sub = [r for r in rows if r["set"] == set_name and "reach_49_s" in r]
        reach[set_name] = {k: {"over_default": geomean([r[f"{k}_s"] / r["default_s"] for r in sub]),
                               "worst_over_default": max(r[f"{k}_s"] / r["default_s"] for r in sub), "cases": len(sub)}
                           for k in ("reach_25", "reach_49")}
    print()
    print(table(["chooser", "held-out / default", "worst", "/ best technique", "outside / default", "worst", "/ best technique"],
                [[s["chooser"], *(f"{s[k][m]:.4f}" for k in ("held-out", "outside-zoo")
                                  for m in ("over_default", "worst_over_default", "over_best_technique"))] for s in summary]))
    print()
    print(table(["family's reach (best choice per case, before the editor)", "held-out / default", "worst",
                 "outside / default", "worst"],
                [[k, *(f"{reach[s][k][m]:.4f}" for s in ("held-out", "outside-zoo") for m in ("over_default", "worst_over_default"))]
                 for k in ("reach_25", "reach_49")]))
    write(args.out, {"collect_s": collect_s, "fit_s": fit_s, "training_cases": len(costs), "summary": summary,
                     "reach": reach, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
