"""runtime/two_stages.py, live on the CPU backend: after the first re-timing the policy's new plan
is on trial against the plan before it, and the faster measured one stays (``_keep_the_faster``)."""

from __future__ import annotations

from typing import Any

from swapsched.agents.registry import get_policy
from swapsched.deploy import SwapRuntime
from swapsched.plan import SwapPlan
from swapsched.runtime.two_stages import KEEP_SLOWER
from swapsched.zoo import build_model


class Scripted:
    """A policy whose k-th plan is ``plans[k]`` (the last one after that), made on the trace given."""

    name = "scripted"

    def __init__(self, *plans: str):
        self.plans, self.k = plans, 0

    def plan(self, trace: Any, budget: int, hardware: Any) -> SwapPlan:
        name = self.plans[min(self.k, len(self.plans) - 1)]
        self.k += 1
        return get_policy(name).plan(trace, budget, hardware)


def _steps(policy: Scripted, steps: int) -> tuple[SwapRuntime, list[Any]]:
    case = build_model("gpt", "tiny", seed=3)
    # a slow link (2 MB/s): swapping every saved tensor stalls each step for tens of milliseconds
    rt = SwapRuntime(budget="100%", policy=policy, backend="cpu", bandwidth=2e6, model=case.model)
    reports = []
    with rt:
        for _ in range(steps):
            with rt.step():
                case.loss().backward()
            case.model.zero_grad(set_to_none=True)
            reports.append(rt.report())
    return rt, reports


def test_a_new_plan_that_measures_slower_than_the_one_before_gives_way_to_it():
    # no-swap first (nothing moves: its steps are the compute), then swap-all on the re-timed
    # trace: its copies stall every step, far beyond KEEP_SLOWER, so no-swap is back for good
    rt, reports = _steps(Scripted("no-swap", "swap-all"), 16)
    moved = [r.evicted_bytes > 0 for r in reports if r.mode == "execute"]
    assert any(moved), "swap-all never ran"
    assert not any(moved[-4:]), f"swap-all stayed: {moved}"
    assert rt.plan is not None and rt.plan.policy == "no-swap" and rt.settled
    assert KEEP_SLOWER < 0.1  # the margin is the rounds' noise, far below swap-all's stalls here


def test_a_new_plan_that_measures_faster_stays():
    # swap-all first (slow), no-swap on the re-timed trace: it stays, and it is the last word
    rt, reports = _steps(Scripted("swap-all", "no-swap", "swap-all"), 16)
    # swap-all moves activations and gpt has blocks a plan could recompute: its compute is timed unhooked
    assert [r.mode for r in reports].count("timing") == 2
    assert rt.plan is not None and rt.plan.policy == "no-swap" and rt.settled
    assert all(r.evicted_bytes == 0 for r in reports[-4:])


class Recording(Scripted):
    """``Scripted``, keeping whether each trace it was given had blocks it could checkpoint selectively."""

    def __init__(self, *plans: str):
        super().__init__(*plans)
        self.selective_offered: list[bool] = []

    def plan(self, trace: Any, budget: int, hardware: Any) -> SwapPlan:
        self.selective_offered.append(any(sg.cheap for sg in trace.segments))
        return super().plan(trace, budget, hardware)


def test_a_selective_plan_that_loses_its_trial_is_followed_by_one_planned_without_selective_blocks():
    # no-swap first; on the re-timed trace every block checkpointed selectively, whose swaps
    # (planned on the steps as they then run) are swap-all's on a 2 MB/s link: it loses its trial
    # and no-swap is back; then the policy plans once more with no block offered selectively
    # (checkpoint-all here), and that plan is on trial against no-swap in turn
    policy = Recording("no-swap", "checkpoint-selective", "swap-all", "checkpoint-all", "no-swap")
    rt, reports = _steps(policy, 40)
    assert policy.k >= 5, f"the policy planned {policy.k} times"
    assert policy.selective_offered[1] and not policy.selective_offered[3], policy.selective_offered
    assert any(r.selective_blocks for r in reports), "the selective plan never ran"
    whole = [r for r in reports if r.recomputed_blocks and not r.selective_blocks]
    assert whole and whole[-1].mode == "execute", "the plan without selective blocks never ran"
    assert rt.settled and not policy.selective_offered[-1]
