"""swapsched/trace.py: round trips, validation messages, derived tables, roofline retiming."""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import fields, replace

import pytest

from swapsched.hardware import Hardware, HardwareError
from swapsched.trace import Event, TensorInfo, Trace, TraceError
from swapsched.trace_file import load_trace, save_trace, trace_to_dict
from tests.conftest import make_trace


def test_round_trip_json_and_gz(tmp_path, two_tensors):
    for name in ("t.json", "t.json.gz"):
        p = save_trace(two_tensors, tmp_path / name)
        assert load_trace(p) == two_tensors
    assert gzip.decompress((tmp_path / "t.json.gz").read_bytes()).startswith(b"{")


def test_derived_tables(two_tensors):
    t = two_tensors
    assert t.ideal_s == 5.0 and list(t.event_times) == [1.0, 2.0, 4.0, 5.0]
    assert list(t.first_pack) == [0, 1] and list(t.first_unpack) == [3, 2] and list(t.last_unpack) == [3, 2]
    assert t.saved_bytes_peak == 200 and t.peak_bytes_no_swap == 200
    # must hold: gap0 T0 (produced), gap1 T1, gap2 T1 (unpacked there), gap3 T0 -> 100 B
    assert t.min_feasible_bytes == 100
    assert t.forward_compute_s == 2.0 and t.backward_compute_s == 3.0


def test_summary_keys(two_tensors):
    from swapsched.cli.profile import trace_summary

    s = trace_summary(two_tensors)
    assert {"name", "tensors", "events", "saved_bytes_peak", "static_bytes", "compute_s", "timing"} <= set(s)
    assert s["tensors"] == 2 and s["events"] == 4 and s["timing"] == "measured"


def _write(tmp_path, data) -> str:
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data))
    return str(p)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format="other"), "field format: expected 'swapsched.trace'"),
        (lambda d: d.update(version=5), "field version: this swapsched reads versions 1, 2, 3, 4, got 5"),
        (lambda d: d.update(world_size=0), "field world_size: must be a positive integer"),
        (lambda d: d.update(state=[{"name": "x"}]), "field state[0].params: missing"),
        (lambda d: d.pop("static_bytes"), "field static_bytes: missing"),
        (lambda d: d.update(static_bytes="lots"), "field static_bytes: expected an integer, got 'lots'"),
        (lambda d: d.update(static_bytes=-5), "field static_bytes: must be >= 0, got -5"),
        (lambda d: d["events"][0].update(tensor=7), "field events[0].tensor: tensor id 7 out of range"),
        (lambda d: d["events"][1].update(compute_s=-1.0), "field events[1].compute_s: must be >= 0, got -1.0"),
        (lambda d: d["tensors"][1].update(bytes=-1), "field tensors[1].bytes: must be >= 0, got -1"),
        (lambda d: d["events"].insert(0, {"kind": "unpack", "tensor": 0, "compute_s": 0}), "unpack of tensor 0 before its pack"),
        (lambda d: d["events"][0].update(kind="jump"), "field events[0].kind: expected 'pack' or 'unpack', got 'jump'"),
        (lambda d: d.update(timing="guessed"), "field timing: expected one of"),
        (lambda d: d["tensors"][0].update(id=5), "field tensors[0].id: tensor ids must be 0..n-1"),
        (lambda d: d.update(events={}), "field events: expected a list"),
    ],
)
def test_load_rejects_bad_files_naming_file_field_and_value(tmp_path, two_tensors, mutate, message):
    d = trace_to_dict(two_tensors)
    mutate(d)
    path = _write(tmp_path, d)
    with pytest.raises(TraceError) as exc:
        load_trace(path)
    assert path in str(exc.value) and message in str(exc.value)


def test_load_rejects_non_json_and_missing_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(p)
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.json")


def test_roofline_retiming_by_hand():
    # peak 1e12 FLOP/s, 1e11 B/s. e0 packs T0 (1000 B) first: max(2e9/1e12, 2*1000/1e11) = 2e-3 s.
    # e1 unpacks T0 with 1e3 FLOPs: max(1e-9, 2*1000/1e11 = 2e-8) = 2e-8 s. Tail: 5e8 FLOPs -> 5e-4 s.
    tr = Trace("r", "measured", "cpu", 0, 1.0, (TensorInfo(0, 1000),),
               (Event("pack", 0, 0.5, flops=2e9), Event("unpack", 0, 0.5, flops=1e3)), meta={"tail_flops": 5e8})
    hw = Hardware("g", 1e9, 1e9, 0.0, 10**9, 1e12, 1e11)
    rt = tr.retimed(hw)
    assert rt.timing == "roofline" and rt.device == "g"
    assert rt.gaps.tolist() == pytest.approx([2e-3, 2e-8]) and rt.tail_compute_s == pytest.approx(5e-4)


