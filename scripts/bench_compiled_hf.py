"""The compiled executor on the models users compile (issue 43): Hugging Face GPT-2, Llama and
Mistral, small (2 layers, width 128, SDPA), batch 2 x 64 tokens, whole-model ``torch.compile``
with ``inner="aot_eager"`` on this CPU (``--inner aot_eager_decomp``: the graphs Inductor would
partition, after its decompositions), 3 AdamW steps, ``default`` planning for ``h100-pcie5``.

Per model and budget (30/50/70% of the step): whether it trains, the losses against
``torch.compile`` alone (exact equality), graphs per step, the step's predicted peak against its
budget and its smallest feasible budget, saved and held bytes, plans made and their time, the
first step's time (compile included) against plain ``torch.compile``'s. Beside it, the hook
runtime's answer for the same model and budget: its trace profiled on the CPU and retimed for
the same hardware, ``default``'s plan, the predicted step over its ideal and its smallest
feasible budget.

    python scripts/bench_compiled_hf.py [--inner aot_eager] --out bench_results/compiled_hf.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table, write  # noqa: E402

import swapsched  # noqa: E402
from swapsched.agents.registry import get_policy  # noqa: E402
from swapsched.budget import BudgetError, format_bytes, parse_budget, smallest_feasible  # noqa: E402
from swapsched.env.simulator import simulate  # noqa: E402
from swapsched.hardware import load_hardware  # noqa: E402
from swapsched.hf_models import build_hf  # noqa: E402
from swapsched.runtime.profiler import profile  # noqa: E402

HW = "h100-pcie5"
#: --layers/--width: each family's config keys for its depth, width, heads (and MLP width)
SHAPE = {"gpt2": lambda n, w: {"n_layer": n, "n_embd": w, "n_head": w // 64},
         "llama": lambda n, w: {"num_hidden_layers": n, "hidden_size": w, "intermediate_size": 11 * w // 4,
                                "num_attention_heads": w // 64, "num_key_value_heads": max(1, w // 128)},
         "mistral": lambda n, w: {"num_hidden_layers": n, "hidden_size": w, "intermediate_size": 7 * w // 2,
                                  "num_attention_heads": w // 64, "num_key_value_heads": max(1, w // 128)}}
#: the model's shape (``main`` sets it from --layers, --width, --seq-len): small (2 layers, width 128) at 64 tokens
CASE: dict[str, Any] = {"layers": None, "width": None, "seq_len": 64}


def _case(model_type: str) -> Any:
    n, w = CASE["layers"], CASE["width"]
    if n is None:
        return build_hf(model_type, "small", 2, CASE["seq_len"], "cpu", 0)
    overrides = {k: str(v) for k, v in SHAPE[model_type](n, w).items()}
    return build_hf(model_type, "full", 2, CASE["seq_len"], "cpu", 0, overrides=overrides)


def train(model_type: str, backend: Any, steps: int = 3) -> tuple[list[float], float, str | None]:
    """Losses of ``steps`` AdamW steps, the first step's time, and the error if it failed."""
    case = _case(model_type)
    torch._dynamo.reset()
    step = torch.compile(case.model, backend=backend)
    opt = torch.optim.AdamW(case.model.parameters())
    losses, first = [], 0.0
    for i in range(steps):
        torch.manual_seed(100 + i)
        t0 = time.perf_counter()
        try:
            loss = step(*case.inputs)
            loss.backward()
        except Exception as exc:  # a budget the step cannot meet: recorded, one line
            inner = getattr(exc, "inner_exception", exc)
            return losses, first, f"{type(inner).__name__}: {str(inner).splitlines()[0]}"
        opt.step()
        opt.zero_grad()
        if i == 0:
            first = time.perf_counter() - t0
        losses.append(float(loss.detach()))
    return losses, first, None


