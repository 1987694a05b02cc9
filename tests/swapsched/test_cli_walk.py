"""Every command and flag of the CLI, given a wrong value: exit 2, one line, no traceback, and no
output file left behind.

Each case starts from a command line that works and spoils one flag, so the walk checks the flag,
not a missing companion. The wrong values must be refused before any work is done: the commands
that train or calibrate would otherwise run for minutes here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swapsched.cli import build_parser, main
from swapsched.plan import Eviction, SwapPlan
from swapsched.trace_file import save_trace
from tests.conftest import make_trace

MISSING = "/no/such/dir/file.json"
UNWRITABLE = "/proc/swapsched-no/out.json"  # /proc takes no new directories, even for root


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("walk")
    tr = make_trace([4096, 8192], [("pack", 0, 1e-3), ("pack", 1, 1e-3), ("unpack", 1, 2e-3), ("unpack", 0, 1e-3)])
    save_trace(tr, tmp / "t.json")
    SwapPlan.of(tr, "hand", [Eviction(0, 0, 2)]).save(tmp / "p.json")
    return {"trace": str(tmp / "t.json"), "plan": str(tmp / "p.json"), "dir": str(tmp)}


def _base(cmd: str, f: dict[str, str], out: str) -> list[str]:
    return {
        "profile": ["profile", "mlp", "--size", "tiny", "--out", out],
        "inspect": ["inspect", f["trace"]],
        "simulate": ["simulate", "--trace", f["trace"], "--plan", f["plan"], "--hardware", "h100-pcie5", "--budget", "80%",
                     "--json", out],
        "plan": ["plan", "--trace", f["trace"], "--policy", "min", "--hardware", "h100-pcie5", "--budget", "80%", "--out", out],
        "compare": ["compare", "--traces", f["trace"], "--policies", "min", "--budgets", "80%", "--no-progress", "--json", out],
        "run": ["run", "mlp", "--size", "tiny", "--steps", "4", "--policy", "min", "--backend", "cpu", "--no-progress",
                "--json", out],
        "calibrate": ["calibrate", "--backend", "cpu", "--out", out],
        "train-policy": ["train-policy", "--out", out, "--timesteps", "64", "--no-progress"],
        "fit": ["fit", "mlp", "--size", "tiny", "--no-progress", "--json", out],
    }[cmd]


def _spoil(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag`` set to ``value`` (replaced where present, else appended); a
    positional is named by its index in ``args``."""
    if flag.isdigit():
        args = list(args)
        args[int(flag)] = value
        return args
    if flag in args:
        i = args.index(flag)
        return [*args[: i + 1], value, *args[i + 2:]]
    return [*args, flag, value]


