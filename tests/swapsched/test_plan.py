"""swapsched/plan.py: round trip, validation against R7, prefetch placement."""

from __future__ import annotations

import json

import pytest

from swapsched.plan import Eviction, PlanError, SwapPlan, lead_eviction, load_plan, prefetch_event
from tests.conftest import make_hw, make_trace


def test_round_trip_and_trace_check(tmp_path, two_tensors):
    plan = SwapPlan.of(two_tensors, "hand", [Eviction(0, 0, 2)])
    p = plan.save(tmp_path / "p.json")
    assert load_plan(p, two_tensors) == plan
    other = SwapPlan("someone-else", "hand", (Eviction(0, 0, 2),))
    other.save(tmp_path / "o.json")
    with pytest.raises(PlanError, match="made for 'someone-else'"):
        load_plan(tmp_path / "o.json", two_tensors)


@pytest.mark.parametrize(
    "ev, message",
    [
        (Eviction(5, 0, 1), "out of range"),
        (Eviction(0, 3, 3), r"swap_out_at: 3 must be in \[0, 3\)"),
        (Eviction(0, 1, 0), r"prefetch_at: 0 must be in \[1, 3\]"),
        (Eviction(1, 0, 2), r"swap_out_at: 0 must be in \[1, 2\)"),
    ],
)
def test_r7_violations_name_the_eviction(two_tensors, ev, message):
    with pytest.raises(PlanError, match=message):
        SwapPlan.of(two_tensors, "bad", [ev]).validate(two_tensors)


def test_evicting_twice_is_rejected(two_tensors):
    with pytest.raises(PlanError, match="evicted twice"):
        SwapPlan("hand", "bad", (Eviction(0, 0, 2), Eviction(0, 1, 3))).validate(two_tensors)


def test_bad_plan_file(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"format": "swapsched.plan", "version": 1, "trace": "t", "policy": "x",
                             "evictions": [{"tensor": 0, "swap_out_at": "soon", "prefetch_at": 1}]}))
    with pytest.raises(PlanError, match=r"evictions\[0\].swap_out_at: expected an integer, got 'soon'"):
        load_plan(p)


def test_prefetch_event_by_lead(two_tensors):
    # event times 1, 2, 4, 5; T0's first unpack is e3 at t=5.
    assert prefetch_event(two_tensors, 0, 0.0) == 3  # on demand
    assert prefetch_event(two_tensors, 0, 1.0) == 2  # t=4 is 1 s before
    assert prefetch_event(two_tensors, 0, 2.5) == 1  # t=2 is >= 2.5 s before
    assert prefetch_event(two_tensors, 0, float("inf")) == 0  # right after the swap-out
    # lead class 2 = 2 transfers of 100 B at 100 B/s = 2 s -> latest event with time <= 3 is e1
    assert lead_eviction(two_tensors, 0, 2, make_hw()) == Eviction(0, 0, 1)


def test_a_recompute_plan_round_trips_as_version_6_and_version_1_to_3_files_still_load(tmp_path, one_block):
    plan = SwapPlan.of(one_block, "hand", [Eviction(0, 0, 4)], recompute=["blk.0"])
    p = plan.save(tmp_path / "p.json")
    data = json.loads(p.read_text())
    assert data["version"] == 6 and data["recompute"] == ["blk.0"] and data["selective"] == [] and data["state"] == []
    assert data["unsharded"] == [] and data["disk"] == []
    back = load_plan(p, one_block)
    assert back == plan and back.recomputed(one_block) == [0]
    v1 = tmp_path / "v1.json"  # as swapsched wrote plans before recompute
    v1.write_text(json.dumps({"format": "swapsched.plan", "version": 1, "trace": one_block.name, "policy": "old",
                              "evictions": [{"tensor": 2, "swap_out_at": 2, "prefetch_at": 3}]}))
    old = load_plan(v1, one_block)
    assert old.recompute == () and old.evictions == (Eviction(2, 2, 3),)
    v2 = tmp_path / "v2.json"  # before selective checkpointing: a "selective" key there is not read
    v2.write_text(json.dumps({**data, "version": 2, "selective": ["blk.0"]}))
    assert load_plan(v2, one_block).recompute == ("blk.0",) and load_plan(v2).selective == ()
    v3 = tmp_path / "v3.json"  # before the state: a "state" key there is not read
    v3.write_text(json.dumps({**data, "version": 3, "state": [{"group": "blk.0", "placement": "full"}]}))
    assert load_plan(v3).state == () and load_plan(v3).host_step == "overlap"
    v4 = tmp_path / "v4.json"  # before sharding: an "unsharded" key there is not read
    v4.write_text(json.dumps({**data, "version": 4, "unsharded": ["blk.0"]}))
    assert load_plan(v4).unsharded == ()
    v5 = tmp_path / "v5.json"  # before the disk tier: a "disk" key there is not read
    v5.write_text(json.dumps({**data, "version": 5, "disk": [{"group": "blk.0", "tier": "optim"}]}))
    assert load_plan(v5).disk == ()
    v7 = tmp_path / "v7.json"
    v7.write_text(json.dumps({**data, "version": 7}))
    with pytest.raises(PlanError, match="reads versions 1, 2, 3, 4, 5, 6, got 7"):
        load_plan(v7)
    # a unit kept unsharded names a unit of a sharded trace
    with pytest.raises(PlanError, match="one device's step: nothing is sharded"):
        SwapPlan.of(one_block, "hand", [], unsharded=["blk.0"]).validate(one_block)


