"""agents/state_search.py: the state placed with the activations (R13-R16), its peers and floor."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from swapsched.agents.registry import get_policy
from swapsched.agents.state_search import PEERS, activation_view, candidate_placements, state_floor
from swapsched.budget import BudgetError, parse_budget
from swapsched.env.simulator import simulate
from swapsched.plan import SwapPlan
from swapsched.runtime.profiler import profile
from swapsched.state import PLACEMENTS
from swapsched.trace import STATE_GRADIENTS_BORN
from swapsched.trace_file import load_trace, save_trace, trace_from_dict, trace_to_dict
from tests.env.test_state_exec import HW, two_groups


def test_the_view_holds_what_the_placement_leaves_on_the_device():
    t = two_groups()
    kept = activation_view(t, {})
    assert kept.static_bytes == 800 and kept.state == () and list(kept.other_bytes) == [0, 0, 0, 0]
    # blk.1 full: its parameter from its fetch (e0, the first fetched) through its forward (e1),
    # again from its backward fetch (the first: backward starts at e2) until its gradient
    # completes (e3); its gradient from after its unpack (e2) until then
    full = activation_view(t, {"blk.1": "full"})
    assert full.static_bytes == 400 and list(full.other_bytes) == [100, 100, 100, 0]
    hs = activation_view(t, {"blk.0": "host-step"})  # gradient made after e3's unpack: no gap holds it
    assert hs.static_bytes == 400 + 100 and list(hs.other_bytes) == [0, 0, 0, 0]
    # R3: gradients the step makes leave the static bytes; each is held from the gap whose end
    # makes it (its group's backward: blk.1's e2, blk.0's e3) to the step's end
    born = replace(t, meta={**t.meta, STATE_GRADIENTS_BORN: True})
    assert activation_view(born, {}).static_bytes == 600 and list(activation_view(born, {}).other_bytes) == [0, 0, 100, 200]
    stream = activation_view(born, {"blk.1": "stream"})  # its optimizer state off, its gradient born as before
    assert stream.static_bytes == 400 and list(stream.other_bytes) == [0, 0, 100, 200]
    full = activation_view(born, {"blk.1": "full"})  # made and copied out as before; blk.0's born at e3
    assert full.static_bytes == 300 and list(full.other_bytes) == [100, 100, 100, 100]


def test_default_fits_below_the_static_bytes_where_activation_plans_cannot():
    t = two_groups()
    default, plain = get_policy("default"), get_policy("min")
    assert simulate(t, plain.plan(t, 700, HW), HW, 700).oom  # 800 B of state kept: no activation plan fits
    p = default.plan(t, 700, HW)
    r = simulate(t, p, HW, 700)
    assert not r.oom and r.peak_bytes <= 700 and p.state and r.state is not None and r.state.off_bytes > 0
    # and it is no slower than any peer that fits, nor faster than the floor
    for name in PEERS:
        q = simulate(t, get_policy(name).plan(t, 700, HW), HW, 700)
        assert q.oom or r.iteration_s <= q.iteration_s + 1e-9
    assert state_floor(t, 700, HW) <= r.iteration_s + 1e-9


def test_with_room_for_everything_default_moves_nothing_it_need_not():
    t = two_groups()
    p = get_policy("default").plan(t, 10_000, HW)
    assert simulate(t, p, HW, 10_000).iteration_s == pytest.approx(t.ideal_s, abs=1e-6)


def test_the_peers_place_every_group_by_their_rule():
    t = two_groups()
    zero, fsdp, ao = (PEERS[n].plan(t, 1000, HW) for n in ("zero-offload", "fsdp-offload", "ao-offload"))
    assert set(zero.placement().values()) == {"host-step"} and zero.param_return == "all"
    assert set(fsdp.placement().values()) == {"full"} and ao.param_return == "each"
    assert all(p.host_step == "after-backward" for p in (zero, fsdp, ao))


def test_a_budget_below_any_placement_is_refused_naming_the_host_memory():
    t = two_groups()
    assert t.min_feasible_bytes_movable < t.min_feasible_bytes
    with pytest.raises(BudgetError, match="moving its parameters.*host memory"):
        parse_budget(t.min_feasible_bytes_movable - 1, t)
    assert parse_budget(t.min_feasible_bytes_movable, t) == t.min_feasible_bytes_movable


def test_a_budget_no_placement_fits_is_refused_with_the_smallest_that_one_does():
    # the trace's floor with the state movable (200 B) is a bound: fetching a group ahead of its
    # use (R17) needs more. The refusal bisects the smallest budget a screened placement fits
    # (300 B here, in simulation: 297 B is refused, and a plan at 300 B fits)
    t = two_groups()
    default = get_policy("default")
    with pytest.raises(BudgetError, match=r"smallest budget at which a placement fits is 300 B \(300 bytes\).*no plan can "
                                          r"meet less than 200 B"):
        default.plan(t, t.min_feasible_bytes_movable, HW)
    r = simulate(t, default.plan(t, 300, HW), HW, 300)
    assert not r.oom and r.peak_bytes <= 300
    with pytest.raises(BudgetError):
        default.plan(t, 297, HW)
    # in a compare table the refusal is the case's row for default (n/a, and why), not an error
    from swapsched.agents.evaluate import compare

    rows = compare([t], ["297"], [HW], ["default", "checkpoint-all"], progress=False)
    assert rows[0].policy == "default" and rows[0].result is None and "smallest budget" in (rows[0].skipped or "")
    assert rows[1].result is not None


def test_candidates_cover_every_placement():
    t = two_groups()
    seen = {w for c in candidate_placements(t) for w in c.values()}
    assert seen == set(PLACEMENTS) - {"device"}


@settings(max_examples=60, deadline=None)
@given(where=st.lists(st.sampled_from(PLACEMENTS), min_size=2, max_size=2), budget=st.integers(400, 1200),
       host=st.one_of(st.none(), st.integers(100, 900)), after=st.booleans(), born=st.booleans())
def test_no_simulated_step_exceeds_the_device_or_the_host_budget(where, budget, host, after, born):
    t = two_groups()
    t = replace(t, meta={**t.meta, STATE_GRADIENTS_BORN: born})
    plan = SwapPlan.of(t, "any", [], state={"blk.0": where[0], "blk.1": where[1]},
                       host_step="after-backward" if after else "overlap")
    hw = HW if host is None else replace(HW, host_budget_bytes=host)
    r = simulate(t, plan, hw, budget)
    if not r.oom:
        assert r.peak_bytes <= budget
        assert host is None or r.host_peak_bytes <= host
        assert r.iteration_s >= state_floor(t, budget, hw) - 1e-9


def test_a_two_layer_mlp_with_adamw_is_counted_by_hand(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2), nn.GELU())
    model[2].register_buffer("scale", torch.ones(3))  # a buffer: fixed, never moved
    trace = profile(model, (torch.randn(5, 4),), device="cpu", name="mlp2", state="adamw")
    groups = {g.name: g for g in trace.state}
    # Linear(4, 8): 40 fp32 elements, 160 B, its gradient as large, AdamW's two moments 320 B
    assert (groups["0"].params, groups["0"].param_bytes, groups["0"].grad_bytes, groups["0"].optim_bytes) == (40, 160, 160, 320)
    assert (groups["2"].params, groups["2"].param_bytes, groups["2"].grad_bytes, groups["2"].optim_bytes) == (18, 72, 72, 144)
    assert trace.fixed_bytes == 12 and trace.static_bytes == 12 + 640 + 288
    # uses: Linear 2 packs the GELU's output (its input) in forward and reads it in backward,
    # so its forward use is that pack and its gradient completes after the gap of that unpack;
    # Linear 0 packs nothing of its own (its input is the caller's): first gap, and the tail
    mine = [t.id for t in trace.tensors if t.module == "2"]
    assert mine and groups["2"].forward_at == int(trace.first_pack[mine].min())
    assert groups["2"].grad_at == int(trace.last_unpack[mine].max()) + 1
    assert (groups["0"].forward_at, groups["0"].grad_at) == (0, trace.n_events)
    # the trace file keeps it
    back = load_trace(save_trace(trace, tmp_path / "t.json"))
    assert back.state == trace.state


def test_a_version_1_trace_loads_with_everything_static():
    t = two_groups()
    d = trace_to_dict(t)
    d["version"] = 1  # as written before the state: a "state" key there is not read
    old = trace_from_dict(d)
    assert old.state == () and old.fixed_bytes == old.static_bytes == 800
    assert old.min_feasible_bytes_movable == old.min_feasible_bytes


def test_the_optimizer_floor_splits_the_step_between_device_and_host():
    # 50 parameters; ideal compute 4 s; each step takes 8 s on the device (memory-bound: 28 B a
    # parameter at 175 B/s) and 8 s on the host: the best split steps 3/4 on the host (6 s) and
    # 1/4 on the device after the 4 s of compute (4 + 2 s)
    from swapsched.agents.state_search import _optimizer_floor

    t = two_groups()
    hw = replace(HW, memory_bytes_per_s=175.0, host_optimizer_params_per_s=6.25)
    assert _optimizer_floor(t, hw) == pytest.approx(6.0)
    # a slow host: everything on the device, the ideal step and its device step
    assert _optimizer_floor(t, replace(hw, host_optimizer_params_per_s=1e-3)) == pytest.approx(4.0 + 8.0, rel=1e-3)


def test_where_the_floor_proves_no_placement_gains_the_screen_is_skipped(monkeypatch):
    # two_groups with all of its state on the device steps in 4 s, the floor with the state
    # movable is 4 s too (the host's optimizer, 2 s for both groups, cannot take the device's share
    # and save anything: it is ~1e-9 s): no placement can gain, so none is screened
    import swapsched.agents.state_search as ss

    t = two_groups()
    assert state_floor(t, 1000, HW) == pytest.approx(4.0, abs=1e-6)

    def no_screen(*args, **kwargs):
        raise AssertionError("screened where the floor proves nothing gains")

    monkeypatch.setattr(ss, "_screened", no_screen)
    plan = get_policy("default-greedy").plan(t, 1000, HW)
    assert plan.state == () and simulate(t, plan, HW, 1000).iteration_s == pytest.approx(4.0, abs=1e-6)
    with pytest.raises(AssertionError, match="screened"):  # below the static bytes: the state must move
        get_policy("default-greedy").plan(t, 700, HW)
