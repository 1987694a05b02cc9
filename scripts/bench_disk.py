"""The disk tier (R19): ``default`` against ZeRO-Infinity's placement, on the simulator, where the
host memory cannot hold the training state.

Each model is profiled on ``meta`` as ``swapsched profile hf:CONFIG --device meta --hardware HW
--seq-len S [--no-amp]`` would (flash attention, batch 1, AdamW state per group), retimed for its
hardware, whose profile gives the drives (``rtx4090-pcie4``: one PCIe 4.0 drive; ``h100-pcie5``: a
4-drive RAID 0). At each device budget, with the host budget and a disk budget of 4 TiB:

- ``default``: the state and the activations planned together, the disk holding what the host
  budget cannot (``state_search.spill_to_disk``), and its plan time;
- ``zero-infinity``: every group ``full`` with its master and optimizer state on the disk, the
  CPU step after backward, every block checkpointed (DeepSpeed ZeRO-Infinity, ``offload_param``
  and ``offload_optimizer`` to NVMe);
- ``zero3-offload`` (the same on the host alone), which shows what the host budget refuses.

The summary is ``default``'s step over ``zero-infinity``'s where both fit (geometric mean, worst)
and the cases where only one fits.

    python scripts/bench_disk.py --out bench_results/disk.json
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
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402
from swapsched.precision import Precision  # noqa: E402
from swapsched.runtime.profiler import profile  # noqa: E402
from swapsched.zoo import build_model  # noqa: E402

GIB = 2**30
CONFIGS = Path(__file__).resolve().parent.parent / "swapsched" / "configs" / "hf"
#: name -> (config, sequence length, autocast over fp32 state, hardware, host budget GiB, device budgets GiB)
CASES = {
    "llama3-8b-2k-amp": ("llama3-8b.json", 2048, True, "rtx4090-pcie4", 64, (23.5, 24)),
    "llama3-8b-4k-amp": ("llama3-8b.json", 4096, True, "rtx4090-pcie4", 64, (24,)),
    "llama3-8b-4k-bf16": ("llama3-8b.json", 4096, False, "rtx4090-pcie4", 32, (20, 23)),
    "llama3-70b-4k-bf16": ("llama3-70b.json", 4096, False, "h100-pcie5", 256, (40, 60, 78)),
}
POLICIES = ("default", "zero-infinity", "zero3-offload")


def disk_trace(config: str, seq_len: int, amp: bool, hardware: str):
    dtype = torch.float32 if amp else torch.bfloat16
    case = build_model(f"hf:{CONFIGS / config}", None, batch_size=1, seq_len=seq_len, device="meta", attention="flash",
                       dtype=dtype)
    return profile(case.model, case.inputs, case.loss_fn, None, device="meta", name=f"{Path(config).stem}-{seq_len}",
                   precision=Precision("bf16", amp=amp), attention="flash", hardware=hardware, state="adamw")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--out", default="bench_results/disk.json")
    args = ap.parse_args()
    rows, records, ratios = [], [], []
    only = {"default": 0, "zero-infinity": 0}
    for key in args.cases.split(","):
        config, seq, amp, hw_name, host_gib, budgets = CASES[key]
        t0 = time.perf_counter()
        trace = disk_trace(config, seq, amp, hw_name)
        state = sum(g.bytes for g in trace.state)
        print(f"{key}: profiled in {time.perf_counter() - t0:.1f} s, state {state / GIB:.1f} GiB in {len(trace.state)} "
              f"groups", file=sys.stderr)
        hw = load_hardware(hw_name).with_host(host_budget_bytes=host_gib * GIB, disk_budget_bytes=4096 * GIB)
        for gib in budgets:
            budget = int(gib * GIB)
            out: dict[str, dict] = {}
            if budget < trace.min_feasible_bytes_movable:
                out = {p: {"error": f"below the smallest feasible {trace.min_feasible_bytes_movable / GIB:.2f} GiB"}
                       for p in POLICIES}
            for name in POLICIES if not out else ():
                t1 = time.perf_counter()
                try:
                    plan = get_policy(name).plan(trace, budget, hw)
                except Exception as exc:  # default refuses a budget no placement fits: recorded
                    out[name] = {"error": str(exc).split(";")[0]}
                    continue
                r = simulate(trace, plan, hw, budget)
                st = r.state
                out[name] = {"step_s": None if r.oom else r.iteration_s, "plan_s": time.perf_counter() - t1,
                             "host_peak_bytes": r.host_peak_bytes, "disk_bytes": st.disk_bytes if st else 0,
                             "disk_read_bytes": st.disk_read_bytes if st else 0,
                             "host_step_s": st.host_step_s if st else 0.0,
                             "placements": sorted(set(plan.placement().values())), "tiers": sorted(set(plan.on_disk().values()))}
            records.append({"case": key, "trace": trace.name, "hardware": hw_name, "host_budget_gib": host_gib,
                            "budget_gib": gib, "state_gib": state / GIB, "results": out})
            d, z = out["default"].get("step_s"), out["zero-infinity"].get("step_s")
            if d and z:
                ratios.append(d / z)
            elif d or z:
                only["default" if d else "zero-infinity"] += 1

            def cell(name: str, out=out) -> str:
                o = out[name]
                return ("n/a" if "smallest" in o.get("error", "") else "refused" if "error" in o else
                        "OOM" if o["step_s"] is None else f"{o['step_s']:.2f} s")
            dd = out["default"]
            fits = dd.get("step_s") is not None
            rows.append([key, hw_name, f"{host_gib} GiB", f"{gib} GiB", *(cell(p) for p in POLICIES),
                         f"{dd['step_s'] / out['zero-infinity']['step_s']:.2f}x" if fits and out["zero-infinity"].get("step_s") else "-",
                         f"{dd.get('plan_s', math.nan):.1f} s" if "plan_s" in dd else "-",
                         f"{dd['disk_bytes'] / GIB:.0f}" if fits else "-", f"{dd['host_peak_bytes'] / GIB:.1f}" if fits else "-",
                         ",".join(dd.get("placements", [])) + (f" ({','.join(dd['tiers'])})" if dd.get("tiers") else "")])
    print(table(["case", "hardware", "host", "budget", *POLICIES, "default/zi", "plan", "disk GiB", "host GiB",
                 "default places (disk tiers)"], rows))
    summary = {"default_over_zero_infinity_geomean": geomean(ratios), "worst": max(ratios, default=math.nan),
               "cases_both_fit": len(ratios), "cases_only_default_fits": only["default"],
               "cases_only_zero_infinity_fits": only["zero-infinity"]}
    print(f"\ndefault over zero-infinity: {summary['default_over_zero_infinity_geomean']:.3f}x geomean, worst "
          f"{summary['worst']:.3f}x over {len(ratios)} cases; only default fits in {only['default']}, only "
          f"zero-infinity in {only['zero-infinity']}")
    write(args.out, {"cases": records, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
