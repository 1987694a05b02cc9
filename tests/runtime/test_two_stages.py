"""runtime/two_stages.py, live on the CPU backend: after the first re-timing the policy's new plan
is on trial against the plan before it, and the faster measured one stays (``_keep_the_faster``);
a plan that recomputes blocks selectively runs with the training state moving (R9 with R13)."""

from __future__ import annotations

from typing import Any

import torch

from swapsched.agents.registry import get_policy
from swapsched.deploy import SwapRuntime
from swapsched.plan import SwapPlan
from swapsched.runtime.profiler import profile
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


class SelectiveFull:
    """Checkpoint-selective's blocks with every group's state ``full`` (fetched for each use)."""

    name = "selective-full"

    def plan(self, trace: Any, budget: int, hardware: Any) -> SwapPlan:
        p = get_policy("checkpoint-selective").plan(trace, budget, hardware)
        return SwapPlan.of(trace, self.name, p.evictions, recompute=p.recompute, selective=p.selective,
                           state={g.name: "full" for g in trace.state if not g.frozen}, host_step="after-backward")


def test_selectively_checkpointed_blocks_run_with_the_state_fetched_for_each_use():
    steps = 14
    # the state mover's fetch in a block's recompute ran inside selective checkpointing's mode,
    # which refuses any op its forward did not run: "aten.empty.memory_format encountered during
    # backward but not found in storage" (run --compare, gpt small, AdamW at 40%)
    a, b = build_model("gpt", "tiny", seed=3), build_model("gpt", "tiny", seed=3)
    opt_a, opt_b = torch.optim.AdamW(a.model.parameters(), lr=1e-3), torch.optim.AdamW(b.model.parameters(), lr=1e-3)
    # the budget test_swapper_state moves the state at: half the static bytes and twice the activations' floor
    c = build_model("gpt", "tiny", seed=3)  # profiled apart: the profile leaves gradients on its model
    trace = profile(c.model, c.inputs, c.loss_fn, name="gpt-tiny", state="adamw")
    budget = trace.static_bytes // 2 + 2 * (trace.min_feasible_bytes - trace.static_bytes)
    reports = []
    with SwapRuntime(budget=budget, policy=SelectiveFull(), backend="cpu", model=a.model, optimizer=opt_a) as rt:
        for i in range(steps):
            with rt.step():
                la = a.loss()
                la.backward()
            lb = b.loss()
            lb.backward()
            assert torch.equal(la, lb), f"step {i}: losses differ"
            for opt in (opt_a, opt_b):
                opt.step()
                opt.zero_grad()
            reports.append((rt.report(), rt.mover is not None))
        # R9's second stage profiled the steps with the blocks checkpointed selectively and the
        # state moving; those hold more than the budget, so the blocks then run whole (as
        # test_recompute's test_a_selective_plan_that_holds_more_than_the_budget_... says)
        assert any(r.selective_blocks and moving for r, moving in reports)
        rep = reports[-1][0]
        assert rep.mode == "execute" and rep.state is not None and {w for _, w in rep.state.placements} == {"full"}
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)
