"""runtime/profile_step.py, execute_step.py and copies.py driven directly: a hand-made StepFrame
and a StepHost that records what the step asked, around a small autograd step whose saved
tensors are known, with no PolicyRuntime in between.

The step (``chain``): ``w`` is a parameter of N floats; ``b = sin(w * 2)`` saves ``a = w * 2``,
``c = cos(b)`` saves ``b``, ``d = exp(c)`` saves its result ``d``: three traced tensors of 4N
bytes (T0, T1, T2), packed in that order and unpacked in the reverse; the parameter ``w`` is
static. The saved tensors' peak is all three (12 KiB), and two (8 KiB) must be resident: when
backward reads ``d`` and then ``b``, ``a`` may be away. Beyond them the step holds (R3, measured):
``c`` until ``exp`` has made ``d`` and the expression ends; in backward each gradient of 4N bytes
(and the loss and its gradient, 4 bytes each); cos's backward holds ``sin(b)``, its negation, ``b``'s
gradient and ``c``'s at once (16 KiB), in the last gap, where ``a`` and ``b`` are resident too."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch

from swapsched.hardware import load_hardware
from swapsched.plan import Eviction, SwapPlan
from swapsched.runtime.backends import CpuBackend
from swapsched.runtime.execute_step import ExecuteStep
from swapsched.runtime.frame import SavedTensorHooks, StepFrame
from swapsched.runtime.layout import PlanLayout, lay_out
from swapsched.runtime.profile_step import ProfileStep

N = 1024
NBYTES = 4 * N


def chain(w: torch.Tensor, extra: bool = False) -> torch.Tensor:
    d = torch.exp(torch.cos(torch.sin(w * 2)))
    if extra:  # a step that leaves the trace: d saved once more (by mul), where backward should start
        d = d * torch.tanh(d)
    return d.sum()


@dataclass
class Host:
    """A StepHost that records the step's calls; ``shapes`` answers ``layout_of_shape``."""

    shapes: dict[int, PlanLayout] = field(default_factory=dict)
    unhook: bool = False
    asked: list[int] = field(default_factory=list)
    grads_kept: int = 0
    hooks: SavedTensorHooks | None = None

    def layout_of_shape(self, first_bytes, like):
        self.asked.append(first_bytes)
        return self.shapes.get(first_bytes)

    def may_unhook(self, layout):
        return self.unhook

    def take_hooks_off(self):
        self.hooks.off()

    def note_grads(self):
        self.grads_kept += 1


def frame(host: Host, layout: PlanLayout | None = None, step: int = 1, strict: bool = False) -> StepFrame:
    return StepFrame(backend=BACKEND, hardware=HW, model=None, static_bytes=0, static_keys=frozenset(), min_bytes=0,
                     strict=strict, audit=False, step=step, blocks=None, rebuilt={}, device_timed=False, layout=layout,
                     host=host)


BACKEND = CpuBackend()
HW = load_hardware("cpu-emulated")


def run(ex, host: Host, w: torch.Tensor, **kwargs) -> torch.Tensor:
    """One step of ``chain`` under ``ex``'s hooks, as PolicyRuntime.step runs it; w's gradient."""
    w.grad = None
    with SavedTensorHooks(ex.pack, ex.unpack) as host.hooks:
        chain(w, **kwargs).backward()
    ex.finish()
    return w.grad.clone()


def plain_grad(w: torch.Tensor, **kwargs) -> torch.Tensor:
    w.grad = None
    chain(w, **kwargs).backward()
    return w.grad.clone()


@pytest.fixture
def w() -> torch.nn.Parameter:
    torch.manual_seed(0)
    return torch.nn.Parameter(torch.randn(N))


@pytest.fixture
def profiled(w):
    host = Host()
    ex = ProfileStep(frame(host))
    grad = run(ex, host, w)
    assert torch.equal(grad, plain_grad(w))
    return ex


def test_a_profiling_step_traces_each_saved_storage_once_and_not_the_parameter(profiled):
    tr = profiled.trace
    assert tr.tensor_bytes.tolist() == [NBYTES] * 3 and tr.static_bytes == 0  # w is the caller's parameter
    assert [(e.kind, e.tensor) for e in tr.events] == [("pack", 0), ("pack", 1), ("pack", 2),
                                                      ("unpack", 2), ("unpack", 1), ("unpack", 0)]
    assert profiled.first_sight == {0: 0, 1: 1, 2: 2}
    assert [e.other_bytes for e in tr.events] == [0, 0, NBYTES, NBYTES, NBYTES + 8, 4 * NBYTES + 8]
    assert tr.saved_bytes_peak == 3 * NBYTES and tr.must_resident_bytes.max() == 2 * NBYTES
    assert tr.peak_bytes_no_swap == tr.min_feasible_bytes == 2 * NBYTES + 4 * NBYTES + 8  # the last gap
    rep = profiled.report(0.01)
    assert rep.mode == "profile" and rep.evicted_bytes == 3 * NBYTES  # every traced tensor went to the host


def saved_only(tr):
    """``tr`` without R3's other bytes: the saved tensors alone, whose peak a budget can cut here."""
    return replace(tr, events=tuple(replace(e, other_bytes=None) for e in tr.events))


def executing(profiled, plan_of, budget=None, trace=None, **host_kwargs):
    tr = trace or profiled.trace
    layout = lay_out(tr, plan_of(tr), HW, budget or tr.peak_bytes_no_swap, first_sight=profiled.first_sight)
    host = Host(**host_kwargs)
    return ExecuteStep(frame(host, layout, step=2)), host


