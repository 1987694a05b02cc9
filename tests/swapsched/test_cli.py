"""swapsched/cli/:  every command end to end on small inputs; bad input exits 2 with one line."""

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


def test_plan_says_which_blocks_it_recomputes_and_how(tmp_path, capsys):
    from swapsched._paths import corpus_dir

    trace = corpus_dir() / "bert-base-b16-h100-pcie5.json.gz"
    assert main(["plan", "--trace", str(trace), "--policy", "checkpoint-selective", "--hardware", "h100-pcie5",
                 "--budget", "70%", "--out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "0 of 189 tensors evicted, 12 block(s) recomputed selectively" in out and "recompute " in out
    assert main(["plan", "--trace", str(trace), "--policy", "checkpoint-all", "--hardware", "h100-pcie5",
                 "--budget", "70%", "--out", str(tmp_path / "q.json")]) == 0
    assert "12 block(s) recomputed whole" in capsys.readouterr().out


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
    (["run", "mlp", "--disk", "."], "give --host-budget with --disk"),
    (["run", "mlp", "--optimizer", "adamw", "--host-budget", "1MiB", "--disk", ".", "--world-size", "2"],
     "leave them out with --world-size"),
    (["compare", "--disk-budget", "1GiB", "--hardware", "cpu-emulated", "--traces", "x"], "no disk bandwidth"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr


def test_bad_budget_exits_2(tmp_path):
    trace = tmp_path / "t.json"
    assert main(["profile", "mlp", "--size", "tiny", "--out", str(trace)]) == 0
    # below what any plan meets, even moving the state (R13): a relative budget is always above that
    r = run("plan", "--trace", str(trace), "--policy", "min", "--hardware", "h100-pcie5", "--budget", "1KiB", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "smallest feasible budget" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _subcommands() -> dict:
    from swapsched.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict))
    return sub.choices


@pytest.mark.parametrize("cmd", sorted(_subcommands()))
def test_help_documents_every_option(cmd):
    """--help exits 0 and names every option the sub-command accepts, each with a help text."""
    r = run(cmd, "--help")
    assert r.returncode == 0, r.stderr
    for action in _subcommands()[cmd]._actions:
        for flag in action.option_strings:
            assert flag in r.stdout, f"{cmd} --help does not mention {flag}"
        if action.option_strings and action.dest != "help":
            assert action.help, f"{cmd} {action.option_strings[0]} has no help text"


def test_run_checks_losses_and_writes_json(tmp_path, capsys):
    js, png = tmp_path / "run.json", tmp_path / "run.png"
    assert main(["run", "mlp", "--size", "tiny", "--budget", "85%", "--policy", "capuchin", "--steps", "5",
                 "--backend", "cpu", "--bandwidth", "2e9", "--compare", "--compare-policies", "min", "--rounds", "2",
                 "--json", str(js), "--plot", str(png), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "loss matches" in out and "interleaved: 2 shuffled rounds" in out
    assert "fastest that fits" in out or "no method fits" in out
    data = json.loads(js.read_text())
    assert [r["method"] for r in data["runs"]] == ["capuchin"]
    rows = data["compare"]["rows"]
    assert [r["method"] for r in rows] == ["plain", "checkpoint", "selective-checkpoint", "save_on_cpu",
                                           "checkpoint-offload", "capuchin", "min"]
    for r in rows:  # every method with a measured peak, a ratio to plain and its spread, bit-identical losses
        assert r["peak_bytes"] > 0 and r["ratio_low"] <= r["ratio"] <= r["ratio_high"] and r["loss_matches"] is True
        assert r["fits"] == (r["peak_bytes"] <= data["compare"]["budget_bytes"])
    assert rows[0]["ratio"] == 1.0 and "emulated link" in rows[3]["note"]  # save_on_cpu on a CPU-only machine, said so
    fits = [r for r in rows if r["fits"]]
    assert data["compare"]["fastest"] == (min(fits, key=lambda r: r["ratio"])["method"] if fits else None)
    assert png.stat().st_size > 5000


def test_run_says_why_a_plan_was_not_followed(capsys):
    # no-swap plans nothing; under 40% the guard must evict on the spot at every executed step
    # (gpt: its forward holds more than its weights' gradients, which a relative budget counts static, R3)
    assert main(["run", "gpt", "--size", "tiny", "--budget", "40%", "--policy", "no-swap", "--steps", "5",
                 "--backend", "cpu", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "no-swap: plan not followed: the guard evicted" in out and "in 2 of 2 executed steps" in out


def test_run_rejects_too_few_steps():
    r = run("run", "mlp", "--size", "tiny", "--steps", "2", "--policy", "min", "--backend", "cpu")
    assert r.returncode == 2 and "must exceed" in r.stderr


def test_calibrate_writes_a_loadable_profile(tmp_path):
    from swapsched.hardware import load_hardware

    out = tmp_path / "cal.yaml"
    assert main(["calibrate", "--backend", "cpu", "--bandwidth", "2e9", "--out", str(out)]) == 0
    hw = load_hardware(out)
    assert 0.5e9 < hw.d2h_bytes_per_s < 4e9 and hw.hook_cost_s >= 0
    assert hw.copy_issue_s >= 0 and hw.wait_resume_s >= 0 and hw.state_hook_s >= 0
    assert "state_hook_s:" in out.read_text()  # measured (R13-R16), with where it came from
    # R15: the host's AdamW, measured (a 2-core machine steps 1e8-1e10 parameters a second)
    assert hw.host_optimizer_params_per_s is not None and 1e7 < hw.host_optimizer_params_per_s < 1e11
    assert "measured by swapsched calibrate" in out.read_text() and "AdamW(fused=True)" in out.read_text()


# the smallest training that runs every phase: the tests check its files and card, not how well
# it plans (one chooser network: with the 116-trace corpus five took 17 s more a run)
TINY_TRAIN = ("total_timesteps: 256\nn_envs: 1\nhardware: [h100-pcie5]\neval_every: 128\n"
              "prior_cases_per_trace: 1\nprior_seconds: 0.05\neditor_cases_per_trace: 1\neditor_seconds: 0.05\neditor_rl_iterations: 2\n"
              "blocks_cases_per_trace: 1\nblocks_hidden: 8\nblocks_members: 1\n"
              "eval: {budgets: ['60%'], hardware: [h100-pcie5], baselines: [min]}\n"
              "ppo: {n_steps: 64, batch_size: 32, n_epochs: 1, net_arch: [16, 16]}\n")


# 80 s: the whole train-policy pipeline (PPO, validation, the search parts over the corpus); the
# default run keeps test_ctrl_c_leaves_a_loadable_checkpoint and the agents' own tests
@pytest.mark.slow
def test_train_policy_writes_a_checkpoint_that_plans_and_resumes(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_TRAIN)
    out = tmp_path / "p.zip"
    assert main(["train-policy", "--config", str(cfg), "--out", str(out), "--no-progress", "--seed", "3"]) == 0
    card = json.loads(out.with_suffix(".json").read_text())
    assert card["timesteps"] == 256 and card["seed"] == 3 and card["env_version"] == 1
    assert card["held_out"]["summary"][0]["policy"] == "learned-greedy:p"
    assert "bert" in card["validation_families"] and "bert" not in card["training_families"]
    assert (tmp_path / "p.best.zip").is_file()  # validation ran at step 128 and kept the best
    assert all((tmp_path / f"p.{part}.npz").is_file() for part in ("moves", "editor", "blocks"))  # the search's parts
    # which learned from the train split (bert held out) and the generated architectures
    from swapsched.env.corpus import load_corpus
    n_train = sum(1 for t in load_corpus(split="train") if not t.name.startswith("bert"))
    assert card["search_parts"]["splits"] == ["train", "generated"]
    assert card["search_parts"]["traces"] == n_train + len(load_corpus(split="generated")) and card["search_parts"]["seconds"] > 0
    # the checkpoint is a policy like any other, greedy or with search
    trace = tmp_path / "t.json"
    assert main(["profile", "mlp", "--size", "tiny", "--out", str(trace)]) == 0
    for pol in (str(out), f"learned-greedy:{out}", f"learned-ppo:{out}"):
        assert main(["plan", "--trace", str(trace), "--policy", pol, "--hardware", "h100-pcie5", "--budget", "90%",
                     "--out", str(tmp_path / "plan.json")]) == 0
    # --resume continues the step count
    out2 = tmp_path / "q.zip"
    assert main(["train-policy", "--config", str(cfg), "--out", str(out2), "--no-progress", "--resume", str(out),
                 "--timesteps", "128"]) == 0
    card2 = json.loads(out2.with_suffix(".json").read_text())
    assert card2["timesteps"] == 256 + 128 and card2["timesteps_this_run"] == 128 and card2["resumed_from"] == str(out)


def test_ctrl_c_leaves_a_loadable_checkpoint(tmp_path):
    from stable_baselines3.common.callbacks import BaseCallback

    from swapsched.agents.learned import LearnedPolicy
    from swapsched.agents.train import load_train_config, train_policy
    from swapsched.env.corpus import load_corpus
    from swapsched.hardware import load_hardware

    class CtrlC(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps >= 128:
                raise KeyboardInterrupt
            return True

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_TRAIN)
    res = train_policy(load_train_config(cfg), tmp_path / "c.zip", progress=False, callbacks=[CtrlC()])
    assert res.interrupted and 128 <= res.timesteps < 256
    assert not list(tmp_path.glob("*.partial.*"))  # written to a temporary file, then renamed
    tr = load_corpus(names=["mlp-tiny-cpu"])[0]
    plan = LearnedPolicy(res.checkpoint).plan(tr, tr.peak_bytes_no_swap, load_hardware("h100-pcie5"))
    plan.validate(tr)


def test_a_corrupt_or_mismatched_checkpoint_is_one_clear_line(tmp_path):
    trace = tmp_path / "t.json"
    assert main(["profile", "mlp", "--size", "tiny", "--out", str(trace)]) == 0
    from stable_baselines3 import PPO

    from swapsched._paths import checkpoint_dir

    bad = tmp_path / "bad.zip"
    bad.write_bytes(b"not a zip at all")
    cut = tmp_path / "cut.zip"  # a real checkpoint cut short
    cut.write_bytes((checkpoint_dir() / "default.zip").read_bytes()[:100_000])
    other = tmp_path / "other.zip"  # another algorithm's checkpoint
    PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, device="cpu").save(other)
    for policy, message in ((f"learned-ppo:{bad}", "cannot read checkpoint"), (str(bad), "has no plan editor"),
                            (f"learned-ppo:{cut}", "cannot read checkpoint"),
                            (f"learned-ppo:{other}", "is not a MaskablePPO checkpoint")):
        r = run("plan", "--trace", str(trace), "--policy", policy, "--hardware", "h100-pcie5", "--budget", "90%",
                "--out", str(tmp_path / "p.json"))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr
    import shutil

    old = tmp_path / "old.zip"
    shutil.copy(checkpoint_dir() / "default.zip", old)
    old.with_suffix(".json").write_text(json.dumps({"env_version": 0}))
    r = run("plan", "--trace", str(trace), "--policy", str(old), "--hardware", "h100-pcie5", "--budget", "90%",
            "--out", str(tmp_path / "p.json"))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "SwapEnv version 0" in lines[0] and "retrain" in lines[0]


def test_train_policy_bad_config(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("total_timestep: 5\n")
    r = run("train-policy", "--config", str(cfg), "--out", str(tmp_path / "x.zip"))
    assert r.returncode == 2 and "unknown field" in r.stderr


def test_version_and_budgets_checked_where_given():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("swapsched ")
    r = run("compare", "--budgets", "50%,abc", "--policies", "min")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "'abc' not understood" in lines[0]
    r = run("run", "mlp", "--budget", "1e99GiB")
    assert r.returncode == 2 and "more bytes than any device has" in r.stderr


def test_compare_json_is_strict(tmp_path):
    out = tmp_path / "c.json"
    trace = tmp_path / "t.json"
    assert main(["profile", "mlp", "--size", "tiny", "--out", str(trace)]) == 0
    # no-swap at 70% is an OOM: infinite step time and NaN means, written as null (at 80% it fits:
    # a relative budget counts the gradients static, the step makes them in backward, R3)
    assert main(["compare", "--traces", str(trace), "--budgets", "70%", "--policies", "no-swap", "--json", str(out),
                 "--no-progress"]) == 0

    def reject(c: str) -> None:
        raise AssertionError(f"non-strict JSON constant {c}")

    data = json.loads(out.read_text(), parse_constant=reject)
    assert data["rows"][0]["oom"] is True and data["rows"][0]["iteration_s"] is None
    assert data["summary"][0]["mean_overhead"] is None


def test_optimal_plan_carries_its_bound_into_simulate_json(tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert main(["profile", "gpt", "--size", "tiny", "--out", str(trace)]) == 0
    plan, js = tmp_path / "p.json", tmp_path / "s.json"
    assert main(["plan", "--trace", str(trace), "--policy", "optimal:2s", "--hardware", "h100-pcie5", "--budget", "60%",
                 "--out", str(plan)]) == 0
    assert "status" in capsys.readouterr().out
    assert main(["simulate", "--trace", str(trace), "--plan", str(plan), "--hardware", "h100-pcie5", "--budget", "60%",
                 "--json", str(js)]) == 0
    d = json.loads(js.read_text())
    assert 0 < d["bound_s"] <= d["iteration_s"] and d["gap"] == pytest.approx((d["iteration_s"] - d["bound_s"]) / d["iteration_s"])
    r = run("compare", "--policies", "optimal:0s")
    assert r.returncode == 2 and "time limit must be positive" in r.stderr


def test_hf_models_say_they_were_built_small(tmp_path):
    pytest.importorskip("transformers")
    r = run("profile", "hf:gpt2", "--out", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stderr
    assert "hf:gpt2: built small (2 layers" in r.stderr and "--size full" in r.stderr


def test_sigterm_mid_compare_exits_130_and_leaves_the_old_file(tmp_path, capsys):
    """SIGTERM unwinds like Ctrl-C: the command stops, and the file it was to replace is intact."""
    import os
    import signal
    import threading

    out = tmp_path / "rows.json"
    out.write_text('{"old": true}\n')
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code = main(["compare", "--budgets", "30%,50%,70%,90%", "--policies", "min,capuchin,local-search",
                     "--no-progress", "--json", str(out)])
    finally:
        timer.cancel()
    assert code == 130 and "interrupted" in capsys.readouterr().err
    assert json.loads(out.read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_profile_finds_a_factory_in_the_working_directory(tmp_path):
    # the console script, run where mymodel.py is, as a user would (uvicorn and pytest find it too)
    import shutil

    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def build():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))\n"
        "    return m, (torch.randn(8, 16),), lambda out: out.pow(2).mean()\n")
    exe = shutil.which("swapsched") or pytest.skip("the swapsched console script is not installed")
    r = subprocess.run([exe, "profile", "mymodel:build", "--out", "t.json"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "t.json").is_file()


def test_a_short_run_scales_the_search_parts_and_says_each_phase_up_front(tmp_path):
    from swapsched.agents.train import TrainConfig, phase_plan

    full = TrainConfig()
    assert full.scaled(full.total_timesteps * 2) is full  # never above the config's own
    quick = full.scaled(2048)
    assert quick.total_timesteps == 2048
    assert (quick.prior_cases_per_trace, quick.editor_cases_per_trace, quick.blocks_cases_per_trace) == (1, 1, 2)
    assert (quick.prior_seconds, quick.editor_seconds, quick.editor_rl_iterations) == (0.1, 0.1, 10)
    assert (quick.blocks_members, full.blocks_members) == (1, 5)
    half = full.scaled(full.total_timesteps // 2)
    assert half.blocks_cases_per_trace == 30 and half.prior_seconds == 0.25 and half.blocks_members == 2  # in proportion
    # 8,192 PPO steps at 1,600/s after a 10 s start; 54 traces x 1 search x 0.1 s for the prior;
    # the editor's 54 searches of 0.1 s and 10 iterations of 0.02 s; 54 x 2 cases x 49 choices at
    # 670 simulations/s and one network of 20 s; 8 held-out traces x 3 budgets x 1 link (the
    # config's evaluation) of 0.55 s
    phases = phase_plan(quick, 22, 54, 8192, 8)
    assert [round(s, 2) for _, s in phases] == [round(10 + 8192 / 1600, 2), 5.4, 5.6, round(54 * 2 * 49 / 670 + 20, 2),
                                                round(24 * 0.55, 2)]
    assert sum(s for _, s in phases) < 180  # a few minutes
    # the full run, as session 18 measured it from scratch: 27 min; well under the hour
    assert 1200 < sum(s for _, s in phase_plan(full, 23, 55, 1_507_328, 8)) < 3600


def test_an_interrupted_search_phase_leaves_the_ppo_checkpoint_a_card_and_how_to_go_on(tmp_path, monkeypatch, capsys):
    import swapsched.agents.train as train_module

    def stopped(*args, **kwargs):  # SIGTERM (raised as KeyboardInterrupt by the CLI) while learning the parts
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "train_search", stopped)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_TRAIN)
    out = tmp_path / "p.zip"
    assert main(["train-policy", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert "phases (about, on 2 cores): 1/5 PPO" in err
    assert f"interrupted in search parts: PPO is done and saved; learn the search parts with  swapsched train-policy --config {cfg} --search-only --out {out}" in err
    card = json.loads(out.with_suffix(".json").read_text())
    assert card["interrupted"] and card["stopped_in"] == "search parts" and card["timesteps"] == 256
    from swapsched.agents.learned import LearnedPolicy
    from swapsched.env.corpus import load_corpus
    from swapsched.hardware import load_hardware

    tr = load_corpus(names=["mlp-tiny-cpu"])[0]
    LearnedPolicy(out, mode="ppo").plan(tr, tr.peak_bytes_no_swap, load_hardware("h100-pcie5")).validate(tr)


def test_plan_and_simulate_rest_the_state_the_host_cannot_hold_on_the_disk(tmp_path, capsys):
    """R19 from the command line: with a host budget below the state and a disk budget, plan
    rests optimizer state on the disk and simulate says what it reads and writes a step."""
    trace, plan = tmp_path / "t.json", tmp_path / "p.json"
    assert main(["profile", "gpt", "--size", "100m", "--device", "meta", "--hardware", "h100-pcie5", "--out", str(trace)]) == 0
    budgets = ["--hardware", "h100-pcie5", "--budget", "700MiB", "--host-budget", "600MiB", "--disk-budget", "10GiB"]
    assert main(["plan", "--trace", str(trace), "--policy", "default", *budgets, "--out", str(plan)]) == 0
    saved = json.loads(plan.read_text())
    assert saved["version"] == 6 and saved["disk"] and {d["tier"] for d in saved["disk"]} <= {"optim", "state"}
    capsys.readouterr()
    assert main(["simulate", "--trace", str(trace), "--plan", str(plan), *budgets]) == 0
    out = capsys.readouterr().out
    assert "disk: " in out and "at rest, read" in out and "OOM" not in out
