"""runtime/swapper.py on the CPU backend: bit-identical training, budget, safety, divergence, leaks."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swapsched.deploy import SwapRuntime
from swapsched.errors import UserError
from swapsched.plan import Eviction, SwapPlan
from swapsched.zoo import build_model
from tests.conftest import step_reports, train_together

POLICIES = ["no-swap", "swap-all", "vdnn-all", "vdnn-conv", "min", "capuchin", "swapadvisor", "default"]


def _train_pair(family, size, runtime_kwargs, steps=5, seed=1):
    """Train two identical models, one under the runtime; return (all equal, runtime)."""
    a = build_model(family, size, seed=seed)
    b = build_model(family, size, seed=seed)
    opt_a = torch.optim.SGD(a.model.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(b.model.parameters(), lr=0.01)
    rt = SwapRuntime(model=a.model, **runtime_kwargs)
    equal = True
    try:
        for _ in range(steps):
            with rt.step():
                la = a.loss()
                la.backward()
            lb = b.loss()
            lb.backward()
            equal &= torch.equal(la, lb)
            equal &= all(torch.equal(p.grad, q.grad) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=False))
            opt_a.step(), opt_b.step()
            opt_a.zero_grad(), opt_b.zero_grad()
    finally:
        rt.close()
    return equal, rt


@pytest.mark.parametrize("family", ["mlp", "resnet", "gpt"])
@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_bit_identical_and_budget_kept(family, policy):
    # budgets these small models can meet, what their backward holds beyond saved tensors counted (R3)
    kwargs = dict(budget={"mlp": "85%", "resnet": "70%", "gpt": "50%"}[family], policy=policy, backend="cpu", bandwidth=4e9, min_bytes=0)
    if policy == "swapadvisor":
        from swapsched.agents import SwapAdvisor

        kwargs["policy"] = SwapAdvisor(search_seconds=0.5, generations=3)
    equal, rt = _train_pair(family, "tiny", kwargs, steps=5)
    assert equal
    rep = rt.report()
    assert rep.mode == "execute" and rep.peak_device_bytes <= rep.budget_bytes  # exact accounting, guard included
    if policy not in ("no-swap", "vdnn-all", "vdnn-conv"):  # budget-aware: no guard needed
        assert rep.plan_followed and rep.guard_evictions == 0


def test_infeasible_budget_is_a_clear_error_after_profiling():
    from swapsched.budget import BudgetError

    with pytest.raises(BudgetError, match="smallest feasible budget"):
        _train_pair("vgg", "tiny", dict(budget="10%", policy="min", backend="cpu", min_bytes=0), steps=5)


@pytest.mark.parametrize("budget", ["70%", "85%", "100%"])
def test_several_budgets(budget):
    equal, rt = _train_pair("resnet", "tiny", dict(budget=budget, policy="min", backend="cpu", min_bytes=0), steps=5)
    assert equal and rt.report().peak_device_bytes <= rt.report().budget_bytes


def test_guard_keeps_a_budget_blind_plan_within_budget():
    # no-swap under 40% would not fit (gpt's forward holds more than its weights' gradients, which
    # a relative budget counts static: R3): the guard evicts on the spot (MIN rule) and says so
    equal, rt = _train_pair("gpt", "tiny", dict(budget="40%", policy="no-swap", backend="cpu", min_bytes=0), steps=5)
    rep = rt.report()
    assert equal and rep.guard_evictions > 0 and not rep.plan_followed
    assert rep.peak_device_bytes <= rep.budget_bytes


@dataclass
class RandomPlans:
    """A policy returning a random R7-valid plan (any swap-out event, any prefetch event)."""

    seed: int
    name: str = "random"

    def plan(self, trace, budget, hardware):
        rng = np.random.default_rng(self.seed)
        evs = []
        for k in range(trace.n_tensors):
            if rng.random() < 0.6:
                fp, fu = int(trace.first_pack[k]), int(trace.first_unpack[k])
                so = int(rng.integers(fp, fu))
                evs.append(Eviction(k, so, int(rng.integers(so, fu + 1))))
        return SwapPlan.of(trace, self.name, evs)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), family=st.sampled_from(["mlp", "resnet", "gpt", "unet"]),
       budget=st.sampled_from(["80%", "90%", "100%"]))
def test_random_valid_plans_keep_gradients_identical(seed, family, budget):
    equal, rt = _train_pair(family, "tiny", dict(budget=budget, policy=RandomPlans(seed), backend="cpu", min_bytes=0,
                                                 profile_steps=1), steps=3)
    rep = rt.report()
    # a budget-blind plan may need the guard, never more memory than the budget
    assert equal and rep.mode == "execute" and rep.peak_device_bytes <= rep.budget_bytes


@dataclass
class PrefetchAtOnce:
    """Every tensor swapped out where it is made and prefetched right away: under a tight budget
    the prefetches hold the room that later tensors need."""

    name: str = "prefetch-at-once"

    def plan(self, trace, budget, hardware):
        return SwapPlan.of(trace, self.name, [Eviction(k, int(trace.first_pack[k]), int(trace.first_pack[k]))
                                              for k in range(trace.n_tensors)])


@pytest.mark.parametrize("family, budget", [("resnet", "75%"), ("gpt", "50%")])
def test_guard_takes_back_a_prefetch_that_came_too_early(family, budget):
    equal, rt = _train_pair(family, "tiny", dict(budget=budget, policy=PrefetchAtOnce(), backend="cpu", min_bytes=0,
                                                 profile_steps=1), steps=3)
    rep = rt.report()
    assert equal and rep.guard_evictions > 0 and not rep.plan_followed
    assert rep.peak_device_bytes <= rep.budget_bytes


class Tricky(nn.Module):
    """Views, non-contiguous saved tensors, one storage saved twice, several dtypes."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lin = nn.Linear(16, 16).double()
        self.lin2 = nn.Linear(8, 4)

    def forward(self, idx):
        x = self.emb(idx)  # saves int64 indices
        y = x.transpose(0, 1)  # non-contiguous view
        z = (y * y.sin()).transpose(0, 1)  # y saved twice (mul, sin): one storage
        d = self.lin(z.double()).relu()  # float64
        h = d.float()[:, :, :8]  # a view of a slice
        return self.lin2(h * h).sum() + x.bfloat16().float().sum()


