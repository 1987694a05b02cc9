#!/usr/bin/env python
"""Does the simulator predict the live runtime? Predicted vs measured step time per model x budget x policy.

    python scripts/bench_sim2real.py [--quick] [--backend cpu|cuda] [--bandwidth 1e9] [--out bench_results/sim2real.json]

On the CPU backend the copy engines are throttled (default 1 GB/s) so copies and compute are of
comparable length. The link and the per-event hook cost are first measured (swapsched calibrate);
each run profiles its own trace; the prediction is ``simulate(trace, plan, calibrated hardware)``.
Targets: median absolute error <= 10% of the step, worst <= 25%, same policy ranking per case.
``--quick``: one small model at two budgets; the last line is the median absolute error (fraction).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table, write  # noqa: E402

from swapsched.budget import BudgetError  # noqa: E402
from swapsched.run import run_runtime  # noqa: E402
from swapsched.runtime.calibrate import calibrate  # noqa: E402

FULL_MODELS = [("gpt", "small"), ("resnet", "small"), ("vgg", "small"), ("unet", "small")]
FULL_BUDGETS = ["30%", "50%", "80%"]
POLICIES = ["swap-all", "vdnn-all", "min", "capuchin", "default"]


def kendall_agree(pred: list[float], meas: list[float]) -> float:
    """Fraction of policy pairs ordered the same way by prediction and measurement."""
    pairs = agree = 0
    for i in range(len(pred)):
        for j in range(i + 1, len(pred)):
            pairs += 1
            agree += (pred[i] - pred[j]) * (meas[i] - meas[j]) >= 0
    return agree / pairs if pairs else 1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bandwidth", type=float, default=1e9, help="CPU backend: copy-engine throttle, bytes/s")
    ap.add_argument("--steps", type=int, default=9, help="steps per run (3 profiled, the rest measured)")
    ap.add_argument("--out", default="bench_results/sim2real.json")
    args = ap.parse_args()
    bw = args.bandwidth if args.backend == "cpu" else None
    cal = calibrate(args.backend, bandwidth=bw)
    hw_path = Path(tempfile.mkdtemp()) / "calibrated.yaml"
    cal.hardware.save(hw_path)
    print(f"calibrated {args.backend}: d2h {cal.hardware.d2h_bytes_per_s / 1e9:.3f} GB/s, h2d "
          f"{cal.hardware.h2d_bytes_per_s / 1e9:.3f} GB/s, latency {1e6 * cal.hardware.copy_latency_s:.0f} us, "
          f"hook {1e6 * cal.hardware.hook_cost_s:.1f} us/event", file=sys.stderr)
    models = [("gpt", "tiny")] if args.quick else FULL_MODELS
    budgets = ["50%", "80%"] if args.quick else FULL_BUDGETS
    policies = ["swap-all", "capuchin"] if args.quick else POLICIES
    rows, runs = [], []
    for model, size in models:
        for budget in budgets:
            case = []
            for pol in policies:
                try:
                    r = run_runtime(model, pol, budget, args.steps, size=size, backend=args.backend, bandwidth=bw,
                                    hardware=str(hw_path))
                except BudgetError as exc:
                    print(f"skip {model}-{size} {budget}: {exc}", file=sys.stderr)
                    break
                err = None if r.predicted_step_s is None else abs(r.predicted_step_s - r.step_s_median) / r.step_s_median
                run = {"model": f"{model}-{size}", "budget": budget, "policy": pol, "measured_s": r.step_s_median,
                       "predicted_s": r.predicted_step_s, "abs_error": err, "stall_s": r.stall_s,
                       "peak_device_bytes": r.peak_device_bytes, "budget_bytes": r.budget_bytes,
                       "loss_matches": r.loss_matches, "plan_followed": r.plan_followed}
                runs.append(run)
                case.append(run)
                rows.append([f"{model}-{size}", budget, pol, f"{1e3 * r.step_s_median:.2f}",
                             "OOM" if r.predicted_step_s is None else f"{1e3 * r.predicted_step_s:.2f}",
                             "-" if err is None else f"{100 * err:.1f}%"])
            ok = [c for c in case if c["predicted_s"] is not None]
            if len(ok) >= 2:
                for c in case:
                    c["rank_agreement"] = kendall_agree([c["predicted_s"] for c in ok], [c["measured_s"] for c in ok])
    errors = [r["abs_error"] for r in runs if r["abs_error"] is not None]
    agreements = {(r["model"], r["budget"]): r.get("rank_agreement") for r in runs if r.get("rank_agreement") is not None}
    summary = {
        "runs": len(runs), "median_abs_error": statistics.median(errors) if errors else None,
        "worst_abs_error": max(errors) if errors else None,
        "cases_ranked_identically": sum(1 for v in agreements.values() if v == 1.0), "cases": len(agreements),
        "mean_pair_agreement": statistics.mean(agreements.values()) if agreements else None,
    }
    print(table(["model", "budget", "policy", "measured ms", "predicted ms", "|error|"], rows))
    print(f"median |error| {100 * summary['median_abs_error']:.1f}% (target <= 10%), worst "
          f"{100 * summary['worst_abs_error']:.1f}% (target <= 25%); policy order identical in "
          f"{summary['cases_ranked_identically']}/{summary['cases']} cases, pairs agreeing "
          f"{100 * (summary['mean_pair_agreement'] or 0):.0f}%")
    write(args.out, {"backend": args.backend, "bandwidth": bw, "calibrated": cal.hardware.to_dict(),
                     "summary": summary, "runs": runs})
    print(f"{summary['median_abs_error']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