def hooks(model_type: str, budget: str) -> dict[str, Any]:
    case = _case(model_type)
    trace = profile(case.model, case.inputs, lambda loss: loss, device="cpu", name=f"hf-{model_type}", hardware=HW)
    hw = load_hardware(HW)
    need, pct = smallest_feasible(trace)
    try:
        b = parse_budget(budget, trace)
    except BudgetError:
        return {"smallest_pct": pct, "predicted_over_ideal": None}
    r = simulate(trace, get_policy("default").plan(trace, b, hw), hw, b)
    return {"smallest_pct": pct, "predicted_over_ideal": None if r.oom else r.iteration_s / r.ideal_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,llama,mistral")
    ap.add_argument("--layers", type=int, help="another depth (with --width; default: small's 2)")
    ap.add_argument("--width", type=int, default=256, help="with --layers: the width (a multiple of 64; default 256)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence, batch 2 (default 64)")
    ap.add_argument("--budgets", default="30%,50%,70%")
    ap.add_argument("--inner", default="aot_eager", choices=["aot_eager", "aot_eager_decomp"],
                    help="the compiler behind the partition, for swapsched's backend and the plain run alike")
    ap.add_argument("--out", default="bench_results/compiled_hf.json")
    args = ap.parse_args()
    CASE.update(layers=args.layers, width=args.width, seq_len=args.seq_len)
    rows, records = [], []
    for mt in args.models.split(","):
        # torch's own backend for the same graphs: aot_eager_decomp is Inductor's decompositions
        # before the partition, as torch's aot_eager_decomp_partition runs them
        plain_losses, plain_first, _ = train(mt, {"aot_eager_decomp": "aot_eager_decomp_partition"}.get(args.inner, args.inner))
        for budget in args.budgets.split(","):
            be = swapsched.CompileBackend(budget, "default", HW, inner=args.inner)
            losses, first, error = train(mt, be)
            rep = be.report()
            st = rep.step
            hook = hooks(mt, budget)
            rec = {"model": mt, "budget": budget, "error": error, "losses_equal": error is None and losses == plain_losses,
                   "graphs": len(rep.graphs), "runs_per_step": list(st.runs) if st else None,
                   "predicted_peak_bytes": st.predicted_peak_bytes if st else None,
                   "budget_bytes": st.budget_bytes if st else None,
                   "smallest_feasible_bytes": st.smallest_feasible_bytes if st else None,
                   "saved_bytes": sum(g.saved_bytes for g in rep.graphs), "held_bytes": rep.held_bytes,
                   "plans": rep.plans_made, "plan_s": rep.plan_total_s, "first_step_s": first,
                   "plain_first_step_s": plain_first,
                   "compiled_predicted_over_ideal": (sum(g.predicted_step_s for g in rep.graphs)
                                                     / sum(g.ideal_s for g in rep.graphs)) if rep.graphs and not error else None,
                   "hooks": hook}
            records.append(rec)
            held = f"{rec['held_bytes'] / rec['saved_bytes']:.0%}" if rec["saved_bytes"] else "-"
            rows.append([mt, budget, "refused" if error else ("equal" if rec["losses_equal"] else "DIFFER"),
                         " -> ".join(map(str, st.runs)) if st else "-",
                         f"{format_bytes(st.predicted_peak_bytes)} / {format_bytes(st.budget_bytes)}" if st and not error else "-",
                         format_bytes(st.smallest_feasible_bytes) if st else "-", held,
                         f"{rec['plans']} in {rec['plan_s']:.2f} s", f"{first:.1f} / {plain_first:.1f} s",
                         "-" if rec["compiled_predicted_over_ideal"] is None else f"{rec['compiled_predicted_over_ideal']:.2f}x",
                         "-" if hook["predicted_over_ideal"] is None else f"{hook['predicted_over_ideal']:.2f}x",
                         f"{hook['smallest_pct']:.0f}%"])
            if error:
                print(f"{mt} at {budget}: {error}", file=sys.stderr)
    print(table(["model", "budget", "losses", "graphs run", "pred. peak / budget", "smallest step", "held",
                 "plans", "1st step / plain", "compiled pred.", "hooks pred.", "hooks smallest"], rows))
    write(args.out, {"hardware": HW, "inner": args.inner, "cases": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
