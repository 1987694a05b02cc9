"""runtime/shapes.py: a family's trace at a size never profiled (hand-computed), and the runtime
executing those predicted traces on steps of variable length, bit-identically within its budget."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn as nn

from swapsched.budget import BudgetError
from swapsched.deploy import SwapRuntime
from swapsched.runtime.shapes import FamilyFit, first_bytes, predicted_trace, structure, with_family_other
from swapsched.runtime.transients import OTHER_MEASURED
from swapsched.trace import GRADIENTS_BORN
from tests.conftest import make_trace, train_together


def _at(n: int, static: int = 0, gap: float = 1.0):
    """One family: T0 of 4n B (linear), T1 of n*n B (quadratic, as attention scores), T2 of 64 B
    (fixed); gaps ``gap * n / 8``."""
    g = gap * n / 8
    return make_trace([4 * n, n * n, 64], [("pack", 0, g), ("pack", 1, g), ("pack", 2, g), ("unpack", 2, g),
                                           ("unpack", 1, g), ("unpack", 0, g)], static=static, name=f"n{n}")


def _scaled(tr, n):
    """``tr`` (a family member at n = 8, tensors of 4n, 4n and 64 B) at ``n``."""
    return replace(tr, tensors=tuple(replace(t, bytes=b) for t, b in zip(tr.tensors, [4 * n, 4 * n, 64], strict=True)))


def test_two_sizes_predict_a_linear_family_exactly():
    # T1 is 4 n (n = 8, 16): a line through (32, 32) and (64, 64) in s = T0's bytes; at s = 48
    # (n = 12) every tensor is exact, the gaps 12/8 = 1.5 s, the static bytes in between.
    lin = [make_trace([4 * n, 4 * n, 64], [("pack", 0, n / 8), ("pack", 1, n / 8), ("pack", 2, n / 8),
                                           ("unpack", 2, n / 8), ("unpack", 1, n / 8), ("unpack", 0, n / 8)],
                      static=10 * n, name=f"n{n}") for n in (8, 16)]
    tr = predicted_trace(lin, 48)
    assert tr is not None and tr.tensor_bytes.tolist() == [48, 48, 64]
    assert tr.gaps.tolist() == pytest.approx([1.5] * 6) and tr.static_bytes == 120
    assert structure(tr) == structure(lin[0]) and first_bytes(tr) == 48
    # beyond the profiled sizes the gaps scale with s from the nearest: at n = 24 (s = 96), 2 * 96/64 = 3
    assert predicted_trace(lin, 96).gaps.tolist() == pytest.approx([3.0] * 6)
    # two close sizes with noisy gaps (1 s at n = 8, 2 s at n = 9): a line through them would say
    # 1 + (64 - 32) / 4 = 9 s per gap at n = 16; scaled from n = 9 it is 2 * 64/36 = 3.56
    noisy = [replace(t, events=tuple(replace(e, compute_s=g) for e in t.events))
             for t, g in zip([lin[0], _scaled(lin[0], 9)], [1.0, 2.0], strict=True)]
    assert predicted_trace(noisy, 64).gaps.tolist() == pytest.approx([2 * 64 / 36] * 6)


def test_executed_steps_time_the_family_where_they_ran():
    # The linear family above (gaps n/8 s: 1 s at n = 8, 2 s at n = 16), and an executed step at
    # n = 12 (s = 48) that measured 1 s per gap and a 0.5 s tail (its profile would say 1.5 s).
    # At s = 48 its own timing; at n = 14 (s = 56), halfway between it and n = 16: 1.5 s; below
    # n = 8 the profiled n = 8 still scales (n = 6: 1 * 24/32 = 0.75 s); the bytes are the fit's.
    lin = [make_trace([4 * n, 4 * n, 64], [(k, t, n / 8) for k, t in (("pack", 0), ("pack", 1), ("pack", 2), ("unpack", 2),
                                                                          ("unpack", 1), ("unpack", 0))],
                      tail=n / 8, name=f"n{n}") for n in (8, 16)]
    fit = FamilyFit(lin)
    executed = {48: (np.full(6, 1.0), 0.5)}
    at48 = fit.at(48, executed)
    assert at48.gaps.tolist() == [1.0] * 6 and at48.tail_compute_s == 0.5 and at48.tensor_bytes.tolist() == [48, 48, 64]
    at56 = fit.at(56, executed)
    assert at56.gaps.tolist() == pytest.approx([1.5] * 6) and at56.tail_compute_s == pytest.approx(1.25)
    assert fit.at(24, executed).gaps.tolist() == pytest.approx([0.75] * 6)
    assert fit.at(56).gaps.tolist() == pytest.approx([1.75] * 6)  # the profiled sizes alone


def test_three_sizes_predict_a_quadratic_tensor_exactly_and_refuse_what_they_cannot_say():
    family = [_at(n) for n in (8, 16, 32)]
    tr = predicted_trace(family, 4 * 24)  # n = 24: T1 = 576 B, from the parabola through 64, 256, 1024
    assert tr is not None and tr.tensor_bytes.tolist() == [96, 576, 64]
    assert predicted_trace(family[:1], 96) is None  # one size says nothing of the others
    assert predicted_trace(family, 4 * 65) is None  # beyond twice the largest profiled size
    # two sizes fit a line, which a quadratic tensor leaves between them: the prediction is
    # checked as the step runs, not here (only more sizes than the degree needs can be checked)
    two = predicted_trace(family[:2], 4 * 12)
    assert two is not None and two.tensor_bytes.tolist()[1] == 160  # the line, not 144
    # four sizes of which one is no parabola of the others: no prediction
    odd = [*family, make_trace([4 * 40, 40 * 40 + 8, 64], [(e.kind, e.tensor, e.compute_s) for e in _at(40).events])]
    assert predicted_trace(odd, 4 * 24) is None


def _lin(n: int, other: list[int] | None, measured: bool | None):
    """The linear family at n (tensors 4n, 4n, 64 B; 1 s gaps) with these other bytes, marked
    measured (a whole profiled step) or sampled (one handed over mid-step)."""
    tr = make_trace([4 * n, 4 * n, 64], [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 1.0), ("unpack", 2, 1.0),
                                         ("unpack", 1, 1.0), ("unpack", 0, 1.0)], other=other, name=f"n{n}")
    return tr if measured is None else replace(tr, meta={OTHER_MEASURED: measured})


def test_other_bytes_are_predicted_from_the_traces_that_measured_them():
    # R3: n = 8 (s = 32) measured 10 B in every gap, 40 B at the last unpack; n = 16 (s = 64)
    # measured 20 and 80. At s = 48 the line through them: 15 and 60.
    a, b = _lin(8, [10] * 5 + [40], True), _lin(16, [20] * 5 + [80], True)
    assert predicted_trace([a, b], 48).other_bytes.tolist() == [15] * 5 + [60]
    # n = 16 only sampled them (handed over mid-step: 2 B seen): the fit leaves it out, and n = 8's
    # alone scales in proportion to s: at s = 48, 15 and 60; at s = 16 (n = 4), 5 and 20
    sampled = _lin(16, [2] * 6, False)
    assert predicted_trace([a, sampled], 48).other_bytes.tolist() == [15] * 5 + [60]
    assert predicted_trace([a, sampled], 16).other_bytes.tolist() == [5] * 5 + [20]
    # a predicted trace's other bytes are fitted, not measured: it never enters a fit as measured
    assert predicted_trace([a, b], 48).meta[OTHER_MEASURED] is False


def test_gradients_born_in_a_gap_are_the_same_at_every_size():
    # R3: n = 8 measured 10 B in four gaps, then 22 B and 40 B, with the weights' gradients born
    # in the gap before event 4 (12 B) and in the last (12 B). At s = 16 (half the size) the rest
    # scales and the gradients stay: 5 B, then 10 / 2 + 12 = 17, then (40 - 24) / 2 + 24 = 32
    a = _lin(8, [10] * 4 + [22, 40], True)
    a = replace(a, meta={**a.meta, GRADIENTS_BORN: [[4, 12], [5, 12]]})
    assert predicted_trace([a, _lin(16, [2] * 6, False)], 16).other_bytes.tolist() == [5] * 4 + [17, 32]


def test_a_step_profiled_mid_step_gets_at_least_its_familys_measured_other_bytes():
    a = _lin(8, [10] * 5 + [40], True)
    # n = 16 sampled 2 B in each gap and 100 B in its last (a checkpoint's recompute): the larger
    # of those and n = 8's scaled by 64/32 (20, 80) in each gap
    mid = _lin(16, [2] * 5 + [100], False)
    filled = with_family_other(mid, [a, mid])
    assert filled.other_bytes.tolist() == [20] * 5 + [100]
    assert filled.tensor_bytes.tolist() == mid.tensor_bytes.tolist() and filled.gaps.tolist() == mid.gaps.tolist()
    # a measured trace is its own; with no measured kin (or kin of another structure) nothing changes
    assert with_family_other(a, [a, mid]) is a
    assert with_family_other(mid, [mid]) is mid
    other_structure = replace(a, events=a.events[:3] + (a.events[4], a.events[3], a.events[5]))
    assert with_family_other(mid, [other_structure]) is mid


class Net(nn.Module):
    """Three residual blocks over (batch, length, 32): each saved tensor's bytes are linear in the length."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
                                    for _ in range(3))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0  # the first saved tensor grows with the length too
        for b in self.blocks:
            h = h + b(h)
        return self.head(h).pow(2).mean()


