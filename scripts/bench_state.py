"""The whole training state under one budget (R13-R16): ``default`` against the state offloaders
users run, on the simulator.

Each model is profiled on ``meta`` as ``swapsched profile MODEL --size full --device meta
--optimizer adamw`` would (bf16 autocast over fp32 weights, flash attention, batch 1; the state
per group: fp32 parameters, gradients and AdamW's two moments), retimed for each hardware. At
each byte budget (the whole device memory of the step, below the state's static bytes):

- ``default``: the state placed jointly with the activations (agents/state_search.py), its plan time;
- the peers, each with every block checkpointed: ``zero-offload`` (ZeRO-Offload), ``fsdp-offload``
  (FSDP2 CPUOffloadPolicy), ``ao-offload`` (torchao CPUOffloadOptimizer);
- the floor with the state movable (``state_floor``).

Per row: the step over the ideal step, bytes moved each way, the host's peak and its optimizer
time. Budgets a device cannot hold (above its memory) are left out. The summary is ``default``'s
step over the best peer's that fits (geometric mean, worst), and the cases where no peer fits.

    python scripts/bench_state.py --out bench_results/state.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import geomean, table, write  # noqa: E402

from swapsched.agents.registry import get_policy  # noqa: E402
from swapsched.agents.state_search import PEERS, state_floor  # noqa: E402
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402
from swapsched.precision import Precision  # noqa: E402
from swapsched.runtime.profiler import profile  # noqa: E402
from swapsched.zoo import build_model  # noqa: E402

GIB = 2**30
#: (model, size, sequence lengths, budgets in GiB)
CASES = {
    "llama": ("hf:llama", "full", (2048, 8192), (24, 40, 64)),
    "mixtral": ("hf:mixtral", "full", (2048,), (24, 40, 64)),
    "bert": ("hf:bert", "full", (512,), (1, 2, 4)),  # an encoder: 110M parameters, 1.6 GiB of state
}
HARDWARE = ("h100-pcie5", "rtx4090-pcie4", "gh200-c2c")


def state_trace(model: str, size: str, seq_len: int):
    case = build_model(model, size, batch_size=1, seq_len=seq_len, device="meta", attention="flash",
                       dtype=torch.float32)
    return profile(case.model, case.inputs, case.loss_fn, None, device="meta", name=f"{model}-{size}-{seq_len}",
                   precision=Precision("bf16", amp=True), attention="flash", hardware="h100-pcie5", state="adamw")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama,mixtral,bert", help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--hardware", default=",".join(HARDWARE))
    ap.add_argument("--out", default="bench_results/state.json")
    args = ap.parse_args()
    rows, records = [], []
    ratios: list[float] = []
    only_default = 0
    for key in args.models.split(","):
        model, size, lengths, budgets = CASES[key]
        for seq in lengths:
            t0 = time.perf_counter()
            base = state_trace(model, size, seq)
            print(f"{base.name}: profiled in {time.perf_counter() - t0:.1f} s, {base.n_tensors} tensors, "
                  f"state {base.static_bytes / GIB:.1f} GiB in {len(base.state)} groups", file=sys.stderr)
            for hw_name in args.hardware.split(","):
                hw = load_hardware(hw_name)
                # R19: the disk's peer only where a disk is (without one it is zero3-offload)
                peers = [p for p in PEERS if getattr(PEERS[p], "disk", None) is None or hw.has_disk]
                trace = base.retimed(hw)
                for gib in budgets:
                    budget = gib * GIB
                    if budget > hw.device_memory_bytes:
                        continue
                    if budget < trace.min_feasible_bytes_movable:
                        rows.append([trace.name, hw.name, f"{gib} GiB", "n/a: below the smallest feasible "
                                     f"({trace.min_feasible_bytes_movable / GIB:.1f} GiB)"])
                        continue
                    floor = state_floor(trace, budget, hw)
                    out: dict[str, dict] = {}
                    for name in ("default", *peers):
                        pol = get_policy(name)
                        t1 = time.perf_counter()
                        try:
                            plan = pol.plan(trace, budget, hw)
                        except Exception as exc:  # default refuses a budget no placement fits: recorded
                            out[name] = {"error": str(exc)}
                            continue
                        plan_s = time.perf_counter() - t1
                        r = simulate(trace, plan, hw, budget)
                        out[name] = {"step_s": None if r.oom else r.iteration_s, "plan_s": plan_s, "ideal_s": r.ideal_s,
                                     "d2h_bytes": r.d2h_bytes, "h2d_bytes": r.h2d_bytes, "host_peak_bytes": r.host_peak_bytes,
                                     "host_step_s": r.state.host_step_s if r.state else 0.0,
                                     "placements": sorted(set(plan.placement().values()))}
                    records.append({"trace": trace.name, "hardware": hw.name, "budget_gib": gib, "floor_s": floor,
                                    "results": out})
                    d = out["default"].get("step_s")
                    fitting = [out[p]["step_s"] for p in peers if out[p].get("step_s")]
                    if d and fitting:
                        ratios.append(d / min(fitting))
                    elif d and not fitting:
                        only_default += 1

                    def cell(name: str, out=out, trace=trace) -> str:
                        o = out[name]
                        if o.get("step_s") is None:
                            return "OOM" if "error" not in o else "refused"
                        return f"{o['step_s']:.2f} s"
                    dd = out["default"]
                    rows.append([trace.name, hw.name, f"{gib} GiB", f"{floor:.2f} s", cell("default"),
                                 *(cell(p) if p in out else "-" for p in PEERS),
                                 f"{dd.get('plan_s', math.nan):.1f} s",
                                 "-" if dd.get("step_s") is None else f"{dd['h2d_bytes'] / GIB:.0f}/{dd['d2h_bytes'] / GIB:.0f}",
                                 "-" if dd.get("step_s") is None else f"{dd['host_peak_bytes'] / GIB:.0f}",
                                 "-" if dd.get("step_s") is None else f"{dd['host_step_s']:.2f}",
                                 ",".join(dd.get("placements", []))])
    head = ["trace", "hardware", "budget", "floor", "default", *PEERS, "plan", "h2d/d2h GiB", "host GiB", "host step s",
            "default places"]
    print(table(head, [r + [""] * (len(head) - len(r)) for r in rows]))
    summary = {"default_over_best_peer_geomean": geomean(ratios), "worst": max(ratios, default=math.nan),
               "cases_both_fit": len(ratios), "cases_only_default_fits": only_default}
    print(f"\ndefault over the best peer that fits: {summary['default_over_best_peer_geomean']:.3f}x geomean, worst "
          f"{summary['worst']:.3f}x over {len(ratios)} cases; {only_default} case(s) where only default fits")
    write(args.out, {"cases": records, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
