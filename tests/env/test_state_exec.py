"""env/state_exec.py: the state plan in the simulated step (R13-R16), timed by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from swapsched.budget import relative_scale
from swapsched.env.simulator import simulate
from swapsched.env.state_parts import host_gradients_coming, optimizer_rates
from swapsched.plan import SwapPlan
from swapsched.state import MEASURED_OPTIMIZER_RATES, StateGroup
from swapsched.trace import STATE_GRADIENTS_BORN, Trace
from tests.conftest import make_hw, make_trace


def two_groups(p0: int = 100, p1: int = 100) -> Trace:
    """blk.0 packs T0 at e0 and unpacks it at e3; blk.1 packs T1 at e1, unpacks it at e2; 100 B
    tensors, 1 s gaps, no tail (ideal 4 s). Each group: a parameter of p bytes (p / 4 fp32
    elements), its gradient as large, 200 B of optimizer state."""
    t = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)],
                   modules=["blk.0.fc", "blk.1.fc"])
    groups = []
    for name, p in (("blk.0", p0), ("blk.1", p1)):
        fa, fe, ba, ga = t.group_events(name)
        groups.append(StateGroup(name, p // 4, p, p, 200, fa, fe, ba, ga))
    static = sum(g.bytes for g in groups)
    return replace(t, static_bytes=static, state=tuple(groups), meta={"optimizer": "adamw"})


# 25 parameters a second on the host: one group's step takes 1 s; the device's step is ~1e-9 s
HW = replace(make_hw(), host_optimizer_params_per_s=25.0)


def plan(trace: Trace, **state: str) -> SwapPlan:
    return SwapPlan.of(trace, "hand", [], state={k.replace("_", "."): v for k, v in state.items()})


def test_the_events_of_a_group_come_from_its_saved_tensors():
    t = two_groups()
    assert t.group_events("blk.0") == (0, 0, 3, 4)  # its gradient completes in the tail
    assert t.group_events("blk.1") == (1, 1, 2, 3)  # after the gap that follows its unpack
    assert t.group_events("embed") == (0, 0, 2, 4)  # none of its own: first gap, complete at the tail
    assert t.fixed_bytes == 0 and t.static_bytes == 800


def test_state_on_the_device_is_the_step_every_activation_plan_had():
    t = two_groups()
    r = simulate(t, plan(t), HW, 1000)
    assert r.iteration_s == pytest.approx(4.0) and r.peak_bytes == 1000 and r.state is not None
    assert r.state.off_bytes == 0 and r.state.host_step_s == 0 and r.state.where_stepped == "device"


def test_gradients_the_step_makes_are_on_the_device_from_their_groups_backward():
    # R3 with R13: the step began with no gradient. Static: parameters 200 + optimizer 400.
    # blk.1's gradient is made at e2, its backward; blk.0's at e3, with T0 (unpacked there) still
    # held: 600 + T0 + both gradients = 900. Counted static all step: 800 + T0 + T1 = 1000
    t = two_groups()
    born = replace(t, meta={**t.meta, STATE_GRADIENTS_BORN: True})
    assert simulate(t, plan(t), HW, 1000).peak_bytes == 1000 and simulate(t, plan(t), HW, 999).oom
    r = simulate(born, plan(born), HW, 900)
    assert not r.oom and r.peak_bytes == 900 and r.iteration_s == pytest.approx(4.0)
    assert simulate(born, plan(born), HW, 899).oom
    # the trace's counts take each gradient from the gap whose end makes it (blk.0's: gap 3, with
    # T0): nothing evicted, 900 at most, as simulated; a relative budget keeps its bytes (R3)
    assert (t.peak_bytes_no_swap, born.peak_bytes_no_swap, born.min_feasible_bytes) == (1000, 900, 900)
    assert relative_scale(born) == relative_scale(t) == (800, 1000)
    # stream: blk.0's optimizer state comes in for its device step, its gradient is born as before
    assert simulate(born, plan(born, blk_0="stream"), HW, 800).peak_bytes == 800


def test_a_stream_in_leaves_room_for_the_gradients_yet_to_be_born():
    # R3 with R15, budget 800: blk.0 on the device (static: parameter and optimizer state, 300),
    # blk.1 streamed (its parameter, 100). blk.1's gradient completes as e3 starts (t 3); its 200 B
    # of optimizer state would fit beside 400 + T0 + that gradient, but blk.0's gradient, born at
    # e3, needs 100 of it: the stream-in waits for backward's end (t 4) and takes 2 s over the
    # link: 6 s. Admitted at t 3, the birth took its room back and it came in twice: 7 s
    born = replace(two_groups(), meta={"optimizer": "adamw", STATE_GRADIENTS_BORN: True})
    r = simulate(born, plan(born, blk_1="stream"), HW, 800)
    assert not r.oom and r.iteration_s == pytest.approx(6.0) and r.peak_bytes == 800


def test_a_parameter_copied_out_after_forward_comes_back_for_backward():
    # blk.0's 100 B parameter goes out after gap 0 (t 1-2), comes back from the event before
    # its backward (fetched after gap 2, t 3-4): ready as event 3 needs it, no stall
    t = two_groups()
    r = simulate(t, plan(t, blk_0="param"), HW, 1000)
    assert r.iteration_s == pytest.approx(4.0, abs=1e-6) and not r.oom
    assert (r.d2h_bytes, r.h2d_bytes) == (100, 100) and r.state is not None and r.state.param_off_bytes == 100
    # gap 1 holds it still (its copy lands at t 2): 700 static + 100 parameter + T0 + T1
    assert r.peak_bytes == 1000


def test_a_parameter_fetched_late_stalls_its_use():
    # 200 B: out t 1-3, fetched from t 3 (after gap 2), lands at 5: event 3 (t 4) waits 1 s
    t = two_groups(p0=200)
    r = simulate(t, plan(t, blk_0="param"), HW, 2000)
    assert r.iteration_s == pytest.approx(5.0, abs=1e-6) and r.state is not None and r.state.stall_s == pytest.approx(1.0)


def test_a_host_step_that_ends_after_the_next_forward_use_stalls_it():
    # blk.1's gradient completes at event 3 (t 3), lands on the host at 4, the host steps it 4-5,
    # the parameter goes back 5-6. The step ends at 4, so the next step's forward of blk.1 (at
    # t 1) waits for 2: a 1 s stall; in the steady state the step is 5 s
    t = two_groups()
    r = simulate(t, plan(t, blk_1="host-step"), HW, 1000)
    assert r.iteration_s == pytest.approx(5.0, abs=1e-6)
    assert r.state is not None and r.state.host_step_s == pytest.approx(1.0) and r.state.stall_s == pytest.approx(1.0)
    assert r.state.grad_off_bytes == 100 and r.state.optim_off_bytes == 200 and r.state.where_stepped == "both"
    # the host holds its parameter, gradient and state
    assert r.host_peak_bytes == 400


def test_the_users_optimizer_as_measured_steps_in_place_of_the_hardwares_rates():
    # R15: measured, 50 parameters a second on the device and 10 on the host. blk.1 steps on the
    # host (25 parameters: 2.5 s, 4-6.5, from its gradient on the host at 4), blk.0 on the device
    # after the tail (0.5 s: the step ends at 4.5). The parameter's copy back lands at 7.5, 3 s
    # into the next step: its forward use of blk.1 (t 1) waits 2 s, and so every step from
    # then on: 6.5 s. Unmeasured, the hardware's rates (25 a second on the host, ~1e-9 s on the
    # device): 5 s, as above
    t = two_groups()
    measured = replace(t, meta={**t.meta, MEASURED_OPTIMIZER_RATES: {"device": 50.0, "host": 10.0}})
    assert optimizer_rates(measured, HW) == (50.0, 10.0)
    assert optimizer_rates(t, HW) == (HW.device_optimizer_rate(28.0), 25.0)
    r = simulate(measured, plan(measured, blk_1="host-step"), HW, 1000)
    assert r.state is not None and r.state.host_step_s == pytest.approx(2.5) and r.state.device_step_s == pytest.approx(0.5)
    assert r.iteration_s == pytest.approx(6.5, abs=1e-6) and r.state.stall_s == pytest.approx(2.0)
    assert simulate(t, plan(t, blk_1="host-step"), HW, 1000).iteration_s == pytest.approx(5.0, abs=1e-6)
    # one of them measured: the other is the hardware's
    host_only = replace(t, meta={**t.meta, MEASURED_OPTIMIZER_RATES: {"host": 10.0}})
    assert optimizer_rates(host_only, HW) == (HW.device_optimizer_rate(28.0), 10.0)
    # the rates are the profiling machine's: a trace re-timed by roofline for other hardware drops them
    flops = replace(measured, events=tuple(replace(e, flops=1.0) for e in measured.events))
    assert MEASURED_OPTIMIZER_RATES not in flops.retimed(HW).meta


def test_the_host_step_after_backward_waits_for_backward():
    # after-backward: blk.1's step starts when backward ends (t 4) instead of when its gradient
    # lands (t 4 too here): the same; blk.0 too: its gradient lands at 5 (tail), stepped 5-6
    t = two_groups()
    both = plan(t, blk_0="host-step", blk_1="host-step")
    r = simulate(t, replace(both, host_step="after-backward"), HW, 1000)
    assert r.state is not None and r.state.host_step_s == pytest.approx(2.0)
    assert not r.oom and r.iteration_s >= 5.0


def test_a_host_budget_that_cannot_hold_a_groups_state_keeps_it_on_the_device():
    t = two_groups()
    r = simulate(t, plan(t, blk_1="host-step"), replace(HW, host_budget_bytes=300), 1000)
    kept = simulate(t, plan(t), HW, 1000)
    assert r.state is not None and r.state.skipped == 1 and r.state.off_bytes == 0
    assert r.iteration_s == kept.iteration_s and r.peak_bytes == kept.peak_bytes


def test_below_the_static_bytes_only_a_state_plan_fits():
    # 700 B: less than the 800 B of state; full offload of both groups fits, keeping it does not
    t = two_groups()
    assert simulate(t, plan(t), HW, 700).oom
    r = simulate(t, plan(t, blk_0="full", blk_1="full"), HW, 700)
    assert not r.oom and r.peak_bytes <= 700


def test_a_streamed_optimizer_state_comes_in_for_the_device_step():
    # blk.1's 200 B of state come in as its gradient completes (t 3, lands 5), the device steps
    # it after the tail (t 4: waits to 5), then it goes out
    t = two_groups()
    r = simulate(t, plan(t, blk_1="stream"), HW, 1000)
    assert r.iteration_s == pytest.approx(5.0, abs=1e-6)
    assert r.state is not None and r.state.optim_off_bytes == 200 and r.h2d_bytes == 200 and r.d2h_bytes == 200


def test_a_stream_in_admitted_ahead_gives_its_room_back_to_the_compute():
    # blk.0 packs T0 (e0) and T2 (e1), blk.1 packs T1 (e2); unpacks T1, T2, T0; 1 s gaps, 100 B
    # tensors, 250 B of other bytes in the last gap. blk.1 streams: static 600 (blk.0's 400, blk.1's
    # parameter and gradient). Its 200 B of state are admitted as its gradient completes (before
    # gap 4: room 1100 - 600 - T0 - T2 = 300; copy 4-6). Gap 5 needs 250 with T0 held: room only
    # once the stream-in goes: it is taken back when its copy lands (t 6, a 1 s stall), gap 5 runs
    # 6-7, and after backward it comes in again (7-9) for the device step; 9 s, where it ran out of
    # memory while the stream-in held its room to the step's end
    t = make_trace([100, 100, 100], [("pack", 0, 1.0), ("pack", 2, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0),
                                     ("unpack", 2, 1.0), ("unpack", 0, 1.0)],
                   modules=["blk.0.fc", "blk.1.fc", "blk.0.out"], other=[0, 0, 0, 0, 0, 250])
    groups = tuple(StateGroup(n, 25, 100, 100, 200, *t.group_events(n)) for n in ("blk.0", "blk.1"))
    t = replace(t, static_bytes=800, state=groups, meta={"optimizer": "adamw"})
    r = simulate(t, plan(t, blk_1="stream"), HW, 1100)
    assert not r.oom and r.iteration_s == pytest.approx(9.0, abs=1e-6) and r.peak_bytes <= 1100
    assert (r.h2d_bytes, r.d2h_bytes) == (400, 200)  # in twice, out once
    # with room for it to stay, it comes in once and the step is 6 s
    r = simulate(t, plan(t, blk_1="stream"), HW, 1200)
    assert r.iteration_s == pytest.approx(6.0, abs=1e-6) and r.h2d_bytes == 200


def test_after_backward_the_state_streams_in_once_backward_is_done():
    # as the runtime runs a plan (host_step after-backward: the state comes in at
    # optimizer.step()): blk.1's stream-in waits for the tail (t 4), lands at 6, the step follows
    t = two_groups()
    r = simulate(t, SwapPlan.of(t, "hand", [], state={"blk.1": "stream"}, host_step="after-backward"), HW, 1000)
    assert r.iteration_s == pytest.approx(6.0, abs=1e-6)


def frozen_and_trainable() -> Trace:
    """two_groups' events; blk.0's modules hold only a frozen 100 B parameter (R13: no gradient,
    no state), blk.1 a trainable one as two_groups'. Static: 100 + 400 B."""
    t = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)],
                   modules=["blk.0.fc", "blk.1.fc"])
    frozen = StateGroup("blk.0/frozen", 25, 100, 0, 0, *t.group_events("blk.0/frozen"), frozen=True)
    trains = StateGroup("blk.1", 25, 100, 100, 200, *t.group_events("blk.1"))
    return replace(t, static_bytes=500, state=(frozen, trains), meta={"optimizer": "adamw"})