def _batches(lengths):
    return {n: torch.randn(8, n, 32, generator=torch.Generator().manual_seed(n)) for n in set(lengths)}


#: three steps of 32 profiled, 48 profiled as it runs, then lengths never profiled (64 beyond both)
LENGTHS = [32, 32, 32, 32, 48, 40, 64, 40, 56, 36, 64]


def _step_of_length(lengths):
    """``run(model, i)`` for ``train_together``: step ``i`` at ``lengths[i]``, its loss."""
    xs = _batches(lengths)

    def run(model, i):
        loss = model(xs[lengths[i]])
        loss.backward()
        return loss

    return run


def _train_lengths(lengths):
    """A Net trained at ``lengths`` under "60%" and min beside a plain copy (bit-identical, by
    train_together), audited, planned between steps (so that which plan each step runs does not
    depend on a thread's timing): the step reports."""
    a, b = Net(), Net()
    rt = SwapRuntime(budget="60%", policy="min", backend="cpu", model=a, audit=True, background_planning=False)
    try:
        return train_together(a, b, rt, len(lengths), _step_of_length(lengths))
    finally:
        rt.close()


def test_steps_of_lengths_never_profiled_execute_predicted_plans_bit_identically_within_budget():
    lengths = LENGTHS
    reports = _train_lengths(lengths)
    modes = [r.mode for r in reports]
    # two lengths profiled (32 three times, 48 once as it ran); every other length is predicted
    assert modes == ["profile"] * 3 + ["execute", "profile"] + ["execute"] * 6
    assert [r.shape_predicted for r in reports[5:]] == [True] * 6
    # the predicted layout was made inside step 5, at its first saved tensor; the policy planned
    # after step 2 (the profiles are in) and after step 4 (48, profiled as it ran): their time is reported
    assert reports[5].planning_s > 0 and reports[2].planning_s > 0 and reports[4].planning_s > 0
    for r in reports[3:]:
        if r.mode == "execute":  # the budget holds on every step, by the independent meter too
            assert r.peak_device_bytes <= r.budget_bytes and r.measured_peak_bytes <= r.budget_bytes
    # a relative budget is each shape's own ("60%" of that length's activation peak): longer
    # steps run under more bytes
    budget = {lengths[i]: r.budget_bytes for i, r in enumerate(reports) if r.mode == "execute"}
    assert budget[32] < budget[36] < budget[40] < budget[56] < budget[64]
    # 64 is beyond every profiled length: it runs on the plan of 48 first, then on its own
    assert reports[10].plan_followed and reports[10].guard_evictions == 0
    # every executed step has a prediction, a borrowed plan's too (R4, guard: where it leaves no
    # room, the simulator evicts as the guard does)
    assert all(r.predicted_step_s is not None for r in reports if r.mode == "execute")
    run_ = reports[-1].run
    assert run_.predicted_steps == 6 and run_.new_shapes == 1 and "executed steps on predicted shapes" in str(run_)