def _selective_block():
    # blk.0: anchor T0 (layer norm), members T1 (addmm, saved by selective checkpointing) and T2
    # (gelu, rebuilt); T3 outside
    return make_trace([100, 100, 100, 100], [*(("pack", k, 1.0) for k in range(4)), *(("unpack", k, 1.0) for k in (3, 2, 1, 0))],
                      ops=["native_layer_norm", "addmm", "gelu", "addmm"], modules=["blk.0.ln", "blk.0.fc", "blk.0.act", "head"])


def test_a_selective_plan_round_trips_and_is_validated(tmp_path):
    tr = _selective_block()
    (sg,) = tr.segments
    assert (sg.members, sg.cheap, sg.cheap_bytes, sg.cheap_forward_s, sg.forward_s) == ((1, 2), (2,), 100, 1.0, 3.0)
    plan = SwapPlan.of(tr, "hand", [Eviction(0, 0, 5)], selective=["blk.0"])
    back = load_plan(plan.save(tmp_path / "s.json"), tr)
    assert back == plan and back.recomputed_selectively(tr) == [0] and back.recomputed(tr) == []
    with pytest.raises(PlanError, match=r"selective\[0\]: .* no block 'blk.9'"):
        SwapPlan.of(tr, "bad", [], selective=["blk.9"]).validate(tr)
    with pytest.raises(PlanError, match="also in recompute"):
        SwapPlan.of(tr, "bad", [], recompute=["blk.0"], selective=["blk.0"]).validate(tr)
    # a saved member (T1) is held by the checkpoint, a cheap one (T2) rebuilt: neither is swapped
    for k in (1, 2):
        with pytest.raises(PlanError, match=f"its tensor {k} cannot also be evicted"):
            SwapPlan.of(tr, "bad", [Eviction(k, k, 4)], selective=["blk.0"]).validate(tr)
    # a block whose members are all saved ops has nothing to rebuild selectively
    saved = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)],
                       ops=["addmm", "bmm"], modules=["blk.0.a", "blk.0.b"])
    with pytest.raises(PlanError, match="no block 'blk.0' with members that selective checkpointing rebuilds"):
        SwapPlan.of(saved, "bad", [], selective=["blk.0"]).validate(saved)
    # where a plan breaks several rules, the user hears of them in the plan's order: recompute
    # first, then selective; for a block there, whether it can be selective before the clash
    with pytest.raises(PlanError, match=r"^<plan>: recompute\[0\]"):
        SwapPlan.of(tr, "bad", [], recompute=["blk.9"], selective=["blk.8"]).validate(tr)
    with pytest.raises(PlanError, match="with members that selective checkpointing rebuilds"):
        SwapPlan.of(saved, "bad", [], recompute=["blk.0"], selective=["blk.0"]).validate(saved)


def test_recompute_is_validated_against_the_trace(tmp_path, one_block):
    with pytest.raises(PlanError, match=r"recompute\[0\]: trace 'hand' has no recomputable block 'blk.9' \(its blocks: blk.0\)"):
        SwapPlan.of(one_block, "bad", [], recompute=["blk.9"]).validate(one_block)
    # R9: a member is rebuilt, so it cannot also be swapped; the anchor (T0) may be
    with pytest.raises(PlanError, match="its tensor 1 cannot also be evicted"):
        SwapPlan.of(one_block, "bad", [Eviction(1, 1, 4)], recompute=["blk.0"]).validate(one_block)
    SwapPlan.of(one_block, "ok", [Eviction(0, 0, 4)], recompute=["blk.0"]).validate(one_block)
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"format": "swapsched.plan", "version": 2, "trace": "hand", "policy": "x", "evictions": [],
                             "recompute": [3]}))
    with pytest.raises(PlanError, match=r"recompute\[0\]: expected a block name \(a string\), got 3"):
        load_plan(p)


def test_by_event_lays_the_plan_out_per_event(two_tensors):
    plan = SwapPlan.of(two_tensors, "hand", [Eviction(0, 0, 2), Eviction(1, 1, 1)])
    out_at, prefetch_at = plan.by_event(4)
    assert out_at == [(0,), (1,), (), ()] and prefetch_at == [(), (1,), (0,), ()]
    # two at one event keep the plan's order (R6: prefetches are issued in it)
    both = SwapPlan(two_tensors.name, "hand", (Eviction(1, 1, 2), Eviction(0, 1, 2)))
    assert both.by_event(4) == ([(), (1, 0), (), ()], [(), (), (1, 0), ()])


