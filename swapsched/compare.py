"""Run several policies on the same cases and tabulate them (``swapsched compare``)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from swapsched.agents.optimal import TooLargeError
from swapsched.agents.registry import Policy, get_policy
from swapsched.budget import BudgetError, parse_budget
from swapsched.env.simulator import SimResult, analytic_floor, simulate
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.trace import Trace

__all__ = ["Case", "compare", "run_policy", "format_table", "summarize", "format_summary", "format_grid"]


@dataclass(frozen=True)
class Case:
    trace: Trace
    budget: str
    hardware: Hardware


def run_policy(policy: Policy, trace: Trace, budget_bytes: int, hw: Hardware, record: bool = False) -> tuple[SwapPlan, SimResult, float]:
    t0 = time.perf_counter()
    plan = policy.plan(trace, budget_bytes, hw)
    plan_s = time.perf_counter() - t0
    plan.validate(trace)
    return plan, simulate(trace, plan, hw, budget_bytes, record=record, validate=False), plan_s


def compare(
    traces: Sequence[Trace],
    budgets: Sequence[str],
    hardware: Sequence[Hardware],
    policies: Sequence["str | Policy"],
    *,
    seed: int = 0,
    search_seconds: float = 5.0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per trace x budget x hardware x policy (``skipped`` where a policy cannot answer).

    ``policies`` are registry names or policy objects (rows then carry the object's ``name``)."""
    pols = {}
    for p in policies:
        pol = get_policy(p, seed=seed, search_seconds=search_seconds) if isinstance(p, str) else p
        pols[p if isinstance(p, str) else pol.name] = pol
    cases = [Case(t, b, h) for t in traces for b in budgets for h in hardware]
    rows: list[dict[str, Any]] = []
    bar = _progress(len(cases) * len(pols), progress)
    for case in cases:
        try:
            budget_bytes = parse_budget(case.budget, case.trace)
        except BudgetError as exc:
            for name in pols:
                rows.append(_row(case, name, skipped=str(exc)))
                bar.update(1)
            continue
        floor = analytic_floor(case.trace, budget_bytes, case.hardware)
        for name, pol in pols.items():
            bar.set_postfix_str(f"{case.trace.name} {case.budget} {name}", refresh=False)
            try:
                _, res, plan_s = run_policy(pol, case.trace, budget_bytes, case.hardware)
            except TooLargeError as exc:
                rows.append(_row(case, name, skipped=str(exc)))
            else:
                row = _row(case, name)
                row.update(res.to_dict())
                row.update(plan_s=plan_s, floor_s=floor, floor_overhead=floor / res.ideal_s - 1.0)
                rows.append(row)
            bar.update(1)
    bar.close()
    return rows


def _row(case: Case, policy: str, skipped: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"trace": case.trace.name, "budget": case.budget, "hardware": case.hardware.name, "policy": policy}
    if skipped:
        row.update(skipped=skipped, oom=None, overhead=None)
    return row


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="plan", leave=False, dynamic_ncols=True)


def _cell(r: dict[str, Any] | None) -> str:
    if r is None or r.get("skipped"):
        return "n/a"
    if r["oom"]:
        return "OOM"
    return f"{100 * r['overhead']:.1f}%"


def format_table(rows: Iterable[dict[str, Any]], policies: Sequence[str]) -> str:
    """Rows = cases, columns = policies (overhead over the ideal step, or OOM), floor beside."""
    rows = list(rows)
    by = {(r["trace"], r["budget"], r["hardware"], r["policy"]): r for r in rows}
    cases = list(dict.fromkeys((r["trace"], r["budget"], r["hardware"]) for r in rows))
    head = ["trace", "budget", "hardware", "floor", *policies]
    body = []
    for c in cases:
        floor = next((by[(*c, p)].get("floor_overhead") for p in policies if by.get((*c, p), {}).get("floor_overhead") is not None), None)
        best = min((by[(*c, p)]["overhead"] for p in policies if _ok(by.get((*c, p)))), default=None)
        cells = []
        for p in policies:
            r = by.get((*c, p))
            s = _cell(r)
            if best is not None and _ok(r) and r["overhead"] <= best + 1e-12:
                s += "*"
            cells.append(s)
        body.append([c[0], c[1], c[2], "-" if floor is None else f"{100 * floor:.1f}%", *cells])
    return format_grid(head, body) + "\n(* = best in its row; overhead = step / ideal - 1; floor = R8 analytic bound)"


def _ok(r: dict[str, Any] | None) -> bool:
    return bool(r) and not r.get("skipped") and not r["oom"] and r["overhead"] is not None


def summarize(rows: Iterable[dict[str, Any]], policies: Sequence[str]) -> list[dict[str, Any]]:
    """Per policy: mean overhead over cases it solved, cases won, OOMs, skipped, mean planning time."""
    rows = list(rows)
    by_case: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        by_case.setdefault((r["trace"], r["budget"], r["hardware"]), []).append(r)
    out = []
    for p in policies:
        mine = [r for r in rows if r["policy"] == p]
        ok = [r for r in mine if _ok(r)]
        won = 0
        for case_rows in by_case.values():
            best = min((r["overhead"] for r in case_rows if _ok(r)), default=None)
            if best is not None and any(r["policy"] == p and _ok(r) and r["overhead"] <= best + 1e-12 for r in case_rows):
                won += 1
        out.append({
            "policy": p,
            "mean_overhead": sum(r["overhead"] for r in ok) / len(ok) if ok else math.nan,
            "won": won,
            "oom": sum(1 for r in mine if r.get("oom")),
            "skipped": sum(1 for r in mine if r.get("skipped")),
            "cases": len(mine),
            "mean_plan_s": sum(r["plan_s"] for r in mine if "plan_s" in r) / max(1, sum(1 for r in mine if "plan_s" in r)),
        })
    return out


def format_summary(summary: Sequence[dict[str, Any]]) -> str:
    body = [[s["policy"], "-" if math.isnan(s["mean_overhead"]) else f"{100 * s['mean_overhead']:.1f}%",
             f"{s['won']}/{s['cases']}", str(s["oom"]), str(s["skipped"]), f"{1e3 * s['mean_plan_s']:.1f} ms"]
            for s in summary]
    return format_grid(["policy", "mean overhead (solved)", "won", "OOM", "n/a", "plan time"], body)


def format_grid(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A plain-text table with aligned columns."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in body)])