def test_a_frozen_group_on_the_host_is_fetched_for_each_use_and_never_copied_out_or_stepped():
    t = frozen_and_trainable()
    assert t.group_events("blk.0/frozen") == t.group_events("blk.0") == (0, 0, 3, 4)  # its modules' events
    kept = simulate(t, plan(t), HW, 1000)
    r = simulate(t, plan(t, **{"blk.0/frozen": "full"}), HW, 1000)
    # fetched for forward (issued as the step starts: 100 B at 100 B/s, event 0 waits 1 s) and
    # again for backward; no gradient to copy out, nothing for the host to step
    assert (r.d2h_bytes, r.h2d_bytes) == (0, 200) and r.state is not None
    assert r.state.host_step_s == 0 and r.state.stall_s == pytest.approx(1.0) and r.iteration_s == pytest.approx(5.0, abs=1e-6)
    assert (r.state.param_off_bytes, r.state.grad_off_bytes, r.state.optim_off_bytes) == (100, 0, 0)
    assert r.peak_bytes <= kept.peak_bytes and kept.iteration_s == pytest.approx(4.0, abs=1e-6)


def test_a_frozen_group_takes_no_placement_that_steps_or_copies_a_gradient():
    from swapsched.plan import PlanError

    t = frozen_and_trainable()
    for where in ("param", "host-step", "stream", "stream-full"):
        with pytest.raises(PlanError, match="is frozen"):
            plan(t, **{"blk.0/frozen": where}).validate(t)