def test_a_prefetch_at_its_own_swap_out_is_valid(two_tensors):
    SwapPlan.of(two_tensors, "hand", [Eviction(0, 0, 0)]).validate(two_tensors)  # R7: equal is allowed


@pytest.mark.parametrize("data, message", [
    ([], "expected a JSON object at the top level"),
    ({"format": "swapsched.trace", "version": 1}, "is this a swapsched plan"),
    ({"format": "swapsched.plan", "version": 0}, "reads versions 1, 2, 3, 4, 5, 6, got 0"),
])
def test_a_file_that_is_not_a_plan_says_what_it_is(tmp_path, data, message):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        load_plan(p)


def test_loading_against_a_trace_checks_r7_and_fills_in_meta(tmp_path, two_tensors):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"format": "swapsched.plan", "version": 1, "trace": "hand", "policy": "x",
                             "evictions": [{"tensor": 0, "swap_out_at": 3, "prefetch_at": 3}]}))
    assert load_plan(p).meta == {}
    with pytest.raises(PlanError, match="R7"):
        load_plan(p, two_tensors)


def test_lead_eviction_places_the_prefetch_lead_transfers_ahead(two_tensors):
    # 100 B at 50 B/s: one transfer is 2 s. Events at t = 1, 2, 4, 5; T0 out at e0, first unpack
    # e3 (t=5). The latest event at least lead transfers before it: 1 (2 s) -> e1 (t=2 <= 3),
    # 2 (4 s) -> e0 (1 <= 1), 4 and 8 -> none, clamped to the swap-out (e0); 0 is on demand (e3),
    # inf as early as possible (e0).
    hw = make_hw(h2d=50)
    assert [lead_eviction(two_tensors, 0, i, hw).prefetch_at for i in range(6)] == [3, 1, 0, 0, 0, 0]
    assert prefetch_event(two_tensors, 0, 100.0) == 0  # clamped to the swap-out


def test_an_unknown_block_is_named_beside_the_first_six_of_the_trace():
    from tests.conftest import make_trace

    n = 8  # blocks blk.0 .. blk.7, two tensors each
    sizes = [10] * (2 * n)
    events = [("pack", k, 1.0) for k in range(2 * n)] + [("unpack", k, 1.0) for k in reversed(range(2 * n))]
    tr = make_trace(sizes, events, modules=[f"blk.{k // 2}.op{k % 2}" for k in range(2 * n)])
    assert len(tr.segments) == n
    with pytest.raises(PlanError, match=r"\(its blocks: blk\.0, blk\.1, blk\.2, blk\.3, blk\.4, blk\.5, \.\.\.\)"):
        SwapPlan("hand", "hand", (), recompute=("nope",)).validate(tr)


def test_carry_evictions_follows_the_tensors_a_checkpointed_block_leaves():
    from swapsched.plan import carry_evictions

    # before: T0 (input, 100 B), block blk.0 = anchor T1 (200 B) + member T2 (300 B), T3 (400 B)
    # after checkpointing blk.0 the steps save T0, the block's input (200 B) and T3: three tensors
    before = make_trace([100, 200, 300, 400], [("pack", 0, 1), ("pack", 1, 1), ("pack", 2, 1), ("pack", 3, 1),
                                               ("unpack", 3, 1), ("unpack", 2, 1), ("unpack", 1, 1), ("unpack", 0, 1)],
                        modules=["in", "blk.0.a", "blk.0.b", "head"])
    after = make_trace([100, 200, 400], [("pack", 0, 1), ("pack", 1, 1), ("pack", 2, 1),
                                         ("unpack", 2, 1), ("unpack", 1, 1), ("unpack", 0, 1)])
    plan = SwapPlan.of(before, "hand", [Eviction(0, 0, 6), Eviction(3, 3, 4), Eviction(1, 1, 5)], recompute=["blk.0"])
    carried = carry_evictions(plan, before, after)
    # T0: out at e0 -> e0; prefetch at e6 (T1's unpack, its 2nd event) -> after's e4 (T1' unpack)
    # T3 -> T2': out e3 -> e2, prefetch e4 (its own first unpack, on demand) -> e3
    # T1 -> T1': out e1 -> e1, prefetch e5 (T2's unpack, a member: not carried) -> the carried event
    # at or before it, e3 (T3's unpack -> T2' unpack), clamped to T1's window [1, 4]
    assert carried == (Eviction(0, 0, 4), Eviction(1, 1, 3), Eviction(2, 2, 3))
    SwapPlan.of(after, "carried", carried).validate(after)
