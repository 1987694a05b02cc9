"""Is the budget real? Every zoo family x policy x budget on the CPU backend with
``SwapRuntime(audit=True)``: the runtime's accounted peak beside the peak measured from the storages
themselves, against the budget. Writes JSON and prints a table.

    python scripts/bench_budget_audit.py [--families mlp,gpt] [--policies min,capuchin]
        [--budgets 30%,50%,70%,90%] [--size tiny] [--steps 8] [--out bench_results/budget_audit.json]
"""

from __future__ import annotations

import argparse
import sys

import torch
from _bench import table, write
from tqdm import tqdm

from swapsched.budget import BudgetError, format_bytes
from swapsched.deploy import SwapRuntime
from swapsched.zoo import build_model


def run_case(family: str, size: str, policy: str, budget: str, steps: int) -> dict:
    case = build_model(family, size, seed=1)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.01)
    rt = SwapRuntime(budget=budget, policy=policy, backend="cpu", bandwidth=4e9, model=case.model, audit=True)
    try:
        for _ in range(steps):
            with rt.step():
                case.loss().backward()
            opt.step()
            opt.zero_grad()
    except BudgetError as exc:
        return {"family": family, "policy": policy, "budget": budget, "infeasible": str(exc)}
    finally:
        rt.close()
    r = rt.report()
    return {"family": family, "policy": policy, "budget": budget, "mode": r.mode, "budget_bytes": r.budget_bytes,
            "accounted_peak_bytes": r.peak_device_bytes, "measured_peak_bytes": r.measured_peak_bytes,
            "unowned_bytes": r.unowned_bytes, "guard_evictions": r.guard_evictions,
            "within": r.measured_peak_bytes <= r.budget_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="mlp,vgg,resnet,gpt,bert,unet")
    ap.add_argument("--policies", default="swap-all,vdnn-all,min,capuchin,default")
    ap.add_argument("--budgets", default="30%,50%,70%,90%")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="bench_results/budget_audit.json")
    a = ap.parse_args(argv)
    grid = [(f, p, b) for f in a.families.split(",") for p in a.policies.split(",") for b in a.budgets.split(",")]
    rows = [run_case(f, a.size, p, b, a.steps) for f, p, b in tqdm(grid, desc="cases", file=sys.stderr)]
    write(a.out, {"size": a.size, "steps": a.steps, "cases": rows})
    ran = [r for r in rows if "infeasible" not in r]
    print(table(["family", "policy", "budget", "budget B", "accounted", "measured", "unowned", "within"],
                [[r["family"], r["policy"], r["budget"], *(format_bytes(r[k]) if "infeasible" not in r else "-"
                  for k in ("budget_bytes", "accounted_peak_bytes", "measured_peak_bytes", "unowned_bytes")),
                  "infeasible" if "infeasible" in r else ("yes" if r["within"] else "NO")] for r in rows]))
    over = [r for r in ran if not r["within"]]
    print(f"{len(ran)} cases ran, {len(rows) - len(ran)} budgets below the smallest feasible one; "
          f"measured peak over budget in {len(over)}")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
