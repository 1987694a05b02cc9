"""swapsched/fit.py and `swapsched fit`: each option's row is what planning and simulating it by
hand gives; where nothing fits, the smallest machine named is one default fits."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from swapsched.agents.evaluate import run_policy
from swapsched.agents.registry import get_policy
from swapsched.cli import main
from swapsched.fit import FIT_OPTIONS, device_budget, fit, step_flops
from swapsched.hardware import load_hardware
from swapsched.runtime.budgets import DEVICE_MARGIN
from swapsched.trace_file import load_trace

pytest.importorskip("transformers")

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 704,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4000,
          "max_position_embeddings": 2048, "tie_word_embeddings": False}
SEQ = 256


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


@pytest.fixture(scope="module")
def trace(config_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("fit") / "t.json.gz"
    assert main(["profile", f"hf:{config_path}", "--device", "meta", "--seq-len", str(SEQ), "--batch-size", "1",
                 "--out", str(out)]) == 0
    return load_trace(out)


def _memory_between(trace) -> int:
    """A device memory the state must move for (below the activations' floor with it kept)."""
    budget = (trace.min_feasible_bytes_movable + trace.min_feasible_bytes) // 2
    return math.ceil(budget / (1 - DEVICE_MARGIN))


def test_each_row_is_its_policy_planned_and_simulated_by_hand(trace):
    hw = replace(load_hardware("h100-pcie5"), device_memory_bytes=_memory_between(trace))
    report = fit(trace, [hw], SEQ, progress=False)
    assert [r.option for r in report.rows] == list(FIT_OPTIONS)
    budget = device_budget(hw)
    flops = step_flops(trace)
    assert flops is not None and flops > 0
    for row in report.rows:
        _, res, _ = run_policy(get_policy(FIT_OPTIONS[row.option]), trace, budget, hw)
        assert row.fits == (not res.oom), row
        if row.fits:
            assert row.step_s == res.iteration_s and row.device_peak_bytes == res.peak_bytes <= budget
            assert row.host_peak_bytes == res.host_peak_bytes
            assert row.tokens_per_s == pytest.approx(SEQ / res.iteration_s)
            assert row.mfu == pytest.approx(flops / res.iteration_s / hw.peak_flops_for("bfloat16"))
        else:
            assert row.step_s is None and row.why
    # the state must move at this memory: plain and checkpoint-all keep it, and do not fit
    assert not report.rows[0].fits and not report.rows[1].fits
    fitting = [r for r in report.rows if r.fits]
    assert fitting and report.fastest is min(fitting, key=lambda r: r.step_s)
    assert report.rows[-1].fits  # default fits wherever a peer does
    assert not report.smallest


def test_where_nothing_fits_default_fits_the_smallest_machine_it_names(trace):
    small = math.ceil(trace.min_feasible_bytes_movable * 0.9 / (1 - DEVICE_MARGIN))
    hw = replace(load_hardware("h100-pcie5"), device_memory_bytes=small)
    report = fit(trace, [hw], SEQ, progress=False)
    assert report.fastest is None and not any(r.fits for r in report.rows)
    (least,) = report.smallest
    assert least.device_bytes > small
    at = replace(hw, device_memory_bytes=least.device_bytes)
    _, res, _ = run_policy(get_policy("default"), trace, device_budget(at), at)
    assert not res.oom and least.host_bytes == res.host_peak_bytes


def test_where_default_refuses_the_device_its_refusals_smallest_budget_is_the_one_named(trace, monkeypatch):
    """At the floor with the state movable (a bound that leaves no room to fetch a group ahead of
    its use) ``default`` screens its placements, none fits, and its refusal bisects the smallest
    budget one fits at: the report names that one, without bisecting it a second time."""
    import swapsched.agents.state_search as state_search
    import swapsched.fit as fit_module

    calls = []
    real = state_search.smallest_state_budget

    def counted(*args, **kwargs):
        calls.append(kwargs.get("above"))
        return real(*args, **kwargs)

    monkeypatch.setattr(state_search, "smallest_state_budget", counted)
    monkeypatch.setattr(fit_module, "smallest_state_budget", counted)
    floor = math.ceil(trace.min_feasible_bytes_movable / (1 - DEVICE_MARGIN)) + 1
    hw = replace(load_hardware("h100-pcie5"), device_memory_bytes=floor)
    report = fit(trace, [hw], SEQ, progress=False)
    assert not any(r.fits for r in report.rows)
    assert next(r for r in report.rows if r.option == "default").why == "no placement fits"
    (least,) = report.smallest
    assert calls == [device_budget(hw)]  # the refusal's, from the device's own budget up; not again
    at = replace(hw, device_memory_bytes=least.device_bytes)
    _, res, _ = run_policy(get_policy("default"), trace, device_budget(at), at)
    assert not res.oom


def test_the_command_writes_the_table_as_json(config_path, trace, tmp_path, capsys):
    out = tmp_path / "fit.json"
    assert main(["fit", f"hf:{config_path}", "--seq-len", str(SEQ), "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "fastest that fits" in text
    got = json.loads(out.read_text())
    assert {"rows", "fastest", "smallest"} <= set(got)
    assert [r["option"] for r in got["rows"]] == list(FIT_OPTIONS)
    assert all({"option", "fits", "device_peak_bytes", "host_peak_bytes", "step_s", "tokens_per_s", "mfu"} <= set(r)
               for r in got["rows"])
    # 80 GB holds this model: every option fits, and nothing moved is the fastest
    assert all(r["fits"] for r in got["rows"]) and got["fastest"] == "plain" and got["smallest"] is None
    hw = load_hardware("h100-pcie5")
    _, res, _ = run_policy(get_policy("no-swap"), trace, device_budget(hw), hw)
    assert got["rows"][0]["step_s"] == pytest.approx(res.iteration_s)


def test_a_sharded_job_is_tabled_by_fsdp2s_options_with_the_jobs_tokens(config_path, tmp_path, capsys):
    from swapsched.fit import SHARDED_OPTIONS

    out = tmp_path / "x4.json.gz"
    assert main(["profile", f"hf:{config_path}", "--device", "meta", "--hardware", "h100-sxm", "--seq-len", str(SEQ),
                 "--batch-size", "1", "--world-size", "4", "--out", str(out)]) == 0
    trace = load_trace(out)
    assert trace.world_size == 4 and all(g.gather_bytes > 0 for g in trace.state)
    hw = load_hardware("h100-sxm")
    report = fit(trace, [hw], SEQ, progress=False)
    assert [r.option for r in report.rows] == list(SHARDED_OPTIONS) and report.tokens == 4 * SEQ
    for row in report.rows:
        _, res, _ = run_policy(get_policy(SHARDED_OPTIONS[row.option]), trace, device_budget(hw), hw)
        assert row.fits == (not res.oom)
        if row.fits:
            assert row.tokens_per_s == pytest.approx(4 * SEQ / res.iteration_s)
            # the node's host: its 4 ranks alike (h100-sxm: 8 GPUs a node)
            assert res.host_ranks == 4 and row.host_peak_bytes == 4 * res.host_peak_bytes
    # plan and simulate read the rank's trace, and say what its collectives cost
    plan = tmp_path / "p.json"
    assert main(["plan", "--trace", str(out), "--policy", "fsdp-offload", "--hardware", "h100-sxm", "--budget", "40GB",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--trace", str(out), "--plan", str(plan), "--hardware", "h100-sxm", "--budget", "40GB"]) == 0
    said = capsys.readouterr().out
    assert "collectives (one rank of the job): all-gathered" in said and "(4 ranks)" in said


def test_each_hardware_gets_the_trace_timed_for_it(trace):
    # a roofline trace profiled for one device is re-timed for each (was: every row timed for
    # the first hardware given)
    small = replace(load_hardware("rtx4090-pcie4"), name="rtx4090-pcie4")
    both = fit(trace, [small, load_hardware("h100-pcie5")], SEQ, progress=False)
    alone = fit(trace, [load_hardware("h100-pcie5")], SEQ, progress=False)
    assert [r for r in both.rows if r.hardware == "h100-pcie5"] == list(alone.rows)


def test_with_a_disk_the_state_the_host_memory_cannot_hold_rests_there(trace):
    """R19: with host memory of half the state, nothing moving the state fits; with a disk
    budget, default does, resting part of it on the drive, and ZeRO-Infinity is a row."""
    hw = replace(load_hardware("h100-pcie5"), device_memory_bytes=_memory_between(trace))
    host = sum(g.bytes for g in trace.state) // 2
    without = fit(trace, [hw], SEQ, host_memory=host, progress=False)
    with_disk = fit(trace, [hw], SEQ, host_memory=host, disk=2**40, progress=False)
    assert "zero-infinity" not in [r.option for r in without.rows]
    assert [r.option for r in with_disk.rows][-2:] == ["zero-infinity", "default"]
    assert not without.rows[-1].fits
    default = with_disk.rows[-1]
    assert default.fits and default.host_peak_bytes is not None and default.host_peak_bytes <= host
    at = hw.with_host(host_budget_bytes=host, disk_budget_bytes=2**40)
    plan, res, _ = run_policy(get_policy("default"), trace, device_budget(hw), at)
    assert plan.disk and res.state is not None and res.state.disk_bytes > 0 and res.iteration_s == default.step_s
