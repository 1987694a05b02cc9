"""The compiled executor on a GPU, beside what users compile today (needs CUDA).

A zoo GPT (default: 350M, batch 4, 512 tokens) trained a few steps each way, on one device:

- ``compiled``: ``torch.compile(model, backend=swapsched.CompileBackend(budget))``;
- ``hooks``: ``swapsched.SwapRuntime(budget)`` around the eager model (saved-tensor hooks);
- ``torch-budget``: ``torch.compile`` with ``activation_memory_budget`` (torch's knapsack over
  recompute only) at the same fraction;
- ``sac``: eager, each block under selective activation checkpointing with torch's default op
  list (``torch._functorch.partitioners.get_default_op_list``: compute-intensive ops saved);
- ``plain``: ``torch.compile(model)``, nothing planned.

For each: the median step time after warm-up and ``torch.cuda.max_memory_allocated`` over the
measured steps. The JSON is rewritten after every method, so a timeout keeps what finished.

    python scripts/check_compiled_gpu.py --budget 50% --out bench_results/compiled_gpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import swapsched
from swapsched.zoo import build_model


def _steps(case: Any, fwd: Any, steps: int, wrap: Any = None) -> dict[str, Any]:
    times = []
    torch.cuda.synchronize()
    for i in range(steps + 2):
        if i == 2:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if wrap is not None:
            with wrap():
                case.loss_fn(fwd(*case.inputs)).backward()
        else:
            case.loss_fn(fwd(*case.inputs)).backward()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        case.model.zero_grad(set_to_none=True)
    return {"step_ms": statistics.median(times) * 1e3, "max_memory_allocated": torch.cuda.max_memory_allocated()}


def _sac(case: Any) -> Any:
    from torch._functorch.partitioners import get_default_op_list
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    keep = get_default_op_list().compute_intensive_ops

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    blocks = next(m for m in case.model.modules() if isinstance(m, torch.nn.ModuleList))
    for i, block in enumerate(blocks):
        inner = block.forward

        def fwd(*a: Any, _inner: Any = inner, **k: Any) -> Any:
            return checkpoint(_inner, *a, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, policy), **k)

        blocks[i].forward = fwd
    return case.model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--size", default="350m")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--methods", default="plain,compiled,hooks,torch-budget,sac")
    ap.add_argument("--out", default="bench_results/compiled_gpu.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"no CUDA device: this check would measure {a.methods} on {a.model}-{a.size} at {a.budget}")
        sys.exit(2)
    frac = float(a.budget.rstrip("%")) / 100
    results: dict[str, Any] = {"model": f"{a.model}-{a.size}", "budget": a.budget, "device": torch.cuda.get_device_name(0),
                               "torch": torch.__version__, "methods": {}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for method in a.methods.split(","):
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        case = build_model(a.model, a.size, batch_size=a.batch_size, seq_len=a.seq_len, device="cuda")
        try:
            if method == "plain":
                got = _steps(case, torch.compile(case.model), a.steps)
            elif method == "compiled":
                backend = swapsched.CompileBackend(a.budget, "default")
                got = _steps(case, torch.compile(case.model, backend=backend), a.steps)
                got["report"] = str(backend.report())
            elif method == "hooks":
                rt = swapsched.SwapRuntime(a.budget, "default", model=case.model)
                got = _steps(case, case.model, a.steps, wrap=rt.step)
                got["report"] = str(rt.report())
                rt.close()
            elif method == "torch-budget":
                with torch._functorch.config.patch(activation_memory_budget=frac):
                    got = _steps(case, torch.compile(case.model), a.steps)
            elif method == "sac":
                got = _steps(case, _sac(case), a.steps)
            else:
                raise SystemExit(f"unknown method {method!r}")
        except Exception as exc:  # a failing method is a result: record it and go on
            got = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        results["methods"][method] = got
        out.write_text(json.dumps(results, indent=1))
        print(method, {k: v for k, v in got.items() if k not in ("report", "traceback")}, flush=True)
        if "report" in got:
            print(got["report"], flush=True)
        del case


if __name__ == "__main__":
    main()
