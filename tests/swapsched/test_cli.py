"""swapsched/cli.py: every command end to end on small inputs; bad input exits 2 with one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swapsched.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swapsched.cli", *args], capture_output=True, text=True, timeout=300)


def test_profile_then_inspect(tmp_path, capsys):
    out = tmp_path / "t.json.gz"
    assert main(["profile", "gpt", "--size", "tiny", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert {"name", "tensors", "events", "saved_bytes_peak", "static_bytes", "compute_s", "timing"} <= set(s)
    assert s["name"] == "gpt-tiny" and s["timing"] == "measured" and s["tensors"] > 10


def test_meta_profile(tmp_path):
    out = tmp_path / "m.json"
    assert main(["profile", "gpt", "--size", "350m", "--device", "meta", "--hardware", "h100-pcie5", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["timing"] == "roofline"


def test_plan_simulate_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert main(["profile", "mlp", "--size", "tiny", "--out", str(trace)]) == 0
    plan = tmp_path / "p.json"
    assert main(["plan", "--trace", str(trace), "--policy", "capuchin", "--hardware", "cpu-emulated",
                 "--budget", "50%", "--out", str(plan)]) == 0
    res, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["simulate", "--trace", str(trace), "--plan", str(plan), "--hardware", "cpu-emulated",
                 "--budget", "50%", "--json", str(res), "--plot", str(png)]) == 0
    d = json.loads(res.read_text())
    assert {"iteration_s", "ideal_s", "overhead", "stall_s", "peak_bytes", "budget_bytes", "oom", "oom_event",
            "d2h_bytes", "h2d_bytes"} <= set(d)
    assert d["peak_bytes"] <= d["budget_bytes"] and png.stat().st_size > 10_000


def test_compare_table_json_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert main(["profile", "vgg", "--size", "tiny", "--out", str(trace)]) == 0
    capsys.readouterr()
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    assert main(["compare", "--traces", str(trace), "--budgets", "40%,80%", "--hardware", "cpu-emulated,h100-pcie5",
                 "--policies", "no-swap,swap-all,min,capuchin,swapadvisor", "--search-seconds", "0.5",
                 "--json", str(js), "--plot", str(png), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "vgg-tiny" in out and "mean overhead" in out
    rows = json.loads(js.read_text())["rows"]
    assert len(rows) == 2 * 2 * 5
    keys = {"trace", "budget", "hardware", "policy", "iteration_s", "ideal_s", "overhead", "stall_s", "peak_bytes",
            "oom", "d2h_bytes", "h2d_bytes", "plan_s"}
    solved = [r for r in rows if not r.get("skipped")]
    assert solved and all(keys <= set(r) for r in solved)
    assert all("smallest feasible" in r["skipped"] for r in rows if r.get("skipped"))
    assert png.exists() and (tmp_path / "c-timeline.png").exists()


@pytest.mark.parametrize("args, message", [
    (["profile", "lstm"], "unknown model 'lstm'"),
    (["profile", "gpt", "--batch-size", "-3"], "expected a positive integer"),
    (["profile", "gpt", "--device", "tpu"], "invalid choice"),
    (["inspect", "/no/such/file.json"], "no such file"),
    (["compare", "--policies", "magic", "--traces", "x"], "unknown policy 'magic'"),
    (["simulate", "--trace", "x"], "the following arguments are required"),
    (["compare", "--budgets", ",", "--traces", "x"], "expected a comma-separated list"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr


def test_bad_budget_exits_2(tmp_path):
    trace = tmp_path / "t.json"
    assert main(["profile", "mlp", "--size", "tiny", "--out", str(trace)]) == 0
    r = run("plan", "--trace", str(trace), "--policy", "min", "--hardware", "h100-pcie5", "--budget", "1%", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "smallest feasible budget" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("cmd", ["profile", "inspect", "simulate", "plan", "compare"])
def test_help(cmd):
    r = run(cmd, "--help")
    assert r.returncode == 0 and "usage:" in r.stdout
