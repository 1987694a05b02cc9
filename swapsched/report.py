"""Plain-text tables of evaluation records (``swapsched compare``, benchmarks, ``train-policy``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from swapsched.agents.evaluate import CaseResult, PolicySummary, StepRatio
from swapsched.budget import format_bytes

__all__ = ["format_table", "format_state", "format_summary", "format_ratios", "format_grid", "format_runs", "format_live"]


def _pct(x: float) -> str:
    """A fraction as a percentage to 0.1, with no '-0.0%' for what rounds to zero."""
    v = 100 * x
    return f"{0.0 if abs(v) < 0.05 else v:.1f}%"


def _cell(r: CaseResult | None) -> str:
    if r is None or r.skipped:
        return "n/a"
    if r.oom:
        return "OOM"
    return _pct(r.overhead) if r.overhead is not None else "n/a"


def format_table(results: Iterable[CaseResult], policies: Sequence[str]) -> str:
    """Rows = cases, columns = policies (overhead over the ideal step, or OOM), floor beside."""
    results = list(results)
    by = {(*r.case, r.policy): r for r in results}
    cases = list(dict.fromkeys(r.case for r in results))
    head = ["trace", "budget", "hardware", "floor", *policies]
    body = []
    for c in cases:
        mine = [by[(*c, p)] for p in policies if (*c, p) in by]
        floor = next((r.floor_overhead for r in mine if r.floor_overhead is not None), None)
        best = min((r.overhead for r in mine if r.overhead is not None), default=None)
        cells = []
        for p in policies:
            r = by.get((*c, p))
            s = _cell(r)
            if best is not None and r is not None and r.overhead is not None and r.overhead <= best + 1e-12:
                s += "*"
            cells.append(s)
        body.append([c[0], c[1], c[2], "-" if floor is None else _pct(floor), *cells])
    return format_grid(head, body) + ("\n(* = best in its row; overhead = step / ideal - 1; floor = R8's analytic bound over"
                                      " keep, swap and recompute;"
                                      " OOM = the plan does not fit the budget; n/a = the budget is below what any plan"
                                      " can meet on this trace, --json says the smallest feasible one; - = no floor)")


def format_state(results: Iterable[CaseResult], policies: Sequence[str]) -> str:
    """Per case and policy, what its plan did with the training state (R13-R16): parameters,
    gradients and optimizer state off the device, where the optimizer stepped, the host's step
    time and the host's peak (the state's and the swapped activations'; a sharded step's: its
    node's, R18), and a sharded step's collective time and the compute's wait for it; R19,
    where a plan rests any of it on the disk, what it rests there."""
    results = list(results)
    disk = any(r.result is not None and r.result.state is not None and r.result.state.disk_bytes for r in results)
    body = []
    for r in results:
        res = r.result
        if res is None or res.state is None or r.policy not in policies:
            continue
        st = res.state
        body.append([r.trace, r.budget, r.hardware, r.policy, "OOM" if res.oom else f"{1e3 * res.iteration_s:.3f}",
                     format_bytes(st.param_off_bytes), format_bytes(st.grad_off_bytes), format_bytes(st.optim_off_bytes),
                     st.where_stepped, f"{1e3 * st.host_step_s:.3f}",
                     format_bytes(res.node_host_peak_bytes) + (f" ({res.host_ranks} ranks)" if res.host_ranks > 1 else ""),
                     "-" if not st.gathered_bytes else f"{1e3 * st.collective_s:.1f} / {1e3 * st.collective_stall_s:.1f}"]
                    + ([format_bytes(st.disk_bytes) if st.disk_bytes else "-"] if disk else []))
    disk = ["on disk"] if disk else []
    return format_grid(["trace", "budget", "hardware", "policy", "step ms", "params off", "grads off", "optim off",
                        "stepped on", "host step ms", "host peak (node)", "collectives / stall ms", *disk], body)


def format_summary(summary: Sequence[PolicySummary]) -> str:
    """Per policy: mean overhead, wins, OOMs, skipped cases, planning time, and what its plans cost
    besides time: bytes copied out per step, and recompute (R9) as a share of the ideal step."""
    from swapsched.budget import format_bytes

    body = [[s.policy, "-" if math.isnan(s.mean_overhead) else _pct(s.mean_overhead),
             f"{s.won}/{s.cases}", str(s.oom), str(s.skipped), f"{1e3 * s.mean_plan_s:.1f} ms",
             "-" if math.isnan(s.mean_moved_bytes) else format_bytes(s.mean_moved_bytes),
             "-" if math.isnan(s.mean_recompute) else _pct(s.mean_recompute)]
            for s in summary]
    return format_grid(["policy", "mean overhead (solved)", "won", "OOM", "n/a", "plan time", "moved/step",
                        "recomputed"], body)


def format_ratios(ratios: Sequence[StepRatio]) -> str:
    """Per pair: one policy's step over a reference's (geometric mean, worst case), over the cases
    both fit; a best-of reference of more than two policies is shown as ``best baseline``."""
    body = [[r.policy, "best baseline" if r.reference.count(",") > 1 else r.reference, "-" if math.isnan(r.geomean) else f"{r.geomean:.3f}x",
             "-" if math.isnan(r.worst) else f"{r.worst:.3f}x" + (f" ({' '.join(r.worst_case)})" if r.worst_case else ""),
             str(r.cases), str(r.oom)] for r in ratios]
    return format_grid(["policy", "over", "step (geomean)", "worst", "cases", "OOM where it fits"], body)


def format_grid(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A plain-text table with aligned columns."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=False)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in body)])


def format_live(live: Any) -> str:
    """``run --compare``'s interleaved table (``run.LiveComparison``) and its verdict."""
    rows = [[r.method, f"{1e3 * r.step_s_median:.2f}", f"{r.ratio:.2f}x", f"{r.ratio_low:.2f}-{r.ratio_high:.2f}",
             format_bytes(r.peak_bytes), "yes" if r.fits else "no", "yes" if r.loss_matches else "NO", r.note]
            if r.peak_bytes else [r.method, "-", "-", "-", "-", "no", "-", r.note] for r in live.rows]
    table = format_grid(["method", "step ms (median)", "vs plain", "over rounds", "peak device", "fits",
                         "loss matches", "how"], rows)
    best = live.fastest
    verdict = (f"fastest that fits {format_bytes(live.budget_bytes)}: {best.method} ({best.ratio:.2f}x the plain step)"
               if best else f"no method fits {format_bytes(live.budget_bytes)}")
    return "\n".join([
        f"interleaved: {live.rounds} shuffled rounds of {live.round_steps} steps (forward, backward, optimizer step) per method; vs plain = median over rounds "
        "of the method's median step over plain's in the same round; peak by one meter for every method (CPU: live "
        "storages; CUDA: max_memory_allocated; a CPU row that moves the state: its runtime's audit meter, as its note "
        "says), the budget in bytes as the runtime resolves it on this model",
        table, verdict])


def format_runs(results: list[Any]) -> str:
    """``swapsched run``'s rows (``run.RunResult``), and why a plan was not followed (a method
    against plain training is ``run --compare``'s, :func:`format_live`)."""
    rows = []
    for r in results:
        peak = format_bytes(r.peak_device_bytes) if r.peak_device_bytes is not None else "-"
        budget = format_bytes(r.budget_bytes) if r.budget_bytes is not None else "-"
        pred = f"{1e3 * r.predicted_step_s:.2f}" if r.predicted_step_s is not None else "-"
        rows.append([r.method, f"{1e3 * r.step_s_median:.2f}", pred, peak, budget,
                     "yes" if r.loss_matches else "NO", {None: "-", True: "yes", False: "no"}[r.plan_followed], r.link])
    table = format_grid(["method", "step ms (median)", "predicted ms", "peak device", "budget",
                         "loss matches", "plan followed", "link"], rows)
    notes = [f"{r.method}: plan not followed: {r.why_not_followed}" for r in results
             if getattr(r, "why_not_followed", None)]
    return "\n".join([table, *notes])