def test_views_noncontiguous_shared_storage_and_dtypes():
    torch.manual_seed(0)
    a, b = Tricky(), Tricky()
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 50, (6, 5))
    rt = SwapRuntime(budget="90%", policy="swap-all", backend="cpu", min_bytes=0, model=a)
    for _ in range(5):
        with rt.step():
            la = a(idx)
            la.backward()
        lb = b(idx)
        lb.backward()
        assert torch.equal(la, lb)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=False))
    assert rt.report().mode == "execute" and rt.report().evicted_bytes > 0
    rt.close()


def test_exception_inside_step_leaves_nothing_held_and_next_step_works():
    case = build_model("mlp", "small", seed=2)
    rt = SwapRuntime(budget="70%", policy="swap-all", backend="cpu", min_bytes=0, model=case.model, tune=False)
    for _ in range(5):
        with rt.step():
            case.loss().backward()
    idle = rt.backend.pool.idle_bytes
    with pytest.raises(RuntimeError, match="boom"), rt.step():
        loss = case.loss()
        raise RuntimeError("boom")
    del loss
    assert rt.backend.pool.idle_bytes == idle  # every host buffer came back to the pool
    assert rt._exec is None
    with rt.step():
        case.loss().backward()
    assert rt.report().mode == "execute"
    rt.close()


def test_exception_in_the_profiling_step_returns_its_buffers():
    case = build_model("mlp", "small", seed=2)
    rt = SwapRuntime(budget="70%", policy="swap-all", backend="cpu", min_bytes=0, model=case.model, tune=False)
    with pytest.raises(ValueError, match="bad batch"), rt.step():
        case.loss().backward()
        raise ValueError("bad batch")
    assert rt.backend.pool.idle_bytes == rt.backend.pool.allocated_bytes > 0
    rt.close()


def _fixed_first(model: nn.Module, x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """A step whose first saved tensor does not depend on the batch (``sin`` saves ``first * 1``),
    so that a batch of another size leaves the trace after its first event, not at it."""
    return (first * 1.0).sin().sum() + model(x).sum()


def test_a_new_shape_is_profiled_in_the_step_that_shows_it_and_each_shape_keeps_its_plan():
    case = build_model("mlp", "small", seed=4)
    ref = build_model("mlp", "small", seed=4)
    x0 = case.inputs[0]
    x1 = torch.randn(x0.shape[0] - 3, *x0.shape[1:])  # smaller: a shape of its own
    rt = SwapRuntime(budget="70%", policy="capuchin", backend="cpu", min_bytes=0, model=case.model, retime_steps=0)

    def run(model, i):
        loss = model(x1 if i in (4, 5, 7) else x0).sum()
        loss.backward()
        if model is ref.model and i == 4:
            # x1's first plan is borrowed from x0 and needs the guard under x1's smaller 70% (its
            # weights' gradients do not shrink with the batch): the policy's own is searched in the
            # background, awaited here so that x1's next step runs it however fast the search is
            rt.wait_for_plans()
        return loss

    try:
        reports = train_together(case.model, ref.model, rt, 9, run)
        # 3 profiled, then x0 runs its plan; x1's first step profiles x1 as it runs, planned at its end;
        # from then on each batch size executes its own plan
        assert [r.mode for r in reports] == ["profile"] * 3 + ["execute", "profile", "execute", "execute", "execute",
                                                               "execute"]
        assert reports[4].new_shape and "a shape no plan was made for" in str(reports[4])
        assert all(r.plan_followed for r in reports[5:]) and len(rt.layouts) == 2
        run_ = reports[-1].run
        assert run_.shapes == 2 and run_.new_shapes == 1 and "plans for 2 shapes" in str(run_)
        # a relative budget is each shape's own: the smaller batch runs under fewer bytes
        assert reports[5].budget_bytes < reports[3].budget_bytes
    finally:
        rt.close()


def test_divergence_finishes_on_demand_and_replans():
    case = build_model("mlp", "small", seed=4)
    ref = build_model("mlp", "small", seed=4)
    first = torch.randn(16, 16, requires_grad=True)
    rt = SwapRuntime(budget="70%", policy="capuchin", backend="cpu", min_bytes=0, model=case.model, tune=False)
    for _ in range(5):
        with rt.step():
            _fixed_first(case.model, case.inputs[0], first).backward()
        _fixed_first(ref.model, case.inputs[0], first).backward()
    # a different batch size after the same first tensor: the events no longer match the trace
    x = torch.randn(5, 256)
    with rt.step():
        la = _fixed_first(case.model, x, first)
        la.backward()
    lb = _fixed_first(ref.model, x, first)
    lb.backward()
    rep = rt.report()
    assert rep.mode == "diverged" and torch.equal(la, lb) and not rep.plan_followed
    # where: the second pack already has another batch size, so other bytes
    assert rep.divergence is not None and rep.divergence.event == 1
    assert rep.divergence.expected.startswith("pack of tensor 1") and rep.divergence.seen.startswith("pack of tensor 1")
    assert rep.divergence.expected != rep.divergence.seen and "diverged at event 1" in str(rep)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(case.model.parameters(), ref.model.parameters(), strict=False))
    with rt.step():  # re-profiled
        _fixed_first(case.model, x, first).backward()
    assert rt.report().mode == "profile" and not rt.report().new_shape
    with rt.step():  # one profiling step is enough once the runtime has warmed up
        _fixed_first(case.model, x, first).backward()
    assert rt.report().mode == "execute"
    rt.close()


