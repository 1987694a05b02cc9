"""Is the budget real? Every zoo family x policy x budget on the CPU backend: the runtime's
accounted peak beside two meters, against the budget. ``audit`` is the runtime's own
(``SwapRuntime(audit=True)``: the transient meter over each executing step, every storage an op
makes, plus the state and the model's static bytes); ``device`` is ``swapsched run --compare``'s
independent meter (``device_meter.DeviceMeter``: every storage any op makes in the step, whoever holds it,
plus the caller's batch, made before the step). Both see what backward holds beyond the saved
tensors (R3). Each meter's figure is its largest over the executed steps. Writes JSON and prints
a table; exits 1 if the device meter is over the budget by more than ``--tolerance`` anywhere.

    python scripts/bench_budget_audit.py [--families mlp,gpt] [--policies min,capuchin]
        [--budgets 30%,50%,70%,90%] [--size tiny] [--steps 8] [--tolerance 0.02]
        [--out bench_results/budget_audit.json]
"""

from __future__ import annotations

import argparse
import sys

import torch
from _bench import table, write
from tqdm import tqdm

from swapsched.budget import BudgetError, format_bytes
from swapsched.deploy import SwapRuntime
from swapsched.device_meter import DeviceMeter
from swapsched.zoo import build_model


def run_case(family: str, size: str, policy: str, budget: str, steps: int) -> dict:
    case = build_model(family, size, seed=1)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.01)
    meter = DeviceMeter(case.model, opt, "cpu")
    batch = sum(x.untyped_storage().nbytes() for x in case.inputs if isinstance(x, torch.Tensor))
    rt = SwapRuntime(budget=budget, policy=policy, backend="cpu", bandwidth=4e9, model=case.model, audit=True)
    device_peak = 0
    try:
        for _ in range(steps):
            with meter.step(), rt.step():
                case.loss().backward()
            if rt.report().mode != "profile":
                device_peak = max(device_peak, meter.peak + batch)
            opt.step()
            opt.zero_grad()
    except BudgetError as exc:
        return {"family": family, "policy": policy, "budget": budget, "infeasible": str(exc)}
    finally:
        rt.close()
    r = rt.report()
    return {"family": family, "policy": policy, "budget": budget, "mode": r.mode, "budget_bytes": r.budget_bytes,
            "accounted_peak_bytes": r.run.peak_device_bytes if r.run is not None else r.peak_device_bytes,
            "audit_peak_bytes": r.measured_peak_bytes, "device_peak_bytes": device_peak,
            "device_over": device_peak / r.budget_bytes - 1,
            "audit_over": (r.measured_peak_bytes or 0) / r.budget_bytes - 1, "unowned_bytes": r.unowned_bytes,
            "guard_evictions": r.guard_evictions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="mlp,vgg,resnet,gpt,bert,unet")
    ap.add_argument("--policies", default="swap-all,vdnn-all,min,capuchin,default")
    ap.add_argument("--budgets", default="30%,50%,70%,90%")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tolerance", type=float, default=0.02, help="how far over the budget the device meter may be")
    ap.add_argument("--out", default="bench_results/budget_audit.json")
    a = ap.parse_args(argv)
    grid = [(f, p, b) for f in a.families.split(",") for p in a.policies.split(",") for b in a.budgets.split(",")]
    rows = [run_case(f, a.size, p, b, a.steps) for f, p, b in tqdm(grid, desc="cases", file=sys.stderr)]
    write(a.out, {"size": a.size, "steps": a.steps, "cases": rows})
    ran = [r for r in rows if "infeasible" not in r]
    print(table(["family", "policy", "budget", "budget B", "accounted", "audit", "device meter", "audit over", "device over",
                 "unowned"],
                [[r["family"], r["policy"], r["budget"], *(format_bytes(r[k]) if "infeasible" not in r else "-"
                  for k in ("budget_bytes", "accounted_peak_bytes", "audit_peak_bytes", "device_peak_bytes")),
                  *(("infeasible", "-") if "infeasible" in r else (f"{r['audit_over']:+.1%}", f"{r['device_over']:+.1%}")),
                  format_bytes(r["unowned_bytes"]) if "infeasible" not in r else "-"] for r in rows]))
    over = [r for r in ran if r["device_over"] > a.tolerance]
    worst = max((r["device_over"] for r in ran), default=0.0)
    worst_audit = max((r["audit_over"] for r in ran), default=0.0)
    print(f"{len(ran)} cases ran, {len(rows) - len(ran)} budgets below the smallest feasible one; the device meter "
          f"over the budget by more than {a.tolerance:.0%} in {len(over)} (worst {worst:+.1%}; the audit meter's "
          f"worst {worst_audit:+.1%})")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
