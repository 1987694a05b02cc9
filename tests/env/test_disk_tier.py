"""env/disk_tier.py: the disk tier in the simulated step (R19), timed by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from swapsched.agents.state_search import spill_to_disk
from swapsched.env.simulator import simulate
from swapsched.env.state_parts import disk_parts, staging_bytes, state_split
from swapsched.hardware import Hardware
from swapsched.plan import PlanError, SwapPlan
from swapsched.state import StateGroup
from swapsched.trace import Trace
from tests.conftest import make_trace
from tests.env.test_state_exec import HW, two_groups


def disk_hw(read: float = 100.0, write: float = 100.0, budget: int = 10**4, host: int | None = None) -> Hardware:
    """``HW`` (a group's host step 1 s, the link 100 B/s) with a drive of ``read`` and ``write`` B/s."""
    return replace(HW, disk_read_bytes_per_s=read, disk_write_bytes_per_s=write, disk_budget_bytes=budget,
                   host_budget_bytes=host)


def placed(trace: Trace, disk: dict[str, str] | None = None, **state: str) -> SwapPlan:
    return SwapPlan.of(trace, "hand", [], state={k.replace("_", "."): v for k, v in state.items()}, disk=disk)


def test_the_optimizer_state_read_for_the_host_step_and_written_after_it():
    # two_groups' blk.1 host-stepped (5 s steady state: its forward waits 1 s for last step's
    # parameter). Its 200 B of state rest on the disk (100 B/s each way): last step's write lands
    # at 3 in this step's clock, the read runs 3-5, as the gradient lands (5): the host steps 5-6,
    # writes 6-8. Nothing slower than the host alone; the host holds the parameter, the gradient
    # and one staging slot of 200 B
    t = two_groups()
    hw = disk_hw()
    r = simulate(t, placed(t, {"blk.1": "optim"}, blk_1="host-step"), hw, 1000, record=True)
    on_host = simulate(t, placed(t, blk_1="host-step"), hw, 1000)
    assert r.iteration_s == pytest.approx(5.0, abs=1e-6) == on_host.iteration_s
    s = r.state
    assert s is not None and (s.disk_bytes, s.disk_read_bytes, s.disk_written_bytes, s.staging_bytes) == (200, 200, 200, 200)
    assert r.timeline is not None
    assert [x[:2] for x in r.timeline.disk_reads] == [pytest.approx((3.0, 5.0), abs=1e-6)]
    assert [x[:2] for x in r.timeline.disk_writes] == [pytest.approx((6.0, 8.0), abs=1e-6)]
    assert r.host_peak_bytes == 400 and on_host.state is not None and on_host.state.disk_bytes == 0


def test_a_slow_disk_holds_each_step_to_its_read_step_and_write():
    # reads at 50 B/s: the read (4 s) waits for last step's write (lands at 5), the host steps
    # 9-10 and writes 10-12, the parameter goes back 10-11: the next forward of blk.1 (at 1)
    # waits to 4, 3 s stalled: 7 s a step
    t = two_groups()
    r = simulate(t, placed(t, {"blk.1": "optim"}, blk_1="host-step"), disk_hw(read=50.0), 1000)
    assert r.iteration_s == pytest.approx(7.0, abs=1e-6) and r.state is not None
    assert r.state.stall_s == pytest.approx(3.0, abs=1e-6)


def test_a_parameter_on_the_disk_is_read_for_each_fetch():
    # full with its master on the disk: read for the forward fetch, for the backward fetch, and
    # with the state for the host step (100 + 100 + 300 B); the step writes both back (300 B)
    t = two_groups()
    r = simulate(t, placed(t, {"blk.1": "state"}, blk_1="full"), disk_hw(), 1000)
    assert r.state is not None and (r.state.disk_read_bytes, r.state.disk_written_bytes) == (500, 300)
    assert r.iteration_s > simulate(t, placed(t, blk_1="full"), disk_hw(), 1000).iteration_s


def test_a_disk_budget_that_cannot_hold_a_group_rests_it_on_the_host():
    t = two_groups()
    r = simulate(t, placed(t, {"blk.1": "optim"}, blk_1="host-step"), disk_hw(budget=199), 1000)
    on_host = simulate(t, placed(t, blk_1="host-step"), disk_hw(budget=199), 1000)
    assert r.state is not None and (r.state.disk_skipped, r.state.disk_bytes, r.state.disk_read_bytes) == (1, 0, 0)
    assert r.iteration_s == on_host.iteration_s and r.host_peak_bytes == on_host.host_peak_bytes


def test_without_a_disk_budget_nothing_rests_on_the_disk():
    t = two_groups()
    r = simulate(t, placed(t, {"blk.1": "optim"}, blk_1="host-step"), HW, 1000)
    assert r.state is not None and r.state.disk_bytes == 0 and r.state.disk_skipped == 1


def four_groups() -> Trace:
    """Four blocks packing T0-T3 (e0-e3), unpacked in reverse; 1 s gaps, 100 B tensors. Each
    group: a 100 B parameter, its gradient, 800 B of optimizer state: 4000 B of state."""
    t = make_trace([100] * 4, [("pack", k, 1.0) for k in range(4)] + [("unpack", k, 1.0) for k in (3, 2, 1, 0)],
                   modules=[f"blk.{k}.fc" for k in range(4)])
    groups = tuple(StateGroup(f"blk.{k}", 25, 100, 100, 800, *t.group_events(f"blk.{k}")) for k in range(4))
    return replace(t, static_bytes=4000, state=groups, meta={"optimizer": "adamw"})


def test_the_disk_holds_what_the_host_budget_cannot():
    # all host-stepped the host needs 4 x 1000 B; a 3300 B host budget holds three groups, and
    # the fourth stays on the device (R11). With each group's state on the disk the host holds
    # 4 x 200 B and three 800 B staging slots: 3200 B, every group off the device
    t = four_groups()
    everything = {f"blk.{k}": "host-step" for k in range(4)}
    hw = disk_hw(host=3300)
    assert state_split(t.state, everything)[1] == 4000
    disk = spill_to_disk(t, everything, hw)
    assert disk == {f"blk.{k}": "optim" for k in range(4)}
    assert staging_bytes(t.state, everything, disk) == 2400 and state_split(t.state, everything, disk)[1] == 3200
    no_disk = simulate(t, SwapPlan.of(t, "hand", [], state=everything), hw, 10**4)
    r = simulate(t, SwapPlan.of(t, "hand", [], state=everything, disk=disk), hw, 10**4)
    assert no_disk.state is not None and no_disk.state.skipped == 1
    assert r.state is not None and r.state.skipped == 0 and r.state.disk_bytes == 3200 and r.host_peak_bytes == 3200
    assert r.peak_bytes < no_disk.peak_bytes  # the fourth group's state left the device too


def test_spilling_puts_nothing_on_the_disk_the_host_can_hold():
    t = four_groups()
    everything = {f"blk.{k}": "host-step" for k in range(4)}
    assert spill_to_disk(t, everything, disk_hw(host=4000)) == {}
    assert spill_to_disk(t, everything, replace(disk_hw(host=100), disk_budget_bytes=None)) == {}  # no disk tier
    # a host too small for every optimizer state on the disk: the parameters' masters go too
    assert spill_to_disk(t, everything, disk_hw(host=3100)) == {f"blk.{k}": "state" for k in range(4)}


def test_the_parts_each_tier_rests_on_the_disk():
    assert disk_parts("host-step", "optim") == ("optim_bytes",)
    assert disk_parts("full", "state") == ("param_bytes", "optim_bytes")
    assert disk_parts("stream", "state") == ("optim_bytes",)  # its parameter never leaves the device
    assert disk_parts("device", "optim") == () and disk_parts("full", None) == ()


def test_a_plan_puts_on_the_disk_only_what_rests_on_the_host():
    t = two_groups()
    with pytest.raises(PlanError, match="rests nothing on the host"):
        placed(t, {"blk.0": "optim"}).validate(t)
    with pytest.raises(PlanError, match="tier 'nvme' unknown"):
        placed(t, {"blk.0": "nvme"}, blk_0="full").validate(t)
    plan = placed(t, {"blk.0": "state"}, blk_0="full").validate(t)
    from swapsched.plan import plan_from_dict

    assert plan_from_dict(plan.to_dict()) == plan
