"""deploy.py: names become policies one layer above the runtime, which takes only objects."""

from __future__ import annotations

import pytest
import torch

from swapsched.agents.heuristics import Belady
from swapsched.deploy import SwapRuntime, resolve_policy
from swapsched.errors import UserError
from swapsched.runtime import swapper


def test_the_runtime_proper_refuses_a_name_and_says_where_names_go():
    with pytest.raises(UserError, match="swapsched.SwapRuntime or swapsched.get_policy"):
        swapper.PolicyRuntime(budget="60%", policy="min", backend="cpu")


def test_the_facade_resolves_names_and_passes_objects_through():
    rt = SwapRuntime(budget="60%", policy="min", backend="cpu")
    try:
        assert isinstance(rt.policy, Belady) and isinstance(rt, swapper.PolicyRuntime)
    finally:
        rt.close()
    obj = Belady()
    assert resolve_policy(obj) is obj and resolve_policy(None) is None


def test_without_a_policy_every_tensor_stays_until_use_plan():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    rt = swapper.PolicyRuntime(budget="100%", policy=None, backend="cpu", profile_steps=1, retime_steps=0)
    try:
        for _ in range(2):
            with rt.step():
                model(x).sum().backward()
        assert rt.plan is not None and rt.plan.evictions == () and rt.report().mode == "execute"
    finally:
        rt.close()


def test_the_runtime_gets_each_planner_by_its_name():
    from swapsched.deploy import resolve_policy

    assert resolve_policy("default").name == "default"  # joint: it recomputes only given the model
    assert resolve_policy("capuchin").name == "capuchin"
    assert resolve_policy("min").name == "min"


def test_a_plan_that_recomputes_needs_the_model_in_one_line():
    from swapsched.errors import UserError
    from swapsched.plan import SwapPlan
    from swapsched.runtime.swapper import PolicyRuntime as Inner
    from swapsched.zoo import build_model

    case = build_model("gpt", "tiny", seed=0)
    with Inner(budget="60%", policy=None, backend="cpu") as rt:  # no model: no modules, no blocks
        for _ in range(rt.profile_steps):
            with rt.step():
                case.loss().backward()
        assert rt.trace.segments == ()
        plan = SwapPlan("hand", "hand", (), recompute=("blocks.0",))
        with pytest.raises(UserError, match=r"recomputes 1 block\(s\) \(R9\): give the runtime the model"):
            rt.use_plan(plan)