def test_five_hundred_steps_do_not_leak():
    """Every step ends with the accounting back at zero and every host buffer back in the pool, and
    the pool stops growing. (The peak itself depends on when copies complete, so it is only
    checked against the budget: under load a swap-out can still be in flight at a later event.)"""
    case = build_model("mlp", "small", seed=5)
    rt = SwapRuntime(budget="70%", policy="capuchin", backend="cpu", min_bytes=0, model=case.model, tune=False)
    pool = rt.backend.pool
    sizes = set()
    for i in range(500):
        with rt.step():
            ex = rt._exec
            case.loss().backward()
        rep = rt.report()
        assert ex.used == 0 and pool.idle_bytes == pool.allocated_bytes, i
        if rep.mode == "execute":
            assert rep.plan_followed and rep.peak_device_bytes <= rep.budget_bytes
            sizes.add(pool.allocated_bytes)
    assert len(sizes) == 1  # no host allocation after the profiling steps
    rt.close()


def test_report_before_any_step_is_an_error():
    from swapsched.errors import UserError

    with pytest.raises(UserError, match="no step has run"):
        SwapRuntime(budget="70%", policy="min", backend="cpu").report()


def test_cpu_runtime_retimes_its_trace_from_executed_steps():
    case = build_model("gpt", "tiny")
    rt = SwapRuntime(budget="100%", policy="no-swap", backend="cpu", model=case.model, retime_steps=2)
    reports = step_reports(rt, case, rt.profile_steps + 1)
    profiled, predicted = rt.trace, rt.predicted_s
    assert "timed_by_execution" not in profiled.meta and rt.hardware.hook_cost_s == 0
    with rt.step():
        case.loss().backward()
    rep = rt.report()
    reports.append(rep)
    assert rt.trace.meta["timed_by_execution"] == 2
    assert [(e.kind, e.tensor) for e in rt.trace.events] == [(e.kind, e.tensor) for e in profiled.events]
    # uncalibrated hardware: the hooks' cost is fitted from the same two steps (no copy: every event is plain)
    n = rt.trace.n_events
    assert rt.hardware.hook_cost_s == pytest.approx(np.median([r.hook_s for r in reports[-2:]]) / n, rel=1e-12)
    # no-swap moves nothing: the runtime runs it without hooks, and its prediction pays none (R6/R8)
    assert rt.predicted_s != predicted and rt.predicted_s == pytest.approx(rt.trace.ideal_s, rel=1e-9)
    # the re-timed compute plus the hooks is what the step measured, less the tail of the step
    assert 0 < rep.hook_s < rep.step_s and rep.copies == 0 and rep.waits == 0
    rt.close()


def test_report_counts_copies_and_use_plan_takes_a_budget():
    case = build_model("mlp", "small")
    rt = SwapRuntime(budget="100%", policy="no-swap", backend="cpu", model=case.model)
    for _ in range(rt.profile_steps):
        with rt.step():
            case.loss().backward()
    from swapsched.agents.registry import get_policy

    budget = rt.budget_bytes
    plan = get_policy("swap-all").plan(rt.trace, budget, rt.hardware)
    rt.use_plan(plan, budget="100%")
    assert rt.budget_bytes == budget
    with rt.step():
        case.loss().backward()
    rep = rt.report()
    assert rep.plan_followed and rep.copies == 2 * len(plan.evictions) > 0
    # a wait is on one copy's ticket (an unpack's swap-in, or the oldest swap-out when room is
    # short), and a ticket is retired once waited on
    assert rep.waits <= rep.copies
    rt.close()


