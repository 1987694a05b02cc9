"""SwapRuntime(model=, optimizer=) under a byte budget no activation plan meets: the state is
planned and moved (R13-R16), training stays bit-identical, every executed step keeps the budget
under both meters, and budgets the state cannot meet are refused with what they need."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from swapsched.agents.registry import get_policy
from swapsched.budget import BudgetError, format_bytes
from swapsched.deploy import SwapRuntime
from swapsched.errors import present
from swapsched.plan import SwapPlan
from swapsched.runtime.profiler import profile, static_bytes_of
from swapsched.zoo import build_model

FAMILY, SIZE = "gpt", "tiny"


def _pair() -> tuple[Any, Any, torch.optim.Optimizer, torch.optim.Optimizer]:
    a, b = build_model(FAMILY, SIZE, seed=3), build_model(FAMILY, SIZE, seed=3)
    return a, b, torch.optim.AdamW(a.model.parameters(), lr=1e-3), torch.optim.AdamW(b.model.parameters(), lr=1e-3)


def _step_both(rt: SwapRuntime, a: Any, b: Any, i: int) -> None:
    """Step ``i``: forward and backward of ``a`` under ``rt`` and of ``b`` plainly, equal losses."""
    with rt.step():
        la = a.loss()
        la.backward()
    lb = b.loss()
    lb.backward()
    assert torch.equal(la, lb), f"step {i}: losses differ"


@pytest.fixture(scope="module")
def floors() -> dict[str, int]:
    """The step's static bytes, its smallest feasible budget with the activations alone, and with
    the state movable (R14), from a profile with the state recorded."""
    case = build_model(FAMILY, SIZE, seed=3)
    trace = profile(case.model, case.inputs, case.loss_fn, name="gpt-tiny", state="adamw")
    return {"static": trace.static_bytes, "activations": trace.min_feasible_bytes, "movable": trace.min_feasible_bytes_movable,
            "floor": trace.min_feasible_bytes - trace.static_bytes,
            # beside the static bytes with every gradient counted static all step
            "room": int((trace.other_bytes + trace.must_resident_bytes).max())}


def test_a_budget_below_the_static_bytes_moves_the_state_and_trains_bit_identically(floors: dict[str, int]) -> None:
    # the budget, half the static bytes plus the activation floor, with the floor counted
    # twice: the live steps hold their saved tensors longer than this profile says (R2's measured
    # frees), and what their backward holds beyond them counts there (R3)
    budget = floors["static"] // 2 + 2 * floors["floor"]
    assert floors["movable"] <= budget < floors["activations"]
    a, b, opt_a, opt_b = _pair()
    assert static_bytes_of(a.model, opt_a) <= floors["static"]
    steps, executed, traced = 10, 0, False
    with SwapRuntime(budget=budget, policy="default", model=a.model, optimizer=opt_a, backend="cpu", audit=True) as rt:
        for i in range(steps):
            _step_both(rt, a, b, i)
            for opt, model in ((opt_a, a.model), (opt_b, b.model)):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            rep = rt.report()
            if i == 0:  # R17: profiled with every group's state on the host (it cannot stay on the device)
                assert rep.mode == "profile" and rt.mover is not None
                assert set(rt.mover.placement.values()) == {"full"} and rt.mover.measured_device_bytes() == 0
            if rep.mode == "execute":
                assert rep.state is not None and rep.state.placements, "the plan moved no state"
                assert rep.peak_device_bytes is not None and rep.peak_device_bytes <= budget, \
                    f"step {i}: {format_bytes(rep.peak_device_bytes or 0)} over {format_bytes(budget)}"
                assert rep.measured_peak_bytes is not None and rep.measured_peak_bytes <= budget
                assert "state off the device" in str(rep)
                executed += 1
                # (none after a re-timing that checkpointed blocks: the next steps are profiled again)
                traced |= rt.trace is not None and bool(rt.trace.state) and rt.plan is not None and bool(rt.plan.state)
        assert executed >= 3 and traced, "the runtime's trace and plan record the state"
    # closed: the state is back on the device, and every tensor equals the plain run's
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), n
        for k, v in opt_a.state[p].items():
            assert torch.equal(v, opt_b.state[q][k]), (n, k)


def test_gradients_count_from_their_birth_with_the_state_moving_until_a_step_begins_with_them(floors: dict[str, int]) -> None:
    # R3 with R13: the blocks step on the host, the embeddings and the final norm stay on the
    # device, where their gradients are born in backward; the static bytes leave every gradient
    # out, and both meters keep the budget. Step 5 begins with the gradients of step 4 (accumulating):
    # from then on they count as static, and the steps are profiled and planned again
    budget = floors["static"] * 85 // 100 + 2 * floors["room"]
    a, b, opt_a, opt_b = _pair()
    with SwapRuntime(budget=budget, policy="default", model=a.model, optimizer=opt_a, backend="cpu", audit=True) as rt:
        for i in range(10):
            _step_both(rt, a, b, i)
            rep = rt.report()
            if rep.mode == "execute":
                assert rep.peak_device_bytes is not None and rep.peak_device_bytes <= budget, (i, rep.peak_device_bytes)
                assert rep.measured_peak_bytes is not None and rep.measured_peak_bytes <= budget, (i, rep.measured_peak_bytes)
            if i == 4:
                trace, layout = present(rt.trace, "a trace"), present(rt.layout, "a layout")
                assert rep.mode == "execute" and trace.state_gradients_born
                where = present(rt.plan, "a plan").placement()
                kept = [g for g in trace.state if where.get(g.name, "device") == "device"]
                # the blocks step on the host (host-step or full, as the measured gaps decide)
                assert kept and {w for _, w in present(rep.state, "its state").placements} <= {"host-step", "full"}
                # no gradient is static: a kept group's parameter and optimizer state are,
                # host-step's parameter is, full's nothing; those kept are held from their birth
                static = {"device": ("param_bytes", "optim_bytes"), "host-step": ("param_bytes",), "full": ()}
                assert layout.step_static_bytes == trace.fixed_bytes + sum(
                    getattr(g, part) for g in trace.state for part in static[where.get(g.name, "device")])
                # in the last gap, beside what the trace measured: each kept gradient made by then
                # (the token embedding's is made after the last saved tensor's unpack: in the tail)
                # and the room of each host-placed gradient that gap makes (R4 with R14)
                last = trace.n_events - 1
                born = [g for g in kept if g.backward_at < trace.n_events]
                coming = [g for g in trace.state if g not in kept and g.backward_at < last <= g.grad_at]
                assert born and layout.other_held[-1] - int(trace.other_bytes[-1]) == sum(
                    g.grad_bytes for g in born + coming)
            if i == 5:
                assert rep.mode == "profile"
            if i != 4:  # step 5 adds into step 4's gradients, as the plain run does
                for opt in (opt_a, opt_b):
                    opt.step()
                    opt.zero_grad()
        assert rep.mode == "execute" and not present(rt.trace, "a trace").state_gradients_born
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_byte_budget_the_activations_meet_keeps_its_plan_when_a_step_begins_with_gradients(floors: dict[str, int]) -> None:
    # the state need not move, so the trace records none and counts the gradients static: a step
    # that begins with gradients (accumulating) changes nothing there, and is not profiled again
    budget = floors["static"] + 2 * floors["room"]
    a, b, opt_a, opt_b = _pair()
    with SwapRuntime(budget=budget, policy="default", model=a.model, optimizer=opt_a, backend="cpu", tune=False) as rt:
        for i in range(7):
            _step_both(rt, a, b, i)
            if i >= 3:
                assert rt.report().mode == "execute", (i, rt.report().mode)
                assert not present(rt.trace, "a trace").state
            if i != 4:  # step 5 adds into step 4's gradients
                for opt in (opt_a, opt_b):
                    opt.step()
                    opt.zero_grad()
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_budget_the_state_cannot_meet_says_what_it_needs_and_the_host_memory(floors: dict[str, int]) -> None:
    a, _, opt_a, _ = _pair()
    budget = floors["movable"] - 1
    with SwapRuntime(budget=budget, policy="default", model=a.model, optimizer=opt_a, backend="cpu") as rt, \
            pytest.raises(BudgetError, match="host memory for the state"):
        for _ in range(4):
            with rt.step():
                a.loss().backward()


def test_a_host_budget_that_cannot_hold_what_must_move_is_refused(floors: dict[str, int]) -> None:
    a, _, opt_a, _ = _pair()
    budget = floors["static"] // 2 + floors["floor"]
    with SwapRuntime(budget=budget, policy="default", model=a.model, optimizer=opt_a, backend="cpu",
                     host_budget=1024) as rt, pytest.raises(BudgetError, match="the host budget, 1.00 KiB, keeps on the device"):
        for _ in range(4):
            with rt.step():
                a.loss().backward()
            assert rt.mover is None  # the host budget cannot hold the state: profiled where it is


def test_without_the_optimizer_the_budget_covers_what_it_did() -> None:
    # the model alone: the state is not the runtime's to move, and a byte budget below the
    # activations' floor is refused as before
    a, _, _, _ = _pair()
    with SwapRuntime(budget="1KiB", policy="default", model=a.model, backend="cpu") as rt:
        with pytest.raises(BudgetError, match="smallest feasible"):
            for _ in range(4):
                with rt.step():
                    a.loss().backward()
        assert rt.mover is None


def test_a_step_profiled_with_the_state_on_the_host_measures_the_same_other_bytes(floors: dict[str, int]) -> None:
    # R3/R17: the parameters a mover fetches onto the device during profiling are the state's,
    # counted by its placement. The device storage it made for each was measured as the step's
    # own bytes (other bytes) as well, from its first fetch to the step's end: every backward gap
    # then read all the parameters' bytes high, counted twice by the planner
    traces = []
    for budget in ("100%", floors["static"] // 2 + 2 * floors["floor"]):
        a, _, opt, _ = _pair()
        with SwapRuntime(budget=budget, policy="min", model=a.model, optimizer=opt, backend="cpu") as rt:
            with rt.step():
                a.loss().backward()
            opt.step()
            opt.zero_grad()
            moving = rt.mover is not None
            for _ in range(rt.profile_steps - 1):
                with rt.step():
                    a.loss().backward()
                opt.step()
                opt.zero_grad()
            traces.append((moving, rt.trace))
    (kept, t_kept), (moved, t_moved) = traces
    assert not kept and moved and t_moved.state
    # ... but the gradients: the state kept, a relative budget counts each from its birth (R3),
    # in the gap's most with what else it held then; the moved step's are its state's
    assert "gradients_born" in t_kept.meta and "gradients_born" not in t_moved.meta
    kept_other, born = t_kept.other_bytes, t_kept.gradients_born_so_far
    assert (t_moved.other_bytes <= kept_other).all() and (kept_other - born <= t_moved.other_bytes).all()
    assert t_kept.other_bytes[: t_kept.backward_start].tolist() == t_moved.other_bytes[: t_moved.backward_start].tolist()


class SelectiveFull:
    """Checkpoint-selective's blocks with every group's state ``full`` (fetched for each use)."""

    name = "selective-full"

    def plan(self, trace: Any, budget: int, hardware: Any) -> SwapPlan:
        p = get_policy("checkpoint-selective").plan(trace, budget, hardware)
        return SwapPlan.of(trace, self.name, p.evictions, recompute=p.recompute, selective=p.selective,
                           state={g.name: "full" for g in trace.state if not g.frozen}, host_step="after-backward")


def test_selectively_checkpointed_blocks_run_with_the_state_fetched_for_each_use(floors: dict[str, int]) -> None:
    # the state mover's fetch in a block's recompute ran inside selective checkpointing's mode,
    # which refuses any op its forward did not run: "aten.empty.memory_format encountered during
    # backward but not found in storage" (run --compare, gpt small, AdamW at 40%); at the budget
    # of the first test here
    a, b, opt_a, opt_b = _pair()
    reports = []
    budget = floors["static"] // 2 + 2 * floors["floor"]
    with SwapRuntime(budget=budget, policy=SelectiveFull(), backend="cpu", model=a.model, optimizer=opt_a) as rt:
        for i in range(14):
            _step_both(rt, a, b, i)
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


def test_the_state_movers_host_time_is_kept_out_of_the_gaps_and_fitted_per_tensor(floors: dict[str, int], monkeypatch) -> None:
    # each gradient the mover takes costs it 2 ms more (a sleep in its post-accumulate hook): an
    # executed step counts that in state_host_s, not in the gaps the trace is re-timed from (R1),
    # and the hardware's state_hook_s, fitted from those steps, holds it per tensor (R6/R8)
    from swapsched.runtime.state_mover import StateMover

    calls = [0]
    grad_ready = StateMover._grad_ready

    def slow(self: StateMover, mp: Any) -> None:
        if self.in_step:
            calls[0] += 1
            time.sleep(2e-3)
        grad_ready(self, mp)

    monkeypatch.setattr(StateMover, "_grad_ready", slow)
    a, b, opt_a, _ = _pair()
    budget = floors["static"] // 2 + 2 * floors["floor"]
    with SwapRuntime(budget=budget, policy="default", model=a.model, optimizer=opt_a, backend="cpu", tune=False) as rt:
        for _ in range(rt.profile_steps + 4):
            calls[0] = 0
            with rt.step():
                a.loss().backward()
            opt_a.step()
            opt_a.zero_grad()
            rep = rt.report()
        assert rep.mode == "execute" and rep.gaps_s is not None and rep.state_host_s is not None and calls[0] > 0
        slept = 2e-3 * calls[0]
        assert rep.state_host_s >= slept and rep.state_tensors == len(present(rt.mover, "the mover").params)
        assert sum(rep.gaps_s) + (rep.tail_s or 0.0) + (rep.hook_s or 0.0) + rep.state_host_s + rep.stall_s <= rep.step_s
        assert sum(rep.gaps_s) + (rep.tail_s or 0.0) <= rep.step_s - slept
        assert rt.hardware.state_hook_s >= 2e-3 * calls[0] / rep.state_tensors * 0.9


class StreamedEnds:
    """The first five groups ``stream-full``, the last six ``stream``, the middle ones kept: the
    plan `default` chose under a host budget of a quarter of the state (test_state_disk.py)."""

    name = "streamed-ends"

    def plan(self, trace: Any, budget: int, hardware: Any) -> SwapPlan:
        where = {g.name: "stream-full" if int(g.name) < 5 else "stream" for g in trace.state if int(g.name) < 5 or int(g.name) >= 10}
        return SwapPlan.of(trace, self.name, (), state=where, host_step="after-backward")


def test_a_host_placed_gradient_has_its_room_before_autograd_makes_it() -> None:
    # a stream-full group's gradient is made by autograd, unasked, in the gap that completes it,
    # while its parameter, the next group's fetched one and that gap's transients are there; the
    # mover counted it only at its hook, and let the one before it go only at the next gradient's
    # hook: the audit measured 4,309 B over the budget every step. Its room is now held from its
    # group's backward on, waiting for the gradients on their way to the host (R4 with R14)
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(16)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 128)
    budget = int(0.6 * static_bytes_of(model, opt))
    executed = 0
    with SwapRuntime(budget=budget, policy=StreamedEnds(), model=model, optimizer=opt, backend="cpu", audit=True) as rt:
        for _ in range(6):
            with rt.step():
                model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            rep = rt.report()
            if rep.mode == "execute":
                executed += 1
                assert rep.peak_device_bytes is not None and rep.peak_device_bytes <= budget
                assert rep.measured_peak_bytes is not None and rep.measured_peak_bytes <= budget, rep.measured_peak_bytes - budget
    assert executed >= 2
