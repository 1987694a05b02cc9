"""Score policies on the simulator over traces x budgets x hardware: the records every table,
benchmark and training report is built from (``swapsched compare``, ``train-policy``'s held-out table).

Formatting lives one layer up (``swapsched.report``); this module only measures.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from swapsched.agents.registry import get_policy
from swapsched.agents.state_search import state_floor
from swapsched.budget import BudgetError, parse_budget
from swapsched.env.floors import joint_floor
from swapsched.env.result import SimResult
from swapsched.env.simulator import simulate
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.policy import Policy
from swapsched.trace import Trace

__all__ = ["Case", "CaseResult", "PolicySummary", "StepRatio", "compare", "feasible_cases", "run_policy", "step_ratio",
           "summarize"]


@dataclass(frozen=True)
class Case:
    trace: Trace
    budget: str
    hardware: Hardware


def feasible_cases(traces: Iterable[Trace], budgets: Sequence[str],
                   hardware: Sequence[Hardware]) -> Iterator[tuple[Trace, str, int, Hardware]]:
    """(trace, budget as given, its bytes, hardware) for every trace x budget x hardware, in that
    order, leaving out the budgets below what any plan can meet on the trace (the loop every
    benchmark and the training's validation run; ``compare`` records those as skipped instead)."""
    for trace in traces:
        for b in budgets:
            try:
                budget = parse_budget(b, trace)
            except BudgetError:
                continue
            for hw in hardware:
                yield trace, b, budget, hw


@dataclass(frozen=True)
class CaseResult:
    """One policy on one case: the simulated result, or why it was skipped (a budget below the
    feasible minimum)."""

    trace: str
    budget: str
    hardware: str
    policy: str
    result: SimResult | None = None
    plan_s: float | None = None
    floor_s: float | None = None
    skipped: str | None = None
    bound_s: float | None = None  # a proven lower bound on any plan's step, where the policy gives one (optimal)

    @property
    def case(self) -> tuple[str, str, str]:
        return (self.trace, self.budget, self.hardware)

    @property
    def oom(self) -> bool | None:
        return None if self.result is None else self.result.oom

    @property
    def overhead(self) -> float | None:
        """Step time over the ideal step, minus 1; ``None`` when skipped or out of memory."""
        if self.result is None or self.result.oom or not math.isfinite(self.result.overhead):
            return None
        return self.result.overhead

    @property
    def solved(self) -> bool:
        return self.overhead is not None

    @property
    def floor_overhead(self) -> float | None:
        return None if self.result is None or self.floor_s is None else self.floor_s / self.result.ideal_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {"trace": self.trace, "budget": self.budget, "hardware": self.hardware, "policy": self.policy}
        if self.result is None:
            row.update(skipped=self.skipped, oom=None, overhead=None)
            return row
        row.update(self.result.to_dict())
        row.update(plan_s=self.plan_s, floor_s=self.floor_s, floor_overhead=self.floor_overhead)
        if self.bound_s is not None:
            row.update(bound_s=self.bound_s, gap=(self.result.iteration_s - self.bound_s) / self.result.iteration_s)
        return row


@dataclass(frozen=True)
class PolicySummary:
    """Per policy over a set of cases: mean overhead over the cases it solved, cases won (best or
    tied), OOMs, skipped cases, mean planning time."""

    policy: str
    mean_overhead: float
    won: int
    oom: int
    skipped: int
    cases: int
    mean_plan_s: float
    # over the solved cases: bytes copied to the host per step, and recompute (R9) per step as a
    # fraction of the ideal step
    mean_moved_bytes: float = math.nan
    mean_recompute: float = math.nan
    max_plan_s: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "mean_overhead": self.mean_overhead, "won": self.won, "oom": self.oom,
                "skipped": self.skipped, "cases": self.cases, "mean_plan_s": self.mean_plan_s, "max_plan_s": self.max_plan_s,
                "mean_moved_bytes": self.mean_moved_bytes, "mean_recompute": self.mean_recompute}


@dataclass(frozen=True)
class StepRatio:
    """A policy's simulated step over a reference's, case by case: the geometric mean and the worst
    over the cases both fit, and the cases where the reference fits and the policy runs out of memory.
    The reference is one policy or, per case, the best of several (``best of min, capuchin``)."""

    policy: str
    reference: str
    geomean: float
    worst: float
    worst_case: tuple[str, str, str] | None
    cases: int
    oom: int

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "reference": self.reference, "geomean": self.geomean, "worst": self.worst,
                "worst_case": list(self.worst_case) if self.worst_case else None, "cases": self.cases, "oom": self.oom}


def run_policy(policy: Policy, trace: Trace, budget_bytes: int, hw: Hardware, record: bool = False) -> tuple[SwapPlan, SimResult, float]:
    """Plan (timed), check the plan against the trace (R7), and score it on the simulator."""
    t0 = time.perf_counter()
    plan = policy.plan(trace, budget_bytes, hw)
    plan_s = time.perf_counter() - t0
    plan.validate(trace)
    return plan, simulate(trace, plan, hw, budget_bytes, record=record, validate=False), plan_s


