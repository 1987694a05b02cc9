#!/usr/bin/env python
"""Simulator and environment speed on the largest corpus trace (issue: simulate >= 200,000 events/s,
SwapEnv.step with masked random actions >= 20,000 steps/s).

    python scripts/bench_sim.py [--seconds 3] [--out bench_results/sim.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table, write  # noqa: E402

from swapsched.agents import Capuchin, SwapAll  # noqa: E402
from swapsched.budget import parse_budget  # noqa: E402
from swapsched.env.corpus import load_corpus  # noqa: E402
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.env.swap_env import SwapEnv  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402


def timed(fn, seconds: float) -> tuple[int, float]:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += fn()
    return n, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default="bench_results/sim.json")
    args = ap.parse_args()
    tr = max(load_corpus(), key=lambda t: t.n_events)
    hw = load_hardware("h100-pcie5")
    budget = parse_budget("50%", tr)
    rows, results = [], {}
    for name, plan in (("no evictions", []), ("swap-all", SwapAll().plan(tr, budget, hw)),
                       ("capuchin", Capuchin().plan(tr, budget, hw))):
        b = budget if plan else tr.peak_bytes_no_swap
        n, dt = timed(lambda plan=plan, b=b: (simulate(tr, plan, hw, b, validate=False), tr.n_events)[1], args.seconds)
        results[f"simulate/{name}"] = n / dt
        rows.append([f"simulate ({name})", f"{n / dt:,.0f} events/s", "200,000", "yes" if n / dt >= 2e5 else "NO"])
    env = SwapEnv(traces=[tr], hardware=[hw])
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    choices = [np.flatnonzero(m) for m in (np.ones(7, bool),)]

    def episode_steps() -> int:
        n = 0
        done = False
        while not done:
            m = env.action_masks()
            valid = np.flatnonzero(m) if not m.all() else choices[0]
            _, _, term, trunc, _ = env.step(int(valid[rng.integers(len(valid))]))
            n += 1
            done = term or trunc
        env.reset()
        return n

    n, dt = timed(episode_steps, args.seconds)
    results["env_steps_per_s"] = n / dt
    rows.append(["SwapEnv.step + action_masks", f"{n / dt:,.0f} steps/s", "20,000", "yes" if n / dt >= 2e4 else "NO"])
    print(f"largest corpus trace: {tr.name} ({tr.n_tensors} tensors, {tr.n_events} events)")
    print(table(["what", "measured", "target", "met"], rows))
    write(args.out, {"trace": tr.name, "events": tr.n_events, "tensors": tr.n_tensors, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