def test_a_bf16_step_is_retimed_at_the_bf16_peak():
    # the same gaps as above at a 4e12 bf16 peak: e0 max(2e9/4e12, 2e-8) = 5e-4 s; tail 5e8/4e12
    meta = {"tail_flops": 5e8, "compute_dtype": "bfloat16"}
    tr = Trace("r", "measured", "cpu", 0, 1.0, (TensorInfo(0, 1000),),
               (Event("pack", 0, 0.5, flops=2e9), Event("unpack", 0, 0.5, flops=1e3)), meta=meta)
    rt = tr.retimed(Hardware("g", 1e9, 1e9, 0.0, 10**9, 1e12, 1e11, bf16_peak_flops=4e12))
    assert rt.gaps.tolist() == pytest.approx([5e-4, 2e-8]) and rt.tail_compute_s == pytest.approx(1.25e-4)
    with pytest.raises(HardwareError, match="g has no bfloat16 peak"):
        tr.retimed(Hardware("g", 1e9, 1e9, 0.0, 10**9, 1e12, 1e11))


def test_retiming_needs_flops(two_tensors):
    with pytest.raises(TraceError, match="flops"):
        two_tensors.retimed(Hardware("g", 1e9, 1e9, 0.0, 10**9, 1e12, 1e11))


def test_never_unpacked_tensor_is_rejected():
    with pytest.raises(TraceError, match="never unpacked"):
        make_trace([10, 10], [("pack", 0, 1), ("pack", 1, 1), ("unpack", 0, 1)])


def test_release_and_free_events_round_trip_and_are_validated(tmp_path, two_tensors):
    from dataclasses import replace

    t = replace(two_tensors, tensors=(replace(two_tensors.tensors[0], released_at=1, freed_at=3),
                                      replace(two_tensors.tensors[1], freed_at=3)))
    back = load_trace(save_trace(t, tmp_path / "r.json"))
    assert back == t and list(back.release) == [1, 1] and list(back.freed) == [3, 3]
    # without them: released at the last forward pack, freed at the last unpack (R2)
    assert list(two_tensors.release) == [0, 1] and list(two_tensors.freed) == [3, 2]
    data = trace_to_dict(t)
    data["tensors"][0]["released_at"] = 9
    with pytest.raises(TraceError, match=r"tensors\[0\]\.released_at"):
        load_trace(_write(tmp_path, data))


def test_with_timing_replaces_gaps_and_tail_and_keeps_the_events(two_tensors):
    t = two_tensors.with_timing([0.5, 0.25, 1.0, 2.0], 0.75, timed_by_execution=3)
    assert [e.compute_s for e in t.events] == [0.5, 0.25, 1.0, 2.0] and t.tail_compute_s == 0.75
    assert [(e.kind, e.tensor) for e in t.events] == [(e.kind, e.tensor) for e in two_tensors.events]
    assert t.ideal_s == 4.5 and t.meta["timed_by_execution"] == 3 and two_tensors.ideal_s == 5.0
    with pytest.raises(TraceError, match="3 gaps for 4 events"):
        two_tensors.with_timing([1.0, 1.0, 1.0], 0.0)


def test_blocks_are_container_elements_or_runs_of_single_layers():
    from swapsched.segments import segment_of

    assert segment_of("blocks.3.attn.qkv") == ("blocks", 3) and segment_of("net.2") == ("net", 2)
    assert segment_of("tok") is None
    # a Sequential of single layers (one saved tensor each): runs of round(sqrt(4)) = 2 layers,
    # each run's first tensor its anchor, the rest its members; "head" is in no block
    sizes = [100] * 5
    fwd = [("pack", k, 1.0) for k in range(5)]
    bwd = [("unpack", k, 1.0) for k in reversed(range(5))]
    tr = make_trace(sizes, fwd + bwd, modules=["net.0", "net.1", "net.2", "net.3", "head"])
    assert [(s.name, s.anchor, s.members, s.at, s.forward_s) for s in tr.segments] == [
        ("net.0-1", 0, (1,), 8, 2.0), ("net.2-3", 2, (3,), 6, 2.0)]
    # a block whose member is packed again in backward does not qualify (a recompute cannot stand in)
    again = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0), ("pack", 1, 1.0),
                                    ("unpack", 1, 1.0), ("unpack", 0, 1.0)], modules=["b.0.x", "b.0.y"])
    assert again.segments == ()


