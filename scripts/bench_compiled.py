"""The compiled executor (R10): what planning a compiled graph costs, and what it predicts.

Two parts (JSON plus tables):

- **cpu**: a zoo GPT on this machine's CPU under Inductor. Planning time per compiled graph,
  compile time with and without the backend, and step time against ``torch.compile(model)`` with
  a budget where the plan keeps everything, measured in shuffled interleaved rounds (median ratio
  and its spread over rounds).
- **sim**: GPT-1.3B and a Llama-1B-shaped decoder traced on ``meta`` both ways: as the compiled
  executor sees it (the partition's saved tensors, only those torch can offload plannable, R10)
  and as the hook runtime's profiler does (every saved tensor plannable, R1-R9). ``default``
  plans each at 30/50/70% of its own activation peak on each hardware; the table gives each
  executor's predicted step over its ideal, and the smallest feasible budget of each. Beside
  them, torch's own answer: ``torch.compile`` with ``activation_memory_budget`` at the same
  fraction (a knapsack over recompute only), its step traced as partitioned: its cost over the
  compiled ideal (the recomputes it added) and whether its peak fits the same bytes.

    python scripts/bench_compiled.py --out bench_results/compiled.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table, write  # noqa: E402

from swapsched.agents.registry import get_policy  # noqa: E402
from swapsched.budget import BudgetError, parse_budget, smallest_feasible  # noqa: E402
from swapsched.compiled.backend import PlannedBackend  # noqa: E402
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402
from swapsched.plan import SwapPlan  # noqa: E402
from swapsched.runtime.profiler import profile  # noqa: E402
from swapsched.zoo import build_model  # noqa: E402


class Recorder:
    """A policy that keeps every trace it is given and plans nothing."""

    name = "record"

    def __init__(self) -> None:
        self.traces: list[Any] = []

    def plan(self, trace: Any, budget: int, hardware: Any) -> SwapPlan:
        self.traces.append(trace)
        return SwapPlan.of(trace, self.name, [])


def build(spec: str) -> tuple[torch.nn.Module, tuple[Any, ...], Any, Any]:
    """A model on meta, its inputs and its loss: ``MODEL:SIZE`` from the zoo, or ``llama-1b``
    (a Llama-3.2-1B-shaped decoder from ``transformers``: 16 layers, width 2048, 32 heads, 8 key
    and value heads, MLP 8192; batch 2 of 2,048 tokens; SDPA attention)."""
    if spec == "llama-1b":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, attn_implementation="sdpa")
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, 32000, (2, 2048), device="meta")

        class Wrapped(torch.nn.Module):  # one tensor in, the loss out: what the eager profiler takes
            def __init__(self) -> None:
                super().__init__()
                self.inner = model

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.inner(input_ids=x, labels=x, use_cache=False).loss

        # compiled: the model itself, called as users call it (a module wrapped around it hid its graph)
        return Wrapped(), (ids,), lambda out: out, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss
    model_name, size = spec.split(":")
    case = build_model(model_name, size, device="meta")
    return case.model, case.inputs, case.loss_fn, lambda m: case.loss_fn(m(*case.inputs))


def compiled_traces(spec: str, hw: Any, knapsack: float | None = None) -> list[Any]:
    """The compiled executor's traces of a model on meta, after Inductor's decompositions
    (``aot_eager_decomp``: the graphs Inductor partitions, without its kernels, which meta cannot
    run). With ``knapsack``, partitioned under torch's ``activation_memory_budget`` instead: the
    trace then is the step torch's knapsack chose (its recomputes are backward nodes, timed)."""
    torch._dynamo.reset()
    model, _, _, call = build(spec)
    rec = Recorder()
    backend = PlannedBackend("100%", rec, hw, inner="aot_eager_decomp")
    from torch._functorch import config as functorch_config

    with functorch_config.patch(activation_memory_budget=1.0 if knapsack is None else knapsack):
        call(torch.compile(getattr(model, "inner", model), backend=backend)).backward()
    return rec.traces


def sim_part(models: list[str], hardware: list[str], budgets: list[str]) -> list[dict[str, Any]]:
    rows = []
    policy = get_policy("default")
    for spec in models:
        for hw_name in hardware:
            hw = load_hardware(hw_name)
            compiled_hw = hw.for_executor("compiled")
            (ctrace,) = compiled_traces(spec, hw)
            model, inputs, loss_fn, _ = build(spec)
            try:
                etrace = profile(model, inputs, loss_fn, hardware=hw, name=f"{spec}-hooks")
            except RuntimeError as exc:  # the eager profiler on meta cannot run every model (issue 37: .item())
                etrace, why = None, f"{type(exc).__name__}: {str(exc)[:120]}"
                print(f"{spec}: no hook-runtime trace on meta: {why}", file=sys.stderr)
            for budget in budgets:
                row: dict[str, Any] = {"model": spec, "hardware": hw_name, "budget": budget,
                                       "compiled_held_bytes": ctrace.meta["held_bytes"],
                                       "compiled_saved_bytes": int(ctrace.tensor_bytes.sum())}
                for label, trace, h in (("compiled", ctrace, compiled_hw), ("hooks", etrace, hw)):
                    if trace is None:
                        row[f"{label}_overhead"] = row[f"{label}_floor_pct"] = None
                        row[f"{label}_missing"] = why
                        continue
                    row[f"{label}_floor_pct"] = smallest_feasible(trace)[1]
                    row[f"{label}_ideal_ms"] = trace.ideal_s * 1e3
                    try:
                        b = parse_budget(budget, trace)
                    except BudgetError:
                        row[f"{label}_overhead"] = None
                        continue
                    t0 = time.perf_counter()
                    plan = policy.plan(trace, b, h)
                    row[f"{label}_plan_s"] = time.perf_counter() - t0
                    res = simulate(trace, plan, h, b)
                    row[f"{label}_overhead"] = None if res.oom else res.overhead
                # torch's knapsack at the same fraction: does its step fit the same bytes, and at what cost
                frac = float(budget.rstrip("%")) / 100
                (ktrace,) = compiled_traces(spec, hw, knapsack=frac)
                b = parse_budget(budget, ctrace, check_feasible=False)
                row["knapsack_peak_bytes"] = int(ktrace.peak_bytes_no_swap)
                row["compiled_peak_bytes"] = int(ctrace.peak_bytes_no_swap)  # untagged, nothing offloaded
                row["budget_bytes"] = b
                row["knapsack_fits"] = bool(ktrace.peak_bytes_no_swap <= b)
                row["knapsack_overhead"] = ktrace.ideal_s / ctrace.ideal_s - 1.0
                rows.append(row)
                print(row, file=sys.stderr)
    return rows