class ChangedInPlace(nn.Module):
    """``sin`` saves ``a``; with ``bump`` on, ``a`` is then changed in place, which plain autograd
    refuses in backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.out = nn.Linear(64, 1)
        self.bump = False

    def forward(self, x):
        a = self.lin(x)
        b = a.sin()
        if self.bump:
            a.mul_(2)
        return self.out(b.relu()).sum()


@pytest.mark.parametrize("policy", ["no-swap", "swap-all"])
@pytest.mark.parametrize("at_step", [1, 4])  # the profiling step, an executed step
def test_a_saved_tensor_changed_in_place_is_refused_as_autograd_refuses_it(policy, at_step):
    torch.manual_seed(0)
    m, x = ChangedInPlace(), torch.randn(32, 64)
    m.bump = True
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        m(x).backward()  # what plain autograd says
    m.bump = False
    rt = SwapRuntime(budget="100%", policy=policy, backend="cpu", min_bytes=0, model=m, profile_steps=1)
    try:
        for _ in range(1, at_step):
            with rt.step():
                m(x).backward()
        if at_step > 1:
            rep = rt.report()
            assert rep.mode == "execute" and (rep.evicted_bytes > 0) == (policy == "swap-all")
        m.bump = True
        with pytest.raises(RuntimeError, match="modified by an inplace operation"), rt.step():
            m(x).backward()
        m.bump = False
        with rt.step():  # the runtime is usable after the refusal
            m(x).backward()
    finally:
        rt.close()


def test_strict_raises_where_the_step_leaves_its_trace_and_the_next_step_works():
    from swapsched.runtime.swapper import DivergenceError

    case = build_model("mlp", "small", seed=4)
    rt = SwapRuntime(budget="70%", policy="min", backend="cpu", min_bytes=0, model=case.model, strict=True)
    first = torch.randn(16, 16, requires_grad=True)
    try:
        for _ in range(4):
            with rt.step():
                _fixed_first(case.model, case.inputs[0], first).backward()
        assert rt.report().mode == "execute" and rt.report().divergence is None
        with pytest.raises(DivergenceError, match=r"at event 1 the trace expected pack of tensor 1.*runtime.trace.tensors\[k\] has the op and module"), rt.step():
            _fixed_first(case.model, torch.randn(5, 256), first).backward()
        with rt.step():  # the plan still stands for the step it was made for
            _fixed_first(case.model, case.inputs[0], first).backward()
        assert rt.report().mode == "execute"
        with rt.step():  # a batch of another size at the first saved tensor is a new shape, not a divergence
            case.model(torch.randn(5, 256)).sum().backward()
        assert rt.report().new_shape
    finally:
        rt.close()


def _gradient_penalty_step(case):
    loss = case.loss()
    grads = torch.autograd.grad(loss, list(case.model.parameters()), create_graph=True)
    total = loss + sum((g ** 2).sum() for g in grads)
    total.backward()
    return total


@pytest.mark.parametrize("policy", ["min", "swap-all"])
def test_double_backward_executes_its_plan_with_identical_gradients(policy):
    """create_graph=True: the first backward saves new tensors (some of them views of what it
    unpacked, or of a weight), and the second reads them all; the executed steps match the trace."""
    a, b = build_model("mlp", "small", seed=3), build_model("mlp", "small", seed=3)
    cases = {id(a.model): a, id(b.model): b}
    # 50%: the weights' gradients, counted static by a relative budget, are born in the first
    # backward (R3), which leaves MIN room enough at 75%
    rt = SwapRuntime(budget="50%", policy=policy, backend="cpu", min_bytes=0, model=a.model)
    try:
        rep = train_together(a.model, b.model, rt, 6, lambda m, i: _gradient_penalty_step(cases[id(m)]))[-1]
        assert rep.mode == "execute" and rep.divergence is None and rep.evicted_bytes > 0
        assert rep.plan_followed == (rep.guard_evictions == 0 and rep.peak_device_bytes <= rep.budget_bytes)
    finally:
        rt.close()


def test_retain_graph_below_its_floor_says_why_and_at_its_floor_trains_identically():
    from swapsched.budget import BudgetError

    def two_passes(case):
        loss = case.loss()
        loss.backward(retain_graph=True)
        loss.backward()
        return loss

    a = build_model("mlp", "small", seed=3)
    rt = SwapRuntime(budget="95%", policy="min", backend="cpu", min_bytes=0, model=a.model)
    with pytest.raises(BudgetError, match=r"its 2 backward passes read the same saved tensors \(retain_graph"):
        for _ in range(4):
            with rt.step():
                two_passes(a)
    rt.close()
    a, b = build_model("mlp", "small", seed=3), build_model("mlp", "small", seed=3)
    cases = {id(a.model): a, id(b.model): b}
    rt = SwapRuntime(budget="100%", policy="swap-all", backend="cpu", min_bytes=0, model=a.model)
    try:
        assert train_together(a.model, b.model, rt, 5, lambda m, i: two_passes(cases[id(m)]))[-1].mode == "execute"
    finally:
        rt.close()


class FaultyBackend:
    """The CPU backend with its ``fail_at``-th swap-out of the executed steps made to fail
    (``"error"``) or never complete (``"hang"``, until the test lets it go)."""

    def __new__(cls, fail_at: int, mode: str, timeout_s: float = 2.0):
        import threading

        from swapsched.runtime.backends import CpuBackend, Ticket

        class Faulty(CpuBackend):
            def __init__(self):
                super().__init__(2e9, 2e9, 0.0, copy_timeout_s=timeout_s)
                self.n = 0
                self.release = threading.Event()

            def copy_out(self, src):
                self.n += 1
                if self.n != fail_at:
                    return super().copy_out(src)
                host = self.pool.take(src.numel())
                t = Ticket(src.numel(), src=src, dst=host, done_event=threading.Event())

                def copy():
                    if mode == "error":
                        raise OSError("injected DMA fault")
                    self.release.wait()

                self.d2h.submit(t, copy)
                return t

        return Faulty()


@pytest.mark.parametrize("mode, message", [("error", "failed: injected DMA fault"), ("hang", "did not complete in 2 s")])
def test_a_copy_that_fails_or_hangs_names_its_tensor_and_the_next_step_trains_identically(mode, message):
    from swapsched.runtime.backends import CopyError

    a, b = build_model("mlp", "small", seed=6), build_model("mlp", "small", seed=6)
    backend = FaultyBackend(fail_at=2, mode=mode)
    rt = SwapRuntime(budget="70%", policy="swap-all", backend=backend, min_bytes=0, model=a.model, profile_steps=1)
    try:
        with rt.step():
            a.loss().backward()  # profiled: synchronous copies, none of them faulty
        b.loss().backward()
        a.model.zero_grad(set_to_none=True), b.model.zero_grad(set_to_none=True)
        with pytest.raises(CopyError, match=rf"swap-(out|in) of tensor \d+ \(.*\) {message}"), rt.step():
            a.loss().backward()
        for p in a.model.parameters():  # the failed step's partial gradients are the caller's to drop
            p.grad = None
        for p in b.model.parameters():
            p.grad = None
        for _ in range(3):
            with rt.step():
                la = a.loss()
                la.backward()
            lb = b.loss()
            lb.backward()
            assert torch.equal(la, lb)
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
        rep = rt.report()
        assert rep.mode == "execute" and rep.evicted_bytes > 0 and rep.peak_device_bytes <= rep.budget_bytes
        pool = backend.pool
        assert pool.idle_bytes == pool.allocated_bytes  # every buffer back, but a stuck copy's
    finally:
        backend.release.set()
        rt.close()


def test_keyboard_interrupt_in_backward_leaves_nothing_held_and_the_next_step_trains_identically():
    a, b = build_model("gpt", "tiny", seed=7), build_model("gpt", "tiny", seed=7)
    rt = SwapRuntime(budget="70%", policy="min", backend="cpu", bandwidth=2e9, min_bytes=0, model=a.model)
    try:
        for _ in range(4):
            with rt.step():
                a.loss().backward()
            b.loss().backward()
        pool = rt.backend.pool
        with pytest.raises(KeyboardInterrupt), rt.step():
            loss = a.loss()
            loss.register_hook(lambda g: (_ for _ in ()).throw(KeyboardInterrupt()))
            loss.backward()
        del loss
        assert rt._exec is None and pool.idle_bytes == pool.allocated_bytes
        for m in (a, b):
            m.model.zero_grad(set_to_none=True)
        with rt.step():
            la = a.loss()
            la.backward()
        lb = b.loss()
        lb.backward()
        assert torch.equal(la, lb) and rt.report().mode == "execute"
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
    finally:
        rt.close()


def test_the_runtime_closes_itself_as_a_context_manager_and_reports_the_run():
    case = build_model("mlp", "small", seed=8)
    ref = build_model("mlp", "small", seed=8)
    with SwapRuntime(budget="70%", policy="min", backend="cpu", min_bytes=0, model=case.model, tune=False) as rt:
        for _ in range(6):
            with rt.step():
                case.loss().backward()
        with rt.step():  # another batch size: profiled as it runs
            case.model(torch.randn(3, 256)).sum().backward()
        run = rt.report().run
    assert not rt.backend.d2h.is_alive() and not rt.backend.h2d.is_alive()  # closed on leaving the block
    with pytest.raises(UserError, match="this runtime is closed"), rt.step():
        pass
    assert (run.steps, run.profiled, run.executed, run.diverged, run.new_shapes) == (7, 4, 3, 0, 1)
    with SwapRuntime(budget="70%", policy="swap-all", backend="cpu", min_bytes=0, model=ref.model, tune=False) as rt:
        steps = step_reports(rt, ref, 6)
    run = rt.report().run
    executed = [r for r in steps if r.mode == "execute"]
    assert run.executed == len(executed) == 3 and run.median_step_s == sorted(r.step_s for r in executed)[1]
    assert run.moved_bytes == sum(r.evicted_bytes + r.prefetched_bytes + r.on_demand_bytes for r in steps) > 0
    assert run.peak_device_bytes == max(r.peak_device_bytes for r in executed) <= run.budget_bytes
    assert run.overhead == run.median_step_s / run.plain_step_s - 1 and "run: 6 steps" in str(rt.report())


def test_fitted_host_costs_recover_what_the_hooks_and_the_state_mover_cost_by_hand():
    from swapsched.hardware import load_hardware
    from swapsched.runtime.retime import fitted_host_costs
    from swapsched.runtime.swapper import StepReport

    def rep(copies, hook_s, plain=(0.0, 0), state=(None, 0, 0)):
        return StepReport(step=1, mode="execute", step_s=1.0, stall_s=0.0, predicted_step_s=None, evicted_bytes=0,
                          prefetched_bytes=0, on_demand_bytes=0, peak_device_bytes=0, budget_bytes=0,
                          plan_followed=True, guard_evictions=0, kept_small=0, hook_s=hook_s, copies=copies,
                          plain_hook_s=plain[0], plain_events=plain[1], state_host_s=state[0], state_tensors=state[1],
                          state_copies=state[2])

    hw = load_hardware("cpu-emulated")
    # 100 events at 10 us (60 of them issued nothing: 0.6 ms), 50 us per copy; the mover moves 8
    # tensors with 24 copies and 20 us of bookkeeping each: one plan's steps tell all three apart
    step = rep(10, 100 * 10e-6 + 10 * 50e-6, (60 * 10e-6, 60), (24 * 50e-6 + 8 * 20e-6, 8, 24))
    noisy = rep(10, 100 * 10e-6 + 10 * 70e-6, (60 * 12e-6, 60), (24 * 50e-6 + 8 * 30e-6, 8, 24))
    fit = fitted_host_costs(hw, [step, step, noisy], 100)  # medians: the noisy step does not move them
    assert fit.hook_cost_s == pytest.approx(10e-6) and fit.copy_issue_s == pytest.approx(50e-6)
    assert fit.state_hook_s == pytest.approx(20e-6) and fit.copy_host_s_per_byte == hw.copy_host_s_per_byte
    # no copies: the per-copy cost stays as given; no event that issued nothing: nothing is fitted
    none = fitted_host_costs(hw, [rep(0, 1e-3, (1e-3, 100))], 100)
    assert none.hook_cost_s == pytest.approx(1e-5) and none.copy_issue_s == hw.copy_issue_s and none.state_hook_s == 0
    assert fitted_host_costs(hw, [rep(10, 3e-3)], 100) == hw


def test_use_plan_below_the_floor_says_the_smallest_budget_in_the_runtimes_words():
    from swapsched.budget import BudgetError

    case = build_model("mlp", "small", seed=0)
    with SwapRuntime(budget="70%", policy="min", backend="cpu", min_bytes=0, model=case.model, tune=False) as rt:
        for _ in range(4):
            with rt.step():
                case.loss().backward()
        with pytest.raises(BudgetError, match=r"the runtime's budget '5%' is below this training step's smallest feasible"):
            rt.use_plan(rt.plan, budget="5%")
        assert rt.budget_spec == "70%"  # refused: nothing changed


def test_making_room_orders_compute_after_the_swap_out_instead_of_waiting_on_the_host():
    """Finding 7 of issue 15: the room for a tensor is made by ``wait_for_use`` on the swap-out
    (a stream wait on CUDA), never by a host wait that would drain the device's queue. On the CPU
    backend both block the host; which one is called is what this checks."""
    from swapsched.runtime.backends import CpuBackend

    class Counting(CpuBackend):
        def __init__(self):
            super().__init__(5e7, 5e7, 0.0)  # a slow link: swap-outs are still running when room is needed
            self.outs, self.used_outs = set(), 0

        def copy_out(self, src):
            t = super().copy_out(src)
            self.outs.add(t)  # the ticket itself (identity), kept: an id() could be reused
            return t

        def wait_for_use(self, t):
            self.used_outs += t in self.outs
            super().wait_for_use(t)

    backend = Counting()
    case = build_model("mlp", "small", seed=1, batch_size=512)  # activations outweigh the weights' gradients (R3)
    with SwapRuntime(budget="50%", policy="swap-all", backend=backend, min_bytes=0, model=case.model) as rt:
        for _ in range(5):
            with rt.step():
                case.loss().backward()
        rep = rt.report()
    assert rep.mode == "execute" and rep.waits > 0 and backend.used_outs > 0
    assert rep.peak_device_bytes <= rep.budget_bytes


def test_a_real_device_times_its_gaps_with_marks_until_the_trace_is_retimed():
    """Finding 8 of issue 15: on a device that is not the host (CUDA), executed steps mark each
    hook's start and end in the compute order and re-time the trace from those marks, once. Here a
    CPU backend that claims not to be emulated stands in; its marks are the host clock."""
    from swapsched.runtime.backends import CpuBackend

    class DeviceLike(CpuBackend):
        emulated = False

    case = build_model("gpt", "tiny", seed=2)
    with SwapRuntime(budget="70%", policy="min", backend=DeviceLike(), min_bytes=0, model=case.model,
                     retime_steps=2) as rt:
        reports = step_reports(rt, case, 6)
        trace = rt.trace
    n = trace.n_events
    timed = [r for r in reports if r.gaps_s is not None]
    assert [r.mode for r in reports] == ["profile"] * 3 + ["execute"] * 3
    assert reports[3] in timed and reports[4] in timed and reports[5] not in timed  # marks stop once re-timed
    assert trace.meta["timed_by_execution"] == 2
    for r in timed:
        assert len(r.gaps_s) == n and min(r.gaps_s) >= 0 and r.tail_s >= 0
        assert sum(r.gaps_s) + r.tail_s <= r.step_s  # gaps leave the hooks' own time out
    expected = np.median([timed[0].gaps_s, timed[1].gaps_s], axis=0)
    assert [e.compute_s for e in trace.events] == pytest.approx(expected.tolist(), rel=1e-12)


def test_a_diverged_step_still_holds_the_budget():
    """A larger batch than the profiled one leaves the trace after its first pack; the step finishes
    on demand, but R4 keeps making room (the trace's next allocation scaled by the step's own
    sizes) and the guard evicts, and a swap-in buffer lives only as long as autograd holds it, so
    the budget holds, with the gradients of training without the runtime."""
    case = build_model("mlp", "small", seed=4)
    ref = build_model("mlp", "small", seed=4)
    rt = SwapRuntime(budget="90%", policy="min", backend="cpu", min_bytes=0, model=case.model, audit=True)
    first = torch.randn(16, 16, requires_grad=True)
    try:
        for _ in range(5):
            with rt.step():
                _fixed_first(case.model, case.inputs[0], first).backward()
            _fixed_first(ref.model, case.inputs[0], first).backward()
        x = torch.randn(case.inputs[0].shape[0] * 3 // 2, *case.inputs[0].shape[1:])
        for m in (case.model, ref.model):
            m.zero_grad(set_to_none=True)
        with rt.step():
            la = _fixed_first(case.model, x, first)
            la.backward()
        lb = _fixed_first(ref.model, x, first)
        lb.backward()
        rep = rt.report()
        assert rep.mode == "diverged" and torch.equal(la, lb)
        assert rep.guard_evictions > 0
        assert rep.peak_device_bytes <= rep.budget_bytes
        # the meter also sees the new batch, which the caller holds (no plan can evict it; the
        # profiled batch it replaces is still alive too, counted in static_bytes)
        assert rep.measured_peak_bytes <= rep.budget_bytes + x.untyped_storage().nbytes()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(case.model.parameters(), ref.model.parameters(), strict=True))
    finally:
        rt.close()


def test_a_run_that_mostly_diverges_says_so():
    case = build_model("mlp", "small", seed=9)
    x = case.inputs[0]
    with SwapRuntime(budget="90%", policy="min", backend="cpu", min_bytes=0, model=case.model) as rt:
        for _ in range(3):
            with rt.step():
                case.model(x).sum().backward()
        net = case.model.net
        for i in range(8):  # every other step skips the last layers: it leaves the trace, at its end
            with rt.step():
                (net[:-2](x) if i % 2 == 0 else net(x)).sum().backward()
        run = rt.report().run
    assert run.diverged == 4 and run.executed == 0 and run.new_shapes == 0
    assert "most steps ran without a plan: of 4 after the first plan, 4 left the profiled trace" in str(run)


def test_a_run_of_new_shapes_says_so():
    from swapsched.runtime.swapper import RunSummary

    # 3 warm-up profiles, then 5 profiles of new shapes and 2 executed steps
    run = RunSummary(steps=10, profiled=8, executed=2, diverged=0, median_step_s=0.1, plain_step_s=0.05, moved_bytes=0,
                     peak_device_bytes=100, budget_bytes=100, guard_evictions=0, budget_spec="60%", median_overhead=1.0,
                     shapes=6, new_shapes=5)
    assert ("most steps ran without a plan: of 7 after the first plan, 5 profiled a shape seen for the first time"
            in str(run)) and "+100.0% over the plain step" in str(run) and "plans for 6 shapes" in str(run)
    assert "without a plan" not in str(replace(run, executed=6, steps=14))


def test_a_shape_that_cannot_fit_the_resolved_budget_is_refused_with_what_it_needs():
    from swapsched.budget import BudgetError

    case = build_model("mlp", "small", seed=9)
    with SwapRuntime(budget="70%", policy="min", backend="cpu", min_bytes=0, model=case.model) as probe:
        for _ in range(3):
            with probe.step():
                case.loss().backward()
        budget = probe.budget_bytes  # a byte budget: the same bytes for every shape
    with SwapRuntime(budget=budget, policy="min", backend="cpu", min_bytes=0, model=case.model) as rt:
        for _ in range(4):
            with rt.step():
                case.loss().backward()
        resolved = rt.budget_bytes
        big = torch.randn(case.inputs[0].shape[0] * 4, *case.inputs[0].shape[1:])
        with pytest.raises(BudgetError, match=r"for every shape, and this step's shape needs more"):
            for _ in range(rt.profile_steps + 1):  # it diverges, then profiles again: refused then
                with rt.step():
                    case.model(big).sum().backward()
        assert rt.budget_bytes == resolved  # the run's bytes stand


def test_a_host_budget_bounds_what_the_steps_and_the_pool_hold():
    # R11: swap-all would put every saved tensor on the host; a host budget of a third of them
    # stops the swap-outs that do not fit (they stay on the device), in the executed steps as in
    # the profiling ones, and the pool never holds more; training stays bit-identical
    from tests.conftest import train_together

    case = build_model("mlp", "small", seed=3)
    ref = build_model("mlp", "small", seed=3)
    with SwapRuntime(budget="100%", policy="swap-all", backend="cpu", model=case.model) as probe:
        for _ in range(4):
            with probe.step():
                case.loss().backward()
        all_out = probe.report().host_peak_bytes
    case = build_model("mlp", "small", seed=3)
    limit = all_out // 3
    rt = SwapRuntime(budget="100%", policy="swap-all", backend="cpu", model=case.model, host_budget=limit)
    try:
        reports = train_together(case.model, ref.model, rt, 6, lambda m, i: _loss_of(m, case))
        executed = [r for r in reports if r.mode == "execute"]
        assert executed and all(0 < r.host_peak_bytes <= limit and r.host_skipped > 0 for r in executed)
        assert rt.backend.pool.allocated_bytes <= limit
        assert rt.hardware.host_budget_bytes == limit
    finally:
        rt.close()
    with pytest.raises(UserError, match="give bytes"):
        SwapRuntime(budget="70%", policy=None, backend="cpu", host_budget="70%")


def _loss_of(model, case):
    loss = case.loss_fn(model(*case.inputs))
    loss.backward()
    return loss


def test_a_device_budget_is_refused_on_the_cpu_with_what_to_pass():
    with pytest.raises(UserError, match=r"give bytes \('6GiB'\) or a share"):
        SwapRuntime(budget="device", policy="min", backend="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_device_budget_is_the_devices_capacity_less_what_the_process_holds():
    from swapsched.runtime.budgets import DEVICE_MARGIN

    case = build_model("mlp", "small", seed=1, device="cuda")
    other = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # something else the process holds
    with SwapRuntime(budget="device", policy="min", backend="cuda", model=case.model) as rt:
        with rt.step():
            case.loss().backward()
        total = torch.cuda.get_device_properties(0).total_memory
        assert isinstance(rt.budget_spec, int)
        assert rt.budget_spec <= int(total * (1 - DEVICE_MARGIN)) - other.numel()
    del other


def test_a_plan_that_moves_nothing_runs_without_hooks_and_a_new_shape_is_still_seen():
    # the plan evicts nothing (100%): after the trace is re-timed and two steps followed the plan,
    # each step takes its hooks off at its first saved tensor. Gradients stay bit-identical, and
    # a batch of another size is still caught at its first saved tensor (profiled as it runs)
    from tests.conftest import train_together

    case = build_model("mlp", "small", seed=5)
    ref = build_model("mlp", "small", seed=5)
    small = torch.randn(case.inputs[0].shape[0] - 2, *case.inputs[0].shape[1:])

    def run(model, i):
        loss = model(small if i == 12 else case.inputs[0]).pow(2).mean()
        loss.backward()
        return loss

    rt = SwapRuntime(budget="100%", policy="min", backend="cpu", model=case.model)
    try:
        reports = train_together(case.model, ref.model, rt, 13, run)
    finally:
        rt.close()
    assert rt.plan is not None
    unhooked = [r.unhooked for r in reports]
    assert any(unhooked[:12]) and all(unhooked[i] for i in range(unhooked.index(True), 12))
    first = unhooked.index(True)
    assert all(r.mode == "execute" and r.plan_followed for r in reports[first - 2:first])  # two followed first
    # an unhooked step reports the peak of the plan it follows, as simulated, and says it is unhooked
    rep = reports[first]
    assert rep.peak_device_bytes is not None and rep.budget_bytes is not None
    assert rep.peak_device_bytes <= rep.budget_bytes and rep.evicted_bytes == 0
    text = str(rep)
    assert "unhooked" in text and "profiling step" not in text
    assert rep.run is not None and rep.run.peak_device_bytes is not None
    assert reports[12].mode == "profile" and reports[12].new_shape and not reports[12].unhooked
    # watching was asked for: never unhooked
    audited = SwapRuntime(budget="100%", policy="min", backend="cpu", model=build_model("mlp", "small", seed=5).model,
                          audit=True)
    try:
        m = audited.model
        for _ in range(10):
            with audited.step():
                m(case.inputs[0]).pow(2).mean().backward()
            assert not audited.report().unhooked
    finally:
        audited.close()