def test_an_executing_step_follows_its_plan_bit_identically(profiled, w):
    ex, host = executing(profiled, lambda tr: SwapPlan.of(tr, "hand", [Eviction(0, 0, 3)]))  # a out, back after d's unpack
    grad = run(ex, host, w)
    rep = ex.report(0.01)
    assert torch.equal(grad, plain_grad(w))
    assert rep.mode == "execute" and rep.plan_followed and rep.divergence is None
    assert rep.evicted_bytes == NBYTES and rep.prefetched_bytes == NBYTES and rep.on_demand_bytes == 0
    assert rep.copies == 2 and rep.guard_evictions == 0 and host.asked == []  # its own shape: nothing asked
    assert len(rep.gaps_s) == profiled.trace.n_events


def test_the_guard_evicts_by_min_where_a_plan_leaves_no_room(profiled, w):
    tr = saved_only(profiled.trace)
    ex, host = executing(profiled, lambda tr: SwapPlan.of(tr, "keep", []), budget=tr.min_feasible_bytes, trace=tr)
    grad = run(ex, host, w)
    rep = ex.report(0.01)
    assert torch.equal(grad, plain_grad(w))
    assert rep.guard_evictions == 1 and not rep.plan_followed  # a, as d is packed: its next use is the farthest
    assert rep.evicted_bytes == NBYTES and rep.peak_device_bytes <= tr.min_feasible_bytes


def test_a_step_that_leaves_its_trace_finishes_on_demand_and_says_where(profiled, w):
    ex, host = executing(profiled, lambda tr: SwapPlan.of(tr, "hand", [Eviction(0, 0, 3)]))
    grad = run(ex, host, w, extra=True)
    rep = ex.report(0.01)
    assert torch.equal(grad, plain_grad(w, extra=True))
    # tanh's result is a storage the trace lacks (kept, untracked); mul's pack of d is not
    assert rep.mode == "diverged" and rep.divergence.event == 3
    assert rep.divergence.expected == "unpack of tensor 2" and rep.divergence.seen == "pack of tensor 2 again"


def test_strict_raises_where_the_step_leaves_its_trace(profiled, w):
    from swapsched.runtime.reports import DivergenceError

    tr = profiled.trace
    layout = lay_out(tr, SwapPlan.of(tr, "keep", []), HW, tr.peak_bytes_no_swap, first_sight=profiled.first_sight)
    host = Host()
    ex = ExecuteStep(frame(host, layout, step=2, strict=True))
    with pytest.raises(DivergenceError, match="at event 3 the trace expected unpack of tensor 2"):
        run(ex, host, w, extra=True)
    ex.abort()


def test_a_first_tensor_of_other_bytes_asks_the_host_and_hands_over_to_a_profiling_step(profiled):
    ex, host = executing(profiled, lambda tr: SwapPlan.of(tr, "keep", []))
    torch.manual_seed(1)
    wide = torch.nn.Parameter(torch.randn(2 * N))
    grad = run(ex, host, wide)
    assert torch.equal(grad, plain_grad(wide))
    assert host.asked == [2 * NBYTES] and host.grads_kept == 1  # no plan for it: profiled, its grads kept
    assert ex.profile is not None and ex.profile.trace.tensor_bytes.tolist() == [2 * NBYTES] * 3
    assert ex.report(0.01).new_shape


def test_a_first_tensor_of_other_bytes_follows_the_layout_the_host_gives(profiled, w):
    torch.manual_seed(1)
    wide = torch.nn.Parameter(torch.randn(2 * N))
    host = Host()
    first = ProfileStep(frame(host))
    run(first, host, wide)
    wide_layout = lay_out(first.trace, SwapPlan.of(first.trace, "hand", [Eviction(0, 0, 3)]), HW,
                          first.trace.peak_bytes_no_swap, first_sight=first.first_sight)
    ex, host = executing(profiled, lambda tr: SwapPlan.of(tr, "keep", []), shapes={2 * NBYTES: wide_layout})
    grad = run(ex, host, wide)
    rep = ex.report(0.01)
    assert torch.equal(grad, plain_grad(wide))
    assert ex.layout is wide_layout and rep.plan_followed and rep.evicted_bytes == 2 * NBYTES


def test_a_plan_that_moves_nothing_takes_the_hooks_off_once_the_shape_is_confirmed(profiled, w):
    ex, host = executing(profiled, lambda tr: SwapPlan.of(tr, "keep", []), unhook=True)
    grad = run(ex, host, w)
    rep = ex.report(0.01)
    assert torch.equal(grad, plain_grad(w))
    assert rep.unhooked and not host.hooks.on and rep.copies == 0
    # the peak of the plan it follows (it keeps everything: the no-swap peak), and said so
    assert rep.peak_device_bytes == ex.layout.predicted_peak_bytes == ex.layout.trace.peak_bytes_no_swap
    assert "unhooked" in str(rep) and "profiling step" not in str(rep)


def test_a_compiled_model_in_a_plain_loop_is_refused_at_its_first_saved_tensor():
    # was: SpeculationLogDivergence from inside Dynamo, which traced the runtime's own hooks
    from swapsched.deploy import SwapRuntime
    from swapsched.errors import UserError

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
                                  for _ in range(4)))
    compiled = torch.compile(model, backend="aot_eager")
    with SwapRuntime(budget="60%", policy="min", model=model, backend="cpu") as rt:
        with pytest.raises(UserError, match="CompileBackend"), rt.step():
            compiled(torch.randn(32, 64)).square().mean().backward()
        # the runtime is as it was: the same model, called eagerly, trains under it
        for _ in range(4):
            with rt.step():
                model(torch.randn(32, 64)).square().mean().backward()
        assert rt.report().mode == "execute"


def test_the_hooks_are_never_traced_by_dynamo():
    hooks = SavedTensorHooks(lambda t: t, lambda t: t)
    for fn in (hooks.pack, hooks.unpack):
        assert getattr(fn, "_torchdynamo_disable", False), fn