def test_a_length_no_plan_can_fit_is_refused_at_its_first_saved_tensor():
    xs = _batches([32, 34, 64])
    a = Net()
    heads = []
    a.head.register_forward_hook(lambda *_: heads.append(1))
    # a byte budget is the same bytes for every shape: the bytes 45% stands for at length 32 (34's
    # other bytes, sampled as it is profiled mid-step, are 32's measured ones scaled by 34/32 (R3):
    # at 40% the smallest budget 34 can meet is 3% more than 32's)
    with SwapRuntime(budget="45%", policy="min", backend="cpu", model=Net()) as probe:
        for _ in range(3):
            with probe.step():
                probe.model(xs[32]).backward()
        budget = probe.budget_bytes
    with SwapRuntime(budget=budget, policy="min", backend="cpu", model=a) as rt:
        for n in (32, 32, 32, 34):
            with rt.step():
                a(xs[n]).backward()
        before = len(heads)
        with pytest.raises(BudgetError, match="this step's shape needs more"), rt.step():
            a(xs[64]).backward()
        assert len(heads) == before  # refused at the first saved tensor: the forward went no further
        with rt.step():  # the runtime goes on with the shapes that fit
            a(xs[32]).backward()
        assert rt.report().mode == "execute"


def test_a_plain_loop_with_a_partial_last_batch_runs_a_plan_for_it_from_its_second_epoch():
    # 70 samples in batches of 16: four full batches and a last one of 6, each epoch. The last
    # batch is a new shape: profiled as it runs in epoch 1, its own plan from epoch 2 on.
    gen = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(70, 24, 32, generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    batches = [x for _ in range(3) for (x,) in loader]
    assert [len(x) for x in batches[:5]] == [16, 16, 16, 16, 6]
    a, b = Net(), Net()

    def run(model, i):
        loss = model(batches[i])
        loss.backward()
        return loss

    rt = SwapRuntime(budget="60%", policy="min", backend="cpu", model=a, audit=True)
    try:
        reports = train_together(a, b, rt, len(batches), run)
    finally:
        rt.close()
    modes = [r.mode for r in reports]
    assert modes == ["profile"] * 3 + ["execute", "profile"] + ["execute"] * 10, modes
    assert reports[4].new_shape and [r.plan_followed for r in reports[9::5]] == [True, True]
    for r in reports[3:]:
        if r.mode == "execute":  # every step within the budget, by the accounting and by the meter
            assert r.peak_device_bytes <= r.budget_bytes and r.measured_peak_bytes <= r.budget_bytes
    assert reports[-1].run.shapes == 2


def test_new_shapes_run_a_borrowed_plan_at_once_and_the_policys_from_the_background():
    # test_steps_of_lengths_never_profiled...'s lengths, planned on the planner thread: the length
    # 48, profiled as it ran, starts on 32's plan (its only family member) and the policy's plan
    # replaces it once ready.
    lengths, run = LENGTHS, _step_of_length(LENGTHS)
    a, b = Net(), Net()
    waited = []

    class Planned(SwapRuntime):  # waits for the background plans after each step (the test's clock, not the runtime's)
        @contextlib.contextmanager
        def step(self):
            with super().step():
                yield self
            waited.append({k: dict(lay.plan.meta) for k, lay in self.layouts.items()})
            self.wait_for_plans()

    rt = Planned(budget="60%", policy="min", backend="cpu", model=a, audit=True)
    try:
        reports = train_together(a, b, rt, len(lengths), run)
        s48, s64 = 8 * 48 * 32 * 4, 8 * 64 * 32 * 4  # the first saved tensor: the input's copy, float32
        assert "borrowed_from" in waited[4][s48] and "borrowed_from" not in rt.layouts[s48].plan.meta
        # 64 runs under its own 60%: the plan it borrows is replaced by the policy's unless it
        # already meets R8's floor there (no plan is faster)
        from swapsched.env.floors import analytic_floor

        lay = rt.layouts[s64]
        assert lay.predicted and ("borrowed_from" not in lay.plan.meta or lay.predicted_s
                                  <= analytic_floor(lay.trace, lay.budget_bytes, rt.hardware) * (1 + 1e-9))
    finally:
        rt.close()
    assert [r.mode for r in reports] == ["profile"] * 3 + ["execute", "profile"] + ["execute"] * 6
    assert reports[10].plan_followed and reports[10].guard_evictions == 0
    for r in reports[3:]:
        if r.mode == "execute":
            assert r.peak_device_bytes <= r.budget_bytes and r.measured_peak_bytes <= r.budget_bytes


def test_a_later_shape_is_planned_for_swaps_only_where_the_policy_would_recompute():
    # blocks are chosen on the first shape (R9's two stages): a later shape's plan keeps them as
    # they are. A policy that recomputes every block gets the trace without blocks there, so its
    # plan swaps only, and the shape gets that plan rather than none
    from swapsched.agents.recompute import CheckpointAll

    lengths, run = LENGTHS[:4], _step_of_length(LENGTHS[:4])
    a, b = Net(), Net()
    rt = SwapRuntime(budget="60%", policy="min", backend="cpu", model=a)
    try:
        train_together(a, b, rt, len(lengths), run)
        layout = rt.layout
        assert rt.trace.segments and not rt.blocks.names  # min planned swaps on a trace with blocks
        rt.plans.policy = CheckpointAll()
        rt.plans.replan(layout, layout.trace)  # on the planner thread
        ((replaced, replanned),) = rt.plans.install_ready(wait=True)
        assert replaced is layout
        assert replanned.plan.recompute == () and replanned.plan.selective == ()
        assert replanned.plan.policy == "checkpoint-all" and replanned.family is layout.family
    finally:
        rt.close()


def test_a_new_shape_whose_first_saved_tensor_is_the_callers_batch_counts_the_batch():
    # The first conv saves the caller's batch, which the runtime does not own (static bytes, no trace
    # id). A step of a new size hands its hooks to a profiling step at its first *traced* tensor,
    # after the batch: the batch's bytes must still enter that shape's static bytes, or its plan
    # runs over the budget by them (the audit meter counts the batch).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(8, 8, 3, padding=1))
    gen = torch.Generator().manual_seed(1)
    xs = {n: torch.randn(4, 3, n, n, generator=gen) for n in (16, 24)}
    rt = SwapRuntime(budget="90%", policy="min", backend="cpu", model=net, audit=True, background_planning=False)
    try:
        reports = []
        for n in (24, 24, 24, 16, 16):
            with rt.step():
                net(xs[n]).pow(2).mean().backward()
            reports.append(rt.report())
        assert [r.mode for r in reports] == ["profile"] * 4 + ["execute"] and reports[3].new_shape
        for n in (16, 24):
            trace = next(lay.trace for lay in rt.layouts.values() if lay.trace.tensors[lay.trace.events[0].tensor].shape[-1] == n)
            assert trace.meta["unowned_bytes"] == xs[n].nbytes
        last = reports[-1]
        assert last.measured_peak_bytes <= last.budget_bytes and last.peak_device_bytes <= last.budget_bytes
        assert abs(last.measured_peak_bytes - last.peak_device_bytes) < xs[16].nbytes // 4
    finally:
        rt.close()


def test_a_new_shape_profiled_from_its_first_traced_tensor_numbers_the_callers_batch_as_a_whole_profile_does():
    # The embedding saves the caller's tokens (not the runtime's: no trace id), and cross_entropy
    # saves a view of them again at the end, then its 4 B total weight. A step of a new length hands
    # its hooks to a profiling step after the tokens; seeing them again there is no new storage,
    # as it is to a whole profile and to an executing step. Counted as new, it shifted the total
    # weight's place in the order of first sight, and every later step of that length diverged.
    torch.manual_seed(0)

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.mid, self.head = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50)

        def forward(self, tokens):
            return nn.functional.cross_entropy(self.head(torch.relu(self.mid(self.emb(tokens)))).flatten(0, 1),
                                               tokens.flatten())

    net = Tokens()
    xs = {n: torch.randint(0, 50, (4, n), generator=torch.Generator().manual_seed(n)) for n in (16, 24)}
    rt = SwapRuntime(budget="95%", policy="min", backend="cpu", model=net, audit=True, background_planning=False)
    try:
        reports = []
        for n in (24, 24, 24, 16, 16, 16):
            with rt.step():
                net(xs[n]).backward()
            reports.append(rt.report())
        assert [r.mode for r in reports] == ["profile"] * 4 + ["execute"] * 2 and reports[3].new_shape
        assert all(r.divergence is None and r.plan_followed for r in reports[4:])
        sixteen, twenty_four = (rt.layouts[4 * n * 16 * 4].first_sight for n in (16, 24))
        assert sixteen == twenty_four
    finally:
        rt.close()