# (command, flag, wrong value, words the one line must contain)
CASES = [
    ("profile", "1", "lstm", "unknown model 'lstm'"),
    ("profile", "--size", "huge", "huge"),
    ("profile", "--batch-size", "0", "positive integer"),
    ("profile", "--batch-size", "many", "positive integer"),
    ("profile", "--seq-len", "-4", "positive integer"),
    ("profile", "--device", "tpu", "invalid choice"),
    ("profile", "--hardware", "abacus", "unknown hardware 'abacus'"),
    ("profile", "--dtype", "int8", "invalid choice"),
    ("profile", "--attention", "fast", "invalid choice"),
    ("profile", "--optimizer", "lion", "invalid choice"),
    ("profile", "--out", UNWRITABLE, "cannot write"),
    ("profile", "--override", "n_layer", "give KEY=VALUE"),
    ("profile", "--world-size", "0", "positive integer"),
    ("fit", "--world-size", "two", "positive integer"),
    ("run", "--world-size", "0", "positive integer"),
    ("profile", "--lora-rank", "0", "positive integer"),
    ("fit", "--lora-rank", "sixteen", "positive integer"),
    ("calibrate", "--world-size", "0", "positive integer"),
    ("fit", "1", "lstm", "unknown model 'lstm'"),
    ("fit", "--size", "huge", "huge"),
    ("fit", "--override", "n_layer=2", "is not a hf: model"),
    ("fit", "--hardware", "abacus", "unknown hardware 'abacus'"),
    ("fit", "--host-memory", "50%", "give bytes"),
    ("fit", "--seq-len", "0", "positive integer"),
    ("fit", "--batch-size", "x", "positive integer"),
    ("fit", "--optimizer", "lion", "invalid choice"),
    ("fit", "--disk-budget", "5%", "give bytes"),
    ("fit", "--dtype", "int8", "invalid choice"),
    ("fit", "--json", UNWRITABLE, "cannot write"),
    ("fit", "--plot", UNWRITABLE, "cannot write"),
    ("inspect", "1", MISSING, "no such file"),
    ("simulate", "--trace", MISSING, "no such file"),
    ("simulate", "--plan", MISSING, "no such file"),
    ("simulate", "--hardware", "abacus", "unknown hardware"),
    ("simulate", "--executor", "jit", "invalid choice"),
    ("simulate", "--host-budget", "50%", "give bytes"),
    ("simulate", "--disk-budget", "50%", "give bytes"),
    ("simulate", "--budget", "lots", "budget"),
    ("simulate", "--budget", "-5%", "budget"),
    ("simulate", "--budget", "1e99", "budget"),
    ("simulate", "--json", UNWRITABLE, "cannot write"),
    ("simulate", "--plot", UNWRITABLE.replace(".json", ".png"), "cannot write"),
    ("plan", "--trace", MISSING, "no such file"),
    ("plan", "--policy", "magic", "unknown policy 'magic'"),
    ("plan", "--hardware", "abacus", "unknown hardware"),
    ("plan", "--executor", "jit", "invalid choice"),
    ("plan", "--host-budget", "50%", "give bytes"),
    ("plan", "--disk-budget", "lots", "disk budget"),
    ("plan", "--budget", "1%", "smallest feasible budget"),
    ("plan", "--seed", "x", "invalid int"),
    ("plan", "--search-seconds", "0", "positive number"),
    ("plan", "--search-seconds", "nan", "positive number"),
    ("plan", "--out", UNWRITABLE, "cannot write"),
    ("compare", "--traces", MISSING, "no such file"),
    ("compare", "--budgets", "50%,abc", "abc"),
    ("compare", "--hardware", "abacus", "unknown hardware"),
    ("compare", "--executor", "jit", "invalid choice"),
    ("compare", "--host-budget", "50%", "give bytes"),
    ("compare", "--disk-budget", "50%", "give bytes"),
    ("compare", "--ranks-per-host", "0", "positive integers"),
    ("compare", "--policies", "min,magic", "unknown policy 'magic'"),
    ("compare", "--seed", "1.5", "invalid int"),
    ("compare", "--search-seconds", "-2", "positive number"),
    ("compare", "--json", UNWRITABLE, "cannot write"),
    ("compare", "--plot", UNWRITABLE.replace(".json", ".png"), "cannot write"),
    ("run", "1", "lstm", "unknown model 'lstm'"),
    ("run", "--size", "huge", "huge"),
    ("run", "--host-budget", "25%", "give bytes"),
    ("run", "--disk", MISSING, "no such directory"),
    ("run", "--disk-budget", "10%", "give bytes"),
    ("run", "--batch-size", "0", "positive integer"),
    ("run", "--seq-len", "zero", "positive integer"),
    ("run", "--rounds", "0", "positive integer"),
    ("run", "--round-steps", "x", "positive integer"),
    ("run", "--budget", "150%", "budget"),
    ("run", "--policy", "magic", "unknown policy 'magic'"),
    ("run", "--steps", "0", "positive integer"),
    ("run", "--steps", "2", "steps"),
    ("run", "--backend", "tpu", "invalid choice"),
    ("run", "--optimizer", "lion", "invalid choice"),
    ("run", "--bandwidth", "-1", "positive number"),
    ("run", "--hardware", "abacus", "unknown hardware"),
    ("run", "--compare-policies", "min,magic", "unknown policy 'magic'"),
    ("run", "--json", UNWRITABLE, "cannot write"),
    ("run", "--plot", UNWRITABLE.replace(".json", ".png"), "cannot write"),
    ("calibrate", "--backend", "tpu", "invalid choice"),
    ("calibrate", "--disk", MISSING, "no such directory"),
    ("calibrate", "--bandwidth", "0", "positive number"),
    ("calibrate", "--out", UNWRITABLE, "cannot write"),
    ("train-policy", "--config", MISSING, "no such file"),
    ("train-policy", "--out", UNWRITABLE, "cannot write"),
    ("train-policy", "--timesteps", "-1", "positive integer"),
    ("train-policy", "--seed", "one", "invalid int"),
    ("train-policy", "--n-envs", "0", "positive integer"),
    ("train-policy", "--resume", MISSING, "no such file"),
    ("train-policy", "--tensorboard", "/proc/swapsched-no/tb", "cannot write"),
]
if not torch.cuda.is_available():
    CASES += [("run", "--backend", "cuda", "CUDA"), ("calibrate", "--backend", "cuda", "CUDA")]


@pytest.mark.parametrize("cmd, flag, value, words", CASES, ids=[f"{c}-{f}-{v}" for c, f, v, _ in CASES])
def test_a_wrong_value_is_one_line_and_exit_2(files, tmp_path, capsys, cmd, flag, value, words):
    out = str(tmp_path / ("out.yaml" if cmd == "calibrate" else "out.zip" if cmd == "train-policy" else "out.json"))
    args = _spoil(_base(cmd, files, out), flag, value)
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("usage:") and not ln.startswith("  ")]
    assert code == 2, (args, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert words.lower() in lines[0].lower(), lines[0]
    assert not Path(out).exists(), f"{cmd} left {out} behind"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], f"{cmd} left files behind: {list(tmp_path.iterdir())}"


def test_the_walk_covers_every_flag():
    """A flag added to the CLI without a wrong-value case here fails this test."""
    sub = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict))
    covered = {(c, f) for c, f, _, _ in CASES}
    missing = []
    for name, parser in sub.choices.items():
        positionals = [a for a in parser._actions if not a.option_strings]
        for a in parser._actions:
            if a.dest == "help" or a.nargs == 0:
                continue  # switches take no value to spoil
            if a.option_strings:
                if not any((name, flag) in covered for flag in a.option_strings):
                    missing.append(f"{name} {a.option_strings[0]}")
            elif (name, str(1 + positionals.index(a))) not in covered and name != "calibrate":
                missing.append(f"{name} <{a.dest}>")
    # --name of calibrate takes any string (it names the profile)
    assert missing == ["calibrate --name"], missing
