"""Plain-text tables of evaluation records (``swapsched compare``, benchmarks, ``train-policy``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from swapsched.agents.evaluate import CaseResult, PolicySummary

__all__ = ["format_table", "format_summary", "format_grid"]


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


def format_grid(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A plain-text table with aligned columns."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=False)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in body)])