def compare(
    traces: Sequence[Trace],
    budgets: Sequence[str],
    hardware: Sequence[Hardware],
    policies: Sequence[str | Policy],
    *,
    seed: int = 0,
    search_seconds: float = 5.0,
    progress: bool = True,
) -> list[CaseResult]:
    """One result per trace x budget x hardware x policy (``skipped`` where a policy cannot answer).

    ``policies`` are registry names or policy objects (results then carry the object's ``name``)."""
    pols: dict[str, Policy] = {}
    for p in policies:
        pol = get_policy(p, seed=seed, search_seconds=search_seconds) if isinstance(p, str) else p
        pols[p if isinstance(p, str) else pol.name] = pol
    cases = [Case(t, b, h) for t in traces for b in budgets for h in hardware]
    out: list[CaseResult] = []
    bar = _progress(len(cases) * len(pols), progress)
    for case in cases:
        key = (case.trace.name, case.budget, case.hardware.name)
        try:
            budget_bytes = parse_budget(case.budget, case.trace)
        except BudgetError as exc:
            for name in pols:
                out.append(CaseResult(*key, name, skipped=str(exc)))
                bar.update(1)
            continue
        # below every plan, recomputing ones too, and moving the state where the trace records it
        floor = (state_floor if case.trace.state else joint_floor)(case.trace, budget_bytes, case.hardware)
        for name, pol in pols.items():
            bar.set_postfix_str(f"{case.trace.name} {case.budget} {name}", refresh=False)
            try:
                plan, res, plan_s = run_policy(pol, case.trace, budget_bytes, case.hardware)
            except BudgetError as exc:  # a planner that refuses the budget (default, where no placement fits)
                out.append(CaseResult(*key, name, skipped=str(exc)))
            else:
                out.append(CaseResult(*key, name, result=res, plan_s=plan_s, floor_s=floor, bound_s=plan.meta.get("bound_s")))
            bar.update(1)
    bar.close()
    return out


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="plan", leave=False, dynamic_ncols=True)


def summarize(results: Iterable[CaseResult], policies: Sequence[str]) -> list[PolicySummary]:
    """Per policy: mean overhead over cases it solved, cases won, OOMs, skipped, mean planning time."""
    results = list(results)
    best: dict[tuple[str, str, str], float] = {}
    for r in results:
        if r.overhead is not None:
            best[r.case] = min(best.get(r.case, math.inf), r.overhead)
    out = []
    for p in policies:
        mine = [r for r in results if r.policy == p]
        ok = [r.overhead for r in mine if r.overhead is not None]
        solved = [r.result for r in mine if r.overhead is not None and r.result is not None]
        timed = [r.plan_s for r in mine if r.plan_s is not None]
        out.append(PolicySummary(
            policy=p,
            mean_overhead=sum(ok) / len(ok) if ok else math.nan,
            won=sum(1 for r in mine if r.overhead is not None and r.overhead <= best[r.case] + 1e-12),
            oom=sum(1 for r in mine if r.oom),
            skipped=sum(1 for r in mine if r.skipped),
            cases=len(mine),
            mean_plan_s=sum(timed) / max(1, len(timed)),
            mean_moved_bytes=sum(x.d2h_bytes for x in solved) / len(solved) if solved else math.nan,
            mean_recompute=sum(x.recompute_s / x.ideal_s for x in solved) / len(solved) if solved else math.nan,
            max_plan_s=max(timed, default=math.nan),
        ))
    return out


def step_ratio(results: Iterable[CaseResult], policy: str, references: Sequence[str]) -> StepRatio:
    """``policy``'s step over the best of ``references`` on each case (see :class:`StepRatio`)."""
    if not references:
        raise ValueError("step_ratio needs at least one reference policy")
    steps: dict[tuple[str, str, str], dict[str, float | None]] = {}
    for r in results:
        if r.result is not None and (r.policy == policy or r.policy in references):
            steps.setdefault(r.case, {})[r.policy] = None if r.result.oom else r.result.iteration_s
    logs, worst, worst_case, oom = [], -math.inf, None, 0
    for case, by in steps.items():
        fits = [v for p in references if (v := by.get(p)) is not None]
        if not fits or policy not in by:
            continue
        mine = by[policy]
        if mine is None:
            oom += 1
            continue
        ratio = mine / min(fits)
        logs.append(math.log(ratio))
        if ratio > worst:
            worst, worst_case = ratio, case
    name = references[0] if len(references) == 1 else "best of " + ", ".join(references)
    return StepRatio(policy, name, math.exp(sum(logs) / len(logs)) if logs else math.nan,
                     worst if logs else math.nan, worst_case, len(logs), oom)
