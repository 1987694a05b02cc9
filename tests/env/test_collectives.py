"""env/collectives.py and swapsched/sharding.py: one rank of a sharded step (R18), its
all-gathers, reduce-scatters and unsharded bytes timed and counted by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from swapsched.agents.registry import get_policy
from swapsched.env.simulator import simulate
from swapsched.plan import SwapPlan
from swapsched.sharding import shard_trace
from swapsched.state import StateGroup
from swapsched.trace import Trace
from tests.conftest import make_hw, make_trace


def sharded(world: int = 2) -> Trace:
    """Two units: blk.0 packs T0 at e0, unpacks it at e3; blk.1 packs T1 at e1, unpacks it at e2
    (100 B tensors, 1 s gaps, ideal 4 s). Each unit: 100 B all-gathered, 200 B reduce-scattered,
    a shard of 50 B parameters, 50 B gradient, 100 B optimizer state (12 elements)."""
    t = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)],
                   modules=["blk.0.fc", "blk.1.fc"])
    groups = tuple(StateGroup(name, 12, 50, 50, 100, *t.group_events(name), gather_bytes=100, reduce_bytes=200)
                   for name in ("blk.0", "blk.1"))
    return replace(t, static_bytes=400, state=groups, world_size=world, meta={"optimizer": "adamw"})


# a collective of S bytes over 2 ranks moves S / 2 at 100 B/s: 100 B take 0.5 s, 200 B 1 s
HW = replace(make_hw(), collective_bytes_per_s=100.0, collective_latency_s=0.0, host_optimizer_params_per_s=24.0)


def test_all_gathers_and_reduce_scatters_timed_and_counted_by_hand():
    t = sharded()
    r = simulate(t, SwapPlan.of(t, "hand", []), HW, 2000)
    # forward: blk.0 gathered on demand at t 0 (0-0.5, a stall), blk.1 prefetched behind it
    # (0.5-1.0), in time for gap 1 (1.5-2.5). Backward: blk.1 again on demand after gap 2
    # (3.5-4.0), blk.0 prefetched (4.0-4.5) in time for gap 3 (4.0-5.0); reduce-scatters on
    # their own stream, blk.1's as gap 3 starts (4.0-5.0), blk.0's after it (5.0-6.0); the
    # optimizer waits for them
    assert r.iteration_s == pytest.approx(6.0, abs=1e-6) and not r.oom
    assert r.state is not None
    assert r.state.collective_s == pytest.approx(4.0) and r.state.gathered_bytes == 400 and r.state.reduced_bytes == 400
    # the most at once, after gap 2: shards 400 + T0 + blk.1 gathered (100) and its gradient
    # (200) + blk.0 prefetched (100) + T1 (still to be unpacked) = 1000; and after gap 3: shards
    # + T0 + blk.0 (100) and its gradient (200) + blk.1's gradient until its scatter lands = 1000
    assert r.peak_bytes == 1000
    # 1 B less: blk.0's backward prefetch finds no room and is gathered on demand after gap 3
    # (5.0-5.5, a stall), its scatter 5.5-6.5: half a second later, 100 B less at once
    tight = simulate(t, SwapPlan.of(t, "hand", []), HW, 999)
    assert not tight.oom and tight.iteration_s == pytest.approx(6.5, abs=1e-6) and tight.peak_bytes <= 999
    # 899 B: after gap 2, T0 + T1 + blk.1's parameters (on demand) leave no room for its gradient
    assert simulate(t, SwapPlan.of(t, "hand", []), HW, 899).oom


def test_a_unit_kept_unsharded_after_forward_is_not_gathered_again():
    t = sharded()
    r = simulate(t, SwapPlan.of(t, "hand", [], unsharded=["blk.1"]), HW, 2000)
    # blk.1 stays from forward, so nothing waits after gap 2 (3.5): backward gathers only blk.0
    # (3.5-4.0, there before its node runs after gap 3); blk.1's scatter as gap 3 starts
    # (3.5-4.5), blk.0's after it (4.5-5.5)
    assert r.iteration_s == pytest.approx(5.5, abs=1e-6)
    assert r.state is not None and r.state.gathered_bytes == 300


def test_the_floors_count_the_unsharded_bytes_in_use():
    t = sharded()
    # forward computes with blk.0 in gap 0 and blk.1 in gap 1; backward's nodes that read them
    # run after the last gap (their unpacks end gaps 2 and 3): in use only in forward here
    assert t.unsharded_in_use_bytes.tolist() == [100, 100, 0, 0]
    two = replace(t, tensors=t.tensors, events=t.events[:2] + t.events[2:])
    assert two.min_feasible_bytes == 400 + max(m + u for m, u in zip(t.must_resident_bytes.tolist(), [100, 100, 0, 0], strict=True))


def test_one_device_is_todays_step_exactly():
    t = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)],
                   modules=["blk.0.fc", "blk.1.fc"])
    groups = tuple(StateGroup(n, 25, 100, 100, 200, *t.group_events(n)) for n in ("blk.0", "blk.1"))
    one = replace(t, static_bytes=800, state=groups, meta={"optimizer": "adamw"})
    assert shard_trace(one, 1) is one and HW.for_ranks(1) is HW
    for name in ("default", "fsdp", "fsdp-offload", "fsdp-partial", "zero3-offload"):
        plan = get_policy(name).plan(one, 1000, HW)
        assert plan.unsharded == ()
    assert not any(one.unsharded_in_use_bytes)


def test_shard_trace_divides_the_state_and_records_the_collectives():
    t = sharded(world=2)
    one = replace(t, world_size=1, state=tuple(replace(g, params=100, param_bytes=400, grad_bytes=400, optim_bytes=800,
                                                       gather_bytes=0, reduce_bytes=0) for g in t.state),
                  static_bytes=3200)
    s = shard_trace(one, 4)
    g = s.state[0]
    assert (g.params, g.param_bytes, g.grad_bytes, g.optim_bytes) == (25, 100, 100, 200)
    assert (g.gather_bytes, g.reduce_bytes) == (200, 400)  # 100 elements, bf16 and fp32
    assert s.static_bytes == 800 and s.world_size == 4


def test_the_node_host_budget_is_shared_by_its_ranks():
    t = sharded(world=8)
    hw = replace(HW, host_budget_bytes=1600)  # the node's: 200 B a rank
    placed = SwapPlan.of(t, "hand", [], state={"blk.0": "host-step", "blk.1": "host-step"})
    r = simulate(t, placed, hw, 4000)
    # each unit's host part is 200 B (R11): one fits a rank's share, the other stays on the device
    assert r.state is not None and r.state.skipped == 1 and r.state.host_bytes == 200
    # the node's CPU steps for its 8 ranks: 24 parameters a second is 3 a rank, 4 s for 12
    assert r.state.host_step_s == pytest.approx(4.0)


def test_a_partial_offload_beats_all_and_none_and_default_finds_it():
    t = sharded()
    # 899 B: all on the device runs out after gap 2 (above); with blk.1's shard on the host
    # (full: 200 B fewer static, its 50 B parameter and gradient back for backward) the worst is
    # 800 + blk.0's prefetch, which waits for room; with both, the host steps both after backward
    # (12 elements each, the node's 24 a second shared by 2 ranks: 1 s each) instead of one
    budget = 899
    none = SwapPlan.of(t, "hand", [])
    one = SwapPlan.of(t, "hand", [], state={"blk.1": "full"}, host_step="after-backward")
    both = SwapPlan.of(t, "hand", [], state={"blk.0": "full", "blk.1": "full"}, host_step="after-backward")
    r_none, r_one, r_both = (simulate(t, p, HW, budget) for p in (none, one, both))
    assert r_none.oom and not r_one.oom and not r_both.oom
    assert r_one.iteration_s < r_both.iteration_s
    d = simulate(t, get_policy("default").plan(t, budget, HW), HW, budget)
    assert not d.oom and d.iteration_s <= r_one.iteration_s + 1e-9
