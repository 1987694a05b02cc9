"""One rank of an FSDP2 step (R18): ``default`` against the peers FSDP2 and DeepSpeed users run,
on the simulator, for Llama-3-8B and Llama-3-70B at their published sizes.

Each model is built from its published config (``swapsched/configs/hf/``) on ``meta`` and
profiled as a rank computes it (4096 tokens a rank, bf16 on bf16 unsharded parameters: FSDP2's
``MixedPrecisionPolicy``), then sharded over the job's ranks (fp32 shards of the parameters,
gradients and AdamW's moments; all-gathers in bf16, reduce-scatters in fp32): ``swapsched profile
hf:CONFIG --device meta --world-size N``. Hardware: 8 x H100 SXM a node (``h100-sxm``), one node
(8 ranks) and four (32). Per-rank device budgets 80, 60 and 40 GB; host memory 1 TB and 512 GB a
node.

Per row: each policy's step, the job's tokens a second, the rank's device peak, the node's host
peak, and whether it fits. The summary: ``default``'s step over the best fitting peer's (geometric
mean, worst), the cases where a peer fits and ``default`` does not, and ``default``'s plan time.

    python scripts/bench_sharded.py --out bench_results/sharded.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import geomean, table, write  # noqa: E402

from swapsched._paths import config_dir  # noqa: E402
from swapsched.agents.registry import get_policy  # noqa: E402
from swapsched.budget import BudgetError  # noqa: E402
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402
from swapsched.precision import Precision  # noqa: E402
from swapsched.runtime.profiler import profile  # noqa: E402
from swapsched.sharding import shard_trace  # noqa: E402
from swapsched.zoo import build_model  # noqa: E402

MODELS = {"llama3-8b": "llama3-8b.json", "llama3-70b": "llama3-70b.json"}
WORLDS = (8, 32)
BUDGETS_GB = (80, 60, 40)
HOSTS_GB = (1000, 512)
PEERS = ("fsdp", "fsdp-offload", "fsdp-partial", "zero3-offload")
TOKENS = 4096


def rank_trace(model: str, world: int, hardware: str):
    precision = Precision("bf16", amp=False)
    case = build_model(f"hf:{config_dir() / 'hf' / MODELS[model]}", batch_size=1, seq_len=TOKENS, device="meta",
                       dtype=precision.param_dtype, attention="auto")
    trace = profile(case.model, case.inputs, case.loss_fn, device="meta", name=model, hardware=hardware,
                    precision=precision, attention="auto", state="adamw")
    return shard_trace(trace, world, gather_bytes=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_results/sharded.json")
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    hw0 = load_hardware("h100-sxm")
    rows, ratios, misses, plan_s = [], [], [], []
    for model in args.models.split(","):
        for world in WORLDS:
            trace = rank_trace(model, world, hw0.name)
            for host_gb in HOSTS_GB:
                hw = hw0.with_host(host_budget_bytes=host_gb * 10**9)
                for budget_gb in BUDGETS_GB:
                    budget = budget_gb * 10**9
                    steps = {}
                    for name in (*PEERS, "default"):
                        t0 = time.perf_counter()
                        try:
                            plan = get_policy(name).plan(trace, budget, hw)
                        except BudgetError:  # default's refusal: no placement it screens fits
                            plan = None
                        took = time.perf_counter() - t0
                        r = None if plan is None else simulate(trace, plan, hw, budget)
                        if name == "default":
                            plan_s.append(took)
                        fits = r is not None and not r.oom
                        steps[name] = r.iteration_s if fits and r is not None else None
                        rows.append({"model": model, "ranks": world, "host_gb_node": host_gb, "budget_gb": budget_gb,
                                     "policy": name, "fits": fits, "step_s": steps[name],
                                     "tokens_per_s": TOKENS * world / r.iteration_s if fits and r is not None else None,
                                     "device_peak_bytes": None if r is None else r.peak_bytes,
                                     "node_host_peak_bytes": None if r is None else r.node_host_peak_bytes,
                                     "plan_s": took})
                    fitting = [s for p, s in steps.items() if p != "default" and s is not None]
                    if fitting and steps["default"] is None:
                        misses.append((model, world, host_gb, budget_gb))
                    elif fitting:
                        ratios.append(steps["default"] / min(fitting))
                    print(f"{model} x{world} host {host_gb} GB budget {budget_gb} GB: "
                          + ", ".join(f"{p} {'OOM' if s is None else f'{s:.3f}'}" for p, s in steps.items()), flush=True)
    summary = {"default_over_best_peer_geomean": geomean(ratios) if ratios else math.nan,
               "default_over_best_peer_worst": max(ratios, default=math.nan), "cases": len(ratios),
               "peer_fits_default_not": misses, "default_plan_s_median": sorted(plan_s)[len(plan_s) // 2],
               "default_plan_s_max": max(plan_s)}
    head = ["model", "ranks", "host GB/node", "budget GB", "policy", "step s", "tokens/s", "rank peak GiB", "node host GiB"]
    print(table(head, [[r["model"], r["ranks"], r["host_gb_node"], r["budget_gb"], r["policy"],
                        "OOM" if not r["fits"] else f"{r['step_s']:.3f}",
                        "-" if not r["fits"] else f"{r['tokens_per_s']:,.0f}",
                        "-" if r["device_peak_bytes"] is None else f"{r['device_peak_bytes'] / 2**30:.1f}",
                        "-" if r["node_host_peak_bytes"] is None else f"{r['node_host_peak_bytes'] / 2**30:.0f}"]
                       for r in rows]))
    print(summary)
    write(args.out, {"rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
