#!/usr/bin/env python
"""Recompute in real training: a zoo model under the runtime, step by step, beside a plain copy.

    python scripts/check_recompute_live.py gpt --policy checkpoint-all --budget 70% [--bandwidth 4e9] [--steps 10]

Per step: the mode, whether the loss and every gradient equal the plain copy's bit for bit, the
blocks run under torch.utils.checkpoint, the runtime's accounted peak and the audit meter's
measured peak against the budget, and the predicted and measured step. Dropout masks are drawn
from the same seed for both copies. Not a benchmark (the step times are one run's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table  # noqa: E402

from swapsched.deploy import SwapRuntime  # noqa: E402
from swapsched.zoo import build_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a zoo family: gpt, resnet, mlp, ...")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--policy", default="checkpoint-all")
    ap.add_argument("--budget", default="70%")
    ap.add_argument("--bandwidth", type=float, default=4e9, help="the CPU backend's link, bytes/s")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    a, b = build_model(args.model, args.size, seed=1), build_model(args.model, args.size, seed=1)
    opts = [torch.optim.SGD(m.model.parameters(), lr=0.01) for m in (a, b)]
    rows = []
    with SwapRuntime(budget=args.budget, policy=args.policy, model=a.model, backend="cpu", bandwidth=args.bandwidth,
                     audit=True) as rt:
        for i in range(args.steps):
            torch.manual_seed(i)
            with rt.step():
                la = a.loss()
                la.backward()
            torch.manual_seed(i)
            lb = b.loss()
            lb.backward()
            same = torch.equal(la, lb) and all(torch.equal(p.grad, q.grad)
                                               for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
            r = rt.report()
            rows.append([i, r.mode, "yes" if same else "NO", f"{len(r.recomputed_blocks)} ({len(r.selective_blocks)})",
                         r.peak_device_bytes if r.peak_device_bytes is not None else "-",
                         r.measured_peak_bytes if r.measured_peak_bytes is not None else "-",
                         r.budget_bytes if r.budget_bytes is not None else "-",
                         f"{1e3 * r.predicted_step_s:.2f}" if r.predicted_step_s is not None else "-", f"{1e3 * r.step_s:.2f}"])
            for o in opts:
                o.step()
                o.zero_grad()
    print(table(["step", "mode", "identical", "recomputed blocks (selectively)", "accounted peak B", "measured peak B", "budget B",
                 "predicted ms", "measured ms"], rows))
    return 0 if all(r[2] == "yes" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
