#!/usr/bin/env python
"""Every policy on the corpus at budgets 30-90% on two hardware profiles: overhead, OOMs, planning time.

    python scripts/bench_baselines.py [--hardware h100-pcie5,a100-pcie4] [--search-seconds 1] [--out bench_results/baselines.json]

This table is the bar the learned policy must clear; the README quotes its summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import write  # noqa: E402

from swapsched.agents.registry import policy_names  # noqa: E402
from swapsched.compare import compare, format_summary, summarize  # noqa: E402
from swapsched.env.corpus import load_corpus  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="30%,50%,70%,90%")
    ap.add_argument("--hardware", default="h100-pcie5,a100-pcie4")
    ap.add_argument("--search-seconds", type=float, default=1.0)
    ap.add_argument("--split", choices=["all", "train", "test"], default="all")
    ap.add_argument("--out", default="bench_results/baselines.json")
    args = ap.parse_args()
    traces = load_corpus(split=None if args.split == "all" else args.split)
    hws = [load_hardware(h) for h in args.hardware.split(",")]
    budgets = args.budgets.split(",")
    policies = policy_names()
    rows = compare(traces, budgets, hws, policies, search_seconds=args.search_seconds)
    summary = summarize(rows, policies)
    print(f"{len(traces)} traces x {len(budgets)} budgets x {len(hws)} hardware = {len(traces) * len(budgets) * len(hws)} cases")
    print(format_summary(summary))
    held = {t.name for t in load_corpus(split="test")}
    held_rows = [r for r in rows if r["trace"] in held]
    held_summary = summarize(held_rows, policies)
    print("\nheld-out traces only (never seen by the learned policy):")
    print(format_summary(held_summary))
    write(args.out, {"budgets": budgets, "hardware": [h.name for h in hws], "search_seconds": args.search_seconds,
                     "summary": summary, "held_out_summary": held_summary, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
