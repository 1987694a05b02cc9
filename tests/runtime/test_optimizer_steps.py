"""The user's optimizer steps, timed (R15): the rate the profiling steps' steps ran at, the
optimizer's own hooks inside, other optimizers left out; and what the runtime does with them."""

from __future__ import annotations

import time

import pytest
import torch

from swapsched.deploy import SwapRuntime
from swapsched.runtime.backends import CpuBackend
from swapsched.runtime.optimizer_steps import OptimizerSteps
from swapsched.runtime.profiler import profile
from swapsched.state import MEASURED_OPTIMIZER_RATES
from swapsched.zoo import build_model


class Sleepy(torch.optim.Optimizer):
    """An optimizer whose step takes ``seconds[k]`` at its k-th step (the last one after that)."""

    def __init__(self, params, seconds: list[float]):
        super().__init__(params, {})
        self.seconds, self.k = seconds, 0

    def step(self, closure=None):  # type: ignore[override]
        time.sleep(self.seconds[min(self.k, len(self.seconds) - 1)])
        self.k += 1


@pytest.fixture
def backend():
    b = CpuBackend()
    yield b
    b.shutdown()


def test_the_rate_is_the_parameters_over_the_steps_after_the_first(backend):
    params = [torch.nn.Parameter(torch.zeros(1000)), torch.nn.Parameter(torch.zeros(1000), requires_grad=False)]
    opt = Sleepy(params, [0.2, 0.05])
    other = Sleepy([torch.nn.Parameter(torch.zeros(10))], [0.3])
    steps = OptimizerSteps(opt, backend)
    try:
        assert steps.params == 1000  # the frozen one does not step
        assert steps.rates(emulated=True) is None  # nothing timed yet
        for k in range(3):
            opt.step()
            other.step()  # another optimizer's steps are not this one's
            assert steps.last_s() is not None and 0.05 <= steps.last_s() < 0.3  # type: ignore[operator]
            steps.settle(profiling=k < 2, on_host=False)
            assert steps.last_s() is None  # taken by settle
        # the first (0.2 s: it would make the optimizer's state) left out; the third followed no profiling step
        assert len(steps.profiled) == 2 and steps.profiled[0][0] >= 0.2 > steps.profiled[1][0] >= 0.05
        rates = steps.rates(emulated=True)
        assert rates is not None and rates["device"] == rates["host"]
        assert 1000 / 0.2 < rates["device"] <= 1000 / 0.05
        assert set(steps.rates(emulated=False) or {}) == {"device"}
    finally:
        steps.remove()
    opt.step()
    assert steps.last_s() is None  # removed: no longer timed


def test_steps_dropped_without_remove_keep_nothing_alive(backend):
    import gc
    import weakref

    opt = Sleepy([torch.nn.Parameter(torch.zeros(10))], [0.0])
    gone = weakref.ref(OptimizerSteps(opt, backend))  # never removed: its hooks stay registered
    gc.collect()
    assert gone() is None
    opt.step()  # the hooks find nothing and do nothing


def test_the_optimizers_own_hooks_are_inside_its_time_and_where_it_stepped_is_kept(backend):
    opt = Sleepy([torch.nn.Parameter(torch.zeros(100))], [0.0])
    opt.register_step_post_hook(lambda *a: time.sleep(0.1))  # as the state mover's copies back are
    steps = OptimizerSteps(opt, backend)
    try:
        opt.step()
        assert steps.last_s() >= 0.1  # type: ignore[operator]
        steps.settle(profiling=True, on_host=True)
        assert set(steps.rates(emulated=False) or {}) == {"host"}
    finally:
        steps.remove()


def test_a_runtime_that_moves_the_state_plans_on_the_users_optimizer_and_reports_its_step():
    case = build_model("gpt", "tiny", seed=3)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    trace = profile(case.model, case.inputs, case.loss_fn, name="gpt-tiny", state="adamw")
    budget = trace.static_bytes // 2 + 2 * (trace.min_feasible_bytes - trace.static_bytes)
    with SwapRuntime(budget=budget, policy="default", model=case.model, optimizer=opt, backend="cpu") as rt:
        for _ in range(rt.profile_steps + 2):
            with rt.step():
                case.loss().backward()
            assert rt.report().optimizer_step_s is None  # not stepped since
            opt.step()
            opt.zero_grad()
            rep = rt.report()
            assert rep.optimizer_step_s is not None and rep.optimizer_step_s > 0
        assert rep.mode == "execute" and rep.predicts_optimizer_step
        assert rep.measured_s == pytest.approx(rep.step_s + rep.optimizer_step_s)
        assert "its optimizer step" in str(rep)
        rates = rt.trace.meta[MEASURED_OPTIMIZER_RATES] if rt.trace is not None else None
        assert rates is not None and rates["device"] == rates["host"] > 0  # the emulated device is the host