def cpu_part(rounds: int, steps: int) -> dict[str, Any]:
    """GPT small on CPU under Inductor: planning and compile time, and the step against torch.compile."""
    def fresh() -> Any:
        return build_model("gpt", "small", device="cpu", seed=0)

    def step(fn: Any, case: Any) -> float:
        t0 = time.perf_counter()
        case.loss_fn(fn(*case.inputs)).backward()
        return time.perf_counter() - t0

    out: dict[str, Any] = {}
    torch._dynamo.reset()
    plain_case = fresh()
    t0 = time.perf_counter()
    plain = torch.compile(plain_case.model)
    step(plain, plain_case)
    out["compile_s_plain"] = time.perf_counter() - t0
    torch._dynamo.reset()
    planned_case = fresh()
    backend = PlannedBackend("100%", get_policy("default"), load_hardware("h100-pcie5"), inner="inductor")
    t0 = time.perf_counter()
    planned = torch.compile(planned_case.model, backend=backend)
    step(planned, planned_case)
    out["compile_s_planned"] = time.perf_counter() - t0
    print(backend.report(), file=sys.stderr)
    out["plan_s_per_graph"] = [g.plan_s for g in backend.report().graphs]
    out["offloaded"] = sum(g.offloaded for g in backend.report().graphs)
    torch._dynamo.reset()
    # both compiled functions stay usable after reset (their code is cached on them)
    times: dict[str, list[float]] = {"plain": [], "planned": []}
    ratios = []
    rng = random.Random(0)
    for _ in range(rounds):
        order = [("plain", plain, plain_case), ("planned", planned, planned_case)]
        rng.shuffle(order)
        got = {}
        for name, fn, case in order:
            got[name] = statistics.median(step(fn, case) for _ in range(steps))
            times[name].append(got[name])
        ratios.append(got["planned"] / got["plain"])
    out["step_ms_plain"] = statistics.median(times["plain"]) * 1e3
    out["step_ms_planned"] = statistics.median(times["planned"]) * 1e3
    out["ratio_median"] = statistics.median(ratios)
    out["ratio_min"], out["ratio_max"] = min(ratios), max(ratios)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt:1.3b,llama-1b", help="zoo MODEL:SIZE or llama-1b, comma list, for the simulated part")
    ap.add_argument("--hardware", default="h100-pcie5,gh200-c2c")
    ap.add_argument("--budgets", default="30%,50%,70%")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--out", default="bench_results/compiled.json")
    a = ap.parse_args()
    cpu = None if a.skip_cpu else cpu_part(a.rounds, a.steps)
    rows = sim_part(a.models.split(","), a.hardware.split(","), a.budgets.split(","))
    write(a.out, {"cpu": cpu, "sim": rows})
    if cpu:
        print(table(["compile s (plain)", "compile s (planned)", "plan s / graph", "step ms plain", "step ms planned",
                     "ratio median", "ratio min", "ratio max"],
                    [[f"{cpu['compile_s_plain']:.1f}", f"{cpu['compile_s_planned']:.1f}",
                      ", ".join(f"{s:.2f}" for s in cpu["plan_s_per_graph"]), f"{cpu['step_ms_plain']:.2f}",
                      f"{cpu['step_ms_planned']:.2f}", f"{cpu['ratio_median']:.3f}", f"{cpu['ratio_min']:.3f}",
                      f"{cpu['ratio_max']:.3f}"]]))

    def pct(x: Any) -> str:
        return "OOM/infeasible/-" if x is None else f"{x:+.1%}"

    print(table(["model", "hardware", "budget", "compiled over ideal", "hooks over ideal", "torch knapsack", "knapsack fits",
                 "compiled floor %", "hooks floor %"],
                [[r["model"], r["hardware"], r["budget"], pct(r.get("compiled_overhead")), pct(r.get("hooks_overhead")),
                  pct(r["knapsack_overhead"]), "yes" if r["knapsack_fits"] else
                  f"no ({r['knapsack_peak_bytes'] / 2**30:.1f} of {r['budget_bytes'] / 2**30:.1f} GiB)",
                  f"{r['compiled_floor_pct']:.1f}",
                  "not traced" if r["hooks_floor_pct"] is None else f"{r['hooks_floor_pct']:.1f}"] for r in rows]))


if __name__ == "__main__":
    main()
