"""What users would run: 7B-class decoders in bf16 autocast with flash attention, at long contexts.

Llama-, Qwen2- and Mistral-style 7B configurations (transformers' default configs of those
families: ``swapsched profile hf:TYPE --size full``), batch 1, profiled on ``meta`` under bf16
autocast over fp32 weights with SDPA's flash kernel (swapsched/attention.py), at each sequence
length; each trace retimed by roofline for each hardware. At 30/50/70% of the activation peak:

- ``default`` (its plan time beside it);
- the best single technique (swap-only MIN / Capuchin-swap / vDNN / save_on_cpu, checkpoint-all,
  checkpoint-selective, Capuchin);
- ``checkpoint-offload``: checkpoint every layer and offload its input, the long-context
  trainers' pattern;
- the R8/R9 joint floor.

Steps are over the ideal step (``+x%``). The smallest feasible budget is per trace, in GiB of
activations (the static bytes, 16 per parameter with AdamW, are beside it: a single rank would
shard them with FSDP).

    python scripts/bench_llm.py --out bench_results/llm.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table, write  # noqa: E402

from swapsched.agents.registry import get_policy  # noqa: E402
from swapsched.budget import parse_budget, smallest_feasible  # noqa: E402
from swapsched.env.floors import joint_floor  # noqa: E402
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402
from swapsched.precision import Precision  # noqa: E402
from swapsched.runtime.profiler import profile  # noqa: E402
from swapsched.zoo import build_model  # noqa: E402

TECHNIQUES = ["min", "capuchin-swap", "vdnn-all", "swap-all", "checkpoint-all", "checkpoint-selective", "capuchin"]
GIB = 2**30


def llm_trace(model_type: str, seq_len: int):
    case = build_model(f"hf:{model_type}", "full", batch_size=1, seq_len=seq_len, device="meta", attention="flash")
    opt = torch.optim.AdamW(case.model.parameters())
    return profile(case.model, case.inputs, case.loss_fn, opt, device="meta", name=f"{model_type}-7b-{seq_len // 1024}k",
                   precision=Precision("bf16", amp=True), attention="flash")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,qwen2,mistral")
    ap.add_argument("--seq-lens", default="2048,8192,32768")
    ap.add_argument("--budgets", default="30%,50%,70%")
    ap.add_argument("--hardware", default="h100-pcie5,gh200-c2c")
    ap.add_argument("--out", default="bench_results/llm.json")
    args = ap.parse_args()
    hws = [load_hardware(h) for h in args.hardware.split(",")]
    pols = {n: get_policy(n) for n in ["default", "checkpoint-offload", *TECHNIQUES]}
    rows, sizes = [], []
    for model_type in args.models.split(","):
        for seq in (int(s) for s in args.seq_lens.split(",")):
            t0 = time.perf_counter()
            base = llm_trace(model_type, seq)
            need, pct = smallest_feasible(base)
            sizes.append({"trace": base.name, "tensors": base.n_tensors, "saved_peak_gib": base.saved_bytes_peak / GIB,
                          "static_gib": base.static_bytes / GIB, "smallest_feasible_gib": (need - base.static_bytes) / GIB,
                          "smallest_feasible_pct": pct, "attention": base.meta["attention"],
                          "profile_s": time.perf_counter() - t0})
            print(f"{base.name}: {base.n_tensors} tensors, saved peak {base.saved_bytes_peak / GIB:.1f} GiB, "
                  f"smallest feasible {(need - base.static_bytes) / GIB:.2f} GiB ({pct:.1f}%)", file=sys.stderr, flush=True)
            for hw in hws:
                tr = base.retimed(hw)
                for b in args.budgets.split(","):
                    budget = parse_budget(b, tr)
                    row = {"trace": tr.name, "hardware": hw.name, "budget": b, "budget_gib": (budget - tr.static_bytes) / GIB,
                           "ideal_s": tr.ideal_s, "step_s": {}, "oom": {}}
                    for name, pol in pols.items():
                        t1 = time.perf_counter()
                        plan = pol.plan(tr, budget, hw)
                        if name == "default":
                            row["default_plan_s"] = time.perf_counter() - t1
                        r = simulate(tr, plan, hw, budget)
                        row["step_s"][name], row["oom"][name] = r.iteration_s, r.oom
                    fits = [(row["step_s"][t], t) for t in TECHNIQUES if not row["oom"][t]]
                    row["best_technique"] = min(fits)[1] if fits else None
                    row["floor_s"] = joint_floor(tr, budget, hw)
                    rows.append(row)
                    print(f"  {hw.name:11s} {b:>4} " + _cells(row)[0], file=sys.stderr, flush=True)
    write(args.out, {"sizes": sizes, "rows": rows})
    print(table(["trace", "tensors", "saved peak GiB", "static GiB", "smallest feasible GiB (%)", "attention"],
                [[s["trace"], s["tensors"], f"{s['saved_peak_gib']:.1f}", f"{s['static_gib']:.1f}",
                  f"{s['smallest_feasible_gib']:.2f} ({s['smallest_feasible_pct']:.1f}%)",
                  ", ".join(f"{k} x{n}" for k, n in s["attention"].items())] for s in sizes]))
    print()
    print(table(["trace", "hardware", "budget", "GiB", "default", "plan s", "best technique", "checkpoint-offload", "floor"],
                [[r["trace"], r["hardware"], r["budget"], f"{r['budget_gib']:.1f}", *_cells(r)[1:]] for r in rows]))
    return 0


def _pct(row: dict, step: float | None) -> str:
    return "OOM" if step is None else f"+{max(100 * (step / row['ideal_s'] - 1), 0.0):.1f}%"  # -0.0: rounding


def _cells(row: dict) -> list[str]:
    def step(name: str) -> float | None:
        return None if row["oom"][name] else row["step_s"][name]

    best = row["best_technique"]
    cells = [_pct(row, step("default")), f"{row['default_plan_s']:.2f}",
             "none fits" if best is None else f"{_pct(row, step(best))} ({best})",
             _pct(row, step("checkpoint-offload")), _pct(row, row["floor_s"])]
    return [" ".join(cells), *cells]


if __name__ == "__main__":
    sys.exit(main())