def test_the_state_mover_costs_the_host_each_copy_and_its_hooks_per_tensor():
    # R6/R8 with R13: blk.0 is 3 parameter tensors placed "param", at 0.1 s a copy issued and
    # 0.05 s of the mover's hooks per tensor a step. Its copy out is issued after gap 0 (t 1):
    # 0.3 s paid before gap 1; its fetch after gap 2 (t 3.3, landing at 4.3): 0.3 s before gap 3,
    # which ends at 4.6, past the fetch (no stall); its gradient completes after the tail: 0.15 s.
    # 4 s of compute and 0.75 s of the host's
    t = two_groups()
    t = replace(t, state=(replace(t.state[0], tensors=3), t.state[1]))
    hw = replace(HW, copy_issue_s=0.1, state_hook_s=0.05)
    r = simulate(t, plan(t, blk_0="param"), hw, 1000)
    assert r.iteration_s == pytest.approx(4.75, abs=1e-6) and r.host_s == pytest.approx(0.75, abs=1e-6)
    assert r.state is not None and r.state.stall_s == 0
    # on the device, nothing moves and the mover costs nothing
    assert simulate(t, plan(t), hw, 1000).iteration_s == pytest.approx(4.0, abs=1e-6)


def test_the_room_of_a_host_placed_gradient_is_held_from_after_its_backward_to_the_gap_that_makes_it() -> None:
    # R4 with R14, by hand: a group's gradient is made in the gap that ends at its grad_at; the
    # simulator allocates it at the event backward_at; two host-placed groups whose windows touch
    # (one's backward_at is the other's grad_at) never hold room at once; kept ones hold none here
    groups = (StateGroup("a", 1, 4, 10, 8, 0, 1, 6, 8), StateGroup("b", 1, 4, 100, 8, 2, 3, 4, 6),
              StateGroup("c", 1, 4, 1000, 8, 2, 3, 4, 6), StateGroup("d", 1, 4, 7, 8, 0, 1, 9, 9))
    held = host_gradients_coming(groups, ["full", "host-step", "device", "stream-full"], 9)
    assert held.tolist() == [0, 0, 0, 0, 0, 100, 100, 10, 10, 7]
    assert not host_gradients_coming(groups, ["device", "stream", "param", "device"], 9).any()
