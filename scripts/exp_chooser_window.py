#!/usr/bin/env python
"""Experiment (issue 36): does the block chooser choose better with a feature that says how much of
the overshoot whole tensors can carry in their own idle window?

The chooser's features see the link against the whole backward pass
(``h2d * backward_compute_s / over``), so a case whose overshoot is one tensor made at the end of
forward and read at the start of backward (an LM's vocabulary logits) looks swappable when it is
not: on the LSTM LM outside the zoo at 50% on gh200-c2c it chose to recompute nothing and took
1.71x ``default``'s step. The new feature, ``window_share``: the bytes of tensors whose round trip
(out, then back in, each with its copy latency) fits between their release and their first unpack,
over the overshoot.

This script collects the chooser's training data once (as ``train_search`` does: the train and
generated splits less the validation families, the default config's hardware, cases and seed),
fits the chooser with the current features and with the new one added (the same seed and steps),
and compares ``default-greedy`` with each on the held-out split and the architectures outside the
zoo (budgets x hardware), over the best single technique on each case. Nothing shipped changes.

    python scripts/exp_chooser_window.py [--cases-per-trace 60] [--out bench_results/exp_chooser_window.json]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from swapsched.agents import blocks  # noqa: E402
from swapsched.agents.registry import get_policy  # noqa: E402
from swapsched.agents.scoring import training_cases  # noqa: E402
from swapsched.agents.train import load_train_config  # noqa: E402
from swapsched.budget import BudgetError, parse_budget  # noqa: E402
from swapsched.env.corpus import corpus_index, load_corpus  # noqa: E402
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.hardware import Hardware, load_hardware  # noqa: E402
from swapsched.jsonfile import write_json  # noqa: E402
from swapsched.trace import Trace  # noqa: E402

TECHNIQUES = ("min", "capuchin", "capuchin-swap", "checkpoint-all", "checkpoint-selective", "vdnn-all")
BUDGETS = ("30%", "50%", "70%", "90%")
HARDWARE = ("a100-pcie4", "h100-pcie5", "gh200-c2c")


def window_share(trace: Trace, budget: int, hardware: Hardware) -> float:
    """The bytes of tensors whose round trip fits in their idle window, over the overshoot, capped at 4, over 4."""
    demand = trace.static_bytes + trace.other_bytes + trace.resident_bytes_no_swap
    over = max(float(demand.max()) - budget, 1.0)
    done = np.cumsum(trace.gaps)  # the compute finished by each event's hook
    b = trace.tensor_bytes.astype(np.float64)
    window = done[trace.first_unpack] - done[trace.release]
    trip = b / hardware.link_bytes_per_s("d2h") + b / hardware.link_bytes_per_s("h2d") + 2 * hardware.copy_latency_s
    return min(float(b[window >= trip].sum()) / over, 4.0) / 4.0


def features_with_window(trace: Trace, budget: int, hardware: Hardware) -> np.ndarray:
    return np.append(ORIGINAL(trace, budget, hardware), window_share(trace, budget, hardware))


ORIGINAL = blocks.features


def cases(traces: list[Trace]) -> list[tuple[Trace, str, int, Hardware]]:
    out = []
    for tr in traces:
        for b in BUDGETS:
            try:
                budget = parse_budget(b, tr)
            except BudgetError:
                continue
            out += [(tr, b, budget, load_hardware(h)) for h in HARDWARE]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases-per-trace", type=int, default=60)
    ap.add_argument("--out", default="bench_results/exp_chooser_window.json")
    args = ap.parse_args()
    config = load_train_config(Path(__file__).resolve().parent.parent / "swapsched/configs/train/default.yaml")
    family = {r["name"]: r["family"] for r in corpus_index()}
    traces = [t for split in (config.corpus_split, *config.search_extra_splits) for t in load_corpus(split=split)
              if family.get(t.name) not in config.validation_families]
    hws = [load_hardware(h) for h in config.hardware]
    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed + 2)
    x_old, x_new, costs = [], [], []
    for tr, hw, budget in training_cases([tr for tr in traces if tr.segments], hws, rng,
                                         cases_per_trace=args.cases_per_trace, budget_range=config.budget_range,
                                         progress=True, desc="chooser data"):
        c = blocks.choice_costs(tr, budget, hw)
        if c.min() < blocks.OOM_COST:
            x_old.append(ORIGINAL(tr, budget, hw))
            x_new.append(features_with_window(tr, budget, hw))
            costs.append(c)
    collect_s = time.perf_counter() - t0
    old = blocks.fit(np.stack(x_old), np.stack(costs), hidden=config.blocks_hidden, seed=config.seed)
    new = blocks.fit(np.stack(x_new), np.stack(costs), hidden=config.blocks_hidden, seed=config.seed)
    print(f"collected {len(costs)} cases in {collect_s:.0f} s; fitted both", file=sys.stderr)

    from _outside_zoo import outside_zoo_traces

    sets = {"held-out": load_corpus(split="test"), "outside-zoo": outside_zoo_traces()}
    rows = []
    greedy = get_policy("default-greedy")
    for set_name, trs in sets.items():
        for tr, b, budget, hw in cases(trs):
            row = {"set": set_name, "trace": tr.name, "budget": b, "hardware": hw.name}
            steps = [simulate(tr, get_policy(p).plan(tr, budget, hw), hw, budget) for p in TECHNIQUES]
            fits = [r.iteration_s for r in steps if not r.oom]
            if not fits:
                continue
            row["best_technique_s"] = min(fits)
            for label, chooser, feats in (("current", old, ORIGINAL), ("window", new, features_with_window)):
                blocks.features = feats  # the chooser reads the module's features
                greedy._chooser = chooser
                r = simulate(tr, greedy.plan(tr, budget, hw), hw, budget)
                row[label] = math.inf if r.oom else r.iteration_s
            blocks.features = ORIGINAL
            rows.append(row)
            print(f"{set_name:11s} {tr.name:28s} {b:>4} {hw.name:11s} current={row['current'] / row['best_technique_s']:.3f} "
                  f"window={row['window'] / row['best_technique_s']:.3f}", flush=True)

    def geo(xs: list[float]) -> float:
        return float(np.exp(np.mean(np.log(xs))))

    summary = {}
    for set_name in sets:
        sub = [r for r in rows if r["set"] == set_name]
        summary[set_name] = {label: {"geomean": geo([r[label] / r["best_technique_s"] for r in sub]),
                                     "worst": max(r[label] / r["best_technique_s"] for r in sub), "cases": len(sub)}
                             for label in ("current", "window")}
    print("\n| set | chooser | greedy / best technique (geomean) | worst | cases |\n| --- | --- | --- | --- | --- |")
    for set_name, by in summary.items():
        for label, s in by.items():
            print(f"| {set_name} | {label} | {s['geomean']:.4f} | {s['worst']:.3f} | {s['cases']} |")
    write_json({"collect_s": collect_s, "training_cases": len(costs), "summary": summary, "rows": rows}, args.out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