def test_resized_keeps_the_structure_and_shares_its_tables():
    # blk.0 = T0 (anchor) and T1 (member, a gelu: cheap); T2 outside; T0 held by the program
    # through e1 (released_at). Resized to other bytes and gaps: the same events and R2 fields,
    # the block's numbers from the new ones (T1 80 B; forward = the gaps before e0 and e1, 2 + 3).
    tr = make_trace([100, 40, 60], [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 1.0), ("unpack", 2, 1.0),
                                    ("unpack", 1, 1.0), ("unpack", 0, 1.0)],
                    ops=["native_layer_norm", "gelu", "addmm"], modules=["blk.0.ln", "blk.0.act", "head"])
    tr = Trace(tr.name, tr.timing, tr.device, tr.static_bytes, tr.tail_compute_s,
               (TensorInfo(0, 100, (25,), "float32", "native_layer_norm", "blk.0.ln", released_at=1), *tr.tensors[1:]), tr.events)
    assert tr.segments and tr.release.tolist() == [1, 1, 2]  # cached before resizing: these are shared
    big = tr.resized([200, 80, 120], [2.0, 3.0, 1.0, 1.0, 1.0, 1.0], [None, 7, None, None, None, None],
                     tail_compute_s=0.5, static_bytes=9, name="big", meta={"k": 1})
    assert big.tensor_bytes.tolist() == [200, 80, 120] and big.gaps.tolist() == [2.0, 3.0, 1.0, 1.0, 1.0, 1.0]
    assert big.other_bytes.tolist()[1] == 7 and (big.tail_compute_s, big.static_bytes, big.name, big.meta) == (0.5, 9, "big", {"k": 1})
    assert [(e.kind, e.tensor) for e in big.events] == [(e.kind, e.tensor) for e in tr.events]
    assert [(t.shape, t.op, t.module, t.released_at, t.freed_at) for t in big.tensors] == \
        [(t.shape, t.op, t.module, t.released_at, t.freed_at) for t in tr.tensors]
    assert big.release is tr.release and big.release.tolist() == [1, 1, 2]
    (sg,) = big.segments
    assert (sg.anchor, sg.members, sg.at, sg.cheap) == (0, (1,), 4, (1,))
    assert (sg.forward_s, sg.bytes, sg.cheap_forward_s, sg.cheap_bytes) == (5.0, 80, 3.0, 80)
    # a field added to TensorInfo must be carried by resized too
    assert [f.name for f in fields(TensorInfo)] == ["id", "bytes", "shape", "dtype", "op", "module", "released_at", "freed_at"]
    # built without the dataclasses' __init__: equal to the trace built with it, and checked where
    # its new values could be wrong
    assert big == Trace("big", tr.timing, tr.device, 9, 0.5,
                        tuple(replace(t, bytes=b) for t, b in zip(tr.tensors, [200, 80, 120], strict=True)),
                        tuple(replace(e, compute_s=g, other_bytes=o) for e, g, o in
                              zip(tr.events, [2.0, 3.0, 1.0, 1.0, 1.0, 1.0], [None, 7, None, None, None, None], strict=True)),
                        {"k": 1})
    assert big.derived == {} and big.derived is not tr.derived
    for sizes, gaps, why in (([200, -1, 120], [1.0] * 6, "negative bytes"), ([200, 80, 120], [1.0] * 5 + [math.inf], "not finite"),
                             ([200, 80, 120], [1.0] * 5 + [-0.5], "negative"), ([200, 80], [1.0] * 6, "2 sizes")):
        with pytest.raises(TraceError, match=why):
            tr.resized(sizes, gaps, [None] * len(gaps), tail_compute_s=0.0, static_bytes=0, name="bad", meta={})