def test_profiling_steps_of_several_lengths_each_join_the_family():
    # A padded run's first steps have other lengths: 32, 48 and 40 are the three profiling steps.
    # The plan is made for 40 (the last); 32 and 48 each get a layout of their own, borrowed from
    # it, so the step of 48 executes and so does a length never seen (56: predicted from the three)
    # instead of being profiled as it runs.
    lengths = [32, 48, 40, 48, 56, 32]
    run = _step_of_length(lengths)
    a, b = Net(), Net()
    rt = SwapRuntime(budget="60%", policy="min", backend="cpu", model=a, audit=True, background_planning=False)
    try:
        reports = train_together(a, b, rt, len(lengths), run)
        assert [r.mode for r in reports] == ["profile"] * 3 + ["execute"] * 3
        assert [r.shape_predicted for r in reports[3:]] == [False, True, False]
        assert sorted(k // (8 * 4 * 32) for k, lay in rt.layouts.items() if not lay.predicted) == [32, 40, 48]
        for r in reports[3:]:
            assert r.peak_device_bytes <= r.budget_bytes and r.measured_peak_bytes <= r.budget_bytes
    finally:
        rt.close()


def test_a_relative_budget_is_each_shapes_own_share():
    # the loop: four batches of 32, then 160 (5x the first's activations) and 48. "60%"
    # means 60% of each step's own activation peak: no refusal, each executed step within its own
    # budget by the audit meter, gradients bit-identical to training without the runtime
    lengths = [32, 32, 32, 32, 160, 48, 160, 48]
    reports = _train_lengths(lengths)
    executed = [(n, r) for n, r in zip(lengths, reports, strict=True) if r.mode == "execute"]
    assert {n for n, _ in executed} == {32, 48, 160}
    for _, r in executed:
        assert r.peak_device_bytes <= r.budget_bytes and r.measured_peak_bytes <= r.budget_bytes
    budgets = {n: r.budget_bytes for n, r in executed}
    assert budgets[32] < budgets[48] < budgets[160]
    assert "of its shape's activation peak" in str(reports[-1].run)


def test_a_shape_refused_under_a_byte_budget_leaves_model_optimizer_and_runtime_as_they_were():
    # a byte budget is the same bytes for every shape; a length that no plan fits in them is
    # refused at its first saved tensor. Parameters, optimizer state and the next step are then
    # bit-identical to a run that never saw the long batch.
    xs = _batches([32, 160])
    with SwapRuntime(budget="50%", policy="min", backend="cpu", model=Net()) as probe:
        for _ in range(3):
            with probe.step():
                probe.model(xs[32]).backward()
        budget = probe.budget_bytes

    def train(long_batch: bool):
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        with SwapRuntime(budget=budget, policy="min", backend="cpu", model=model, tune=False) as rt:
            for i in range(6):
                if long_batch and i == 4:
                    with pytest.raises(BudgetError, match="needs more"), rt.step():
                        model(xs[160]).backward()
                    assert all(p.grad is None for p in model.parameters())  # nothing reached backward
                with rt.step():
                    loss = model(xs[32])
                    loss.backward()
                losses.append(loss.detach())
                opt.step()
                opt.zero_grad(set_to_none=True)
            return model, opt, losses, rt.report()

    m1, o1, l1, r1 = train(long_batch=True)
    m2, o2, l2, r2 = train(long_batch=False)
    assert all(torch.equal(x, y) for x, y in zip(l1, l2, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert all(torch.equal(s1[k][f], s2[k][f]) for k in s2 for f in ("exp_avg", "exp_avg_sq"))
    assert r1.mode == r2.mode == "execute" and r1.plan_followed


class _Quick:
    """A quick planner for the tests: ``inner``'s plans, counted."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, f"quick-{inner.name}", 0

    def plan(self, trace, budget, hardware):
        self.calls += 1
        return self.inner.plan(trace, budget, hardware)


def _train_with_quick(quick, share, monkeypatch, policy="min"):
    from swapsched.runtime import plans

    monkeypatch.setattr(plans, "PLANNING_SHARE", share)
    a, b = Net(), Net()
    rt = SwapRuntime(budget="60%", policy=policy, backend="cpu", model=a, audit=True, background_planning=False,
                     quick_policy=quick)
    try:
        return train_together(a, b, rt, len(LENGTHS), _step_of_length(LENGTHS))
    finally:
        rt.close()


def test_a_new_shape_starts_on_the_quick_planners_plan_where_it_simulates_faster(monkeypatch):
    """LENGTHS' predicted sizes (steps 5-10, four of them new): each new one asks the quick planner
    at its first saved tensor. The profiled sizes' plans are swap-all's, which stalls on the
    throttled link; MIN's plan (the quick one here) simulates faster than the one borrowed from
    them. The run counts each step's plan. (MIN against MIN would tie: a family's sizes share
    their events, and MIN's choices follow the events.)"""
    from swapsched.agents.heuristics import Belady

    quick = _Quick(Belady())
    reports = _train_with_quick(quick, 10.0, monkeypatch, policy="swap-all")  # a share that always admits it
    assert quick.calls == 4  # 40, 64, 56, 36: the new predicted sizes, once each
    executed = [r for r in reports if r.mode == "execute"]
    assert "learned" in [r.plan_source for r in executed]
    run_ = reports[-1].run
    assert run_.borrowed_steps + run_.learned_steps + run_.searched_steps == run_.executed
    assert run_.learned_steps == sum(r.plan_source == "learned" for r in executed) > 0
    assert "learned" in str(run_)
    for r in executed:  # whichever plan ran, the budget held and the losses matched (train_together)
        assert r.peak_device_bytes <= r.budget_bytes and r.measured_peak_bytes <= r.budget_bytes


def test_the_quick_planner_is_not_asked_beyond_the_planning_share_nor_taken_where_it_is_worse(monkeypatch):
    from swapsched.agents.heuristics import Belady, NoSwap

    quick = _Quick(Belady())
    _train_with_quick(quick, 0.0, monkeypatch)  # no share: planning stays off the loop
    assert quick.calls == 0
    keep_all = _Quick(NoSwap())  # keeps everything: runs out of memory at 60%, so the borrowed plan runs
    reports = _train_with_quick(keep_all, 10.0, monkeypatch)
    assert keep_all.calls == 4 and not any(r.plan_source == "learned" for r in reports)
