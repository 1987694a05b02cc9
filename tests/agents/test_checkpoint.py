"""A checkpoint is data: a crafted checkpoint whose pickled fields would create a marker file when
unpickled never creates it, whether it is loaded to plan (every learned mode), to compare, or to
resume training; the shipped checkpoint still loads."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import zipfile
from pathlib import Path

import cloudpickle
import pytest

from swapsched._paths import checkpoint_dir
from swapsched.agents.checkpoint import REBUILT_ENTRIES, CheckpointError, load_ppo
from swapsched.cli import main


class _Touch:
    """Unpickling this creates ``path``: what a malicious pickle would do, harmlessly."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickled(obj: object) -> dict:
    return {":type:": "<class 'object'>", ":serialized:": base64.b64encode(cloudpickle.dumps(obj)).decode()}


def _craft(tmp_path: Path, marker: Path, *, extra: str | None = None) -> Path:
    """A copy of the shipped ``default`` checkpoint (its card, editor, chooser and prior beside it) in which
    every pickled field of ``data`` would create ``marker``; with ``extra``, one more such field."""
    out = tmp_path / "crafted.zip"
    src = checkpoint_dir() / "default.zip"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w") as zout:
        for item in zin.infolist():
            raw = zin.read(item.filename)
            if item.filename == "data":
                data = json.loads(raw)
                for key, value in data.items():
                    if isinstance(value, dict) and ":serialized:" in value:
                        # keep the plain-text attributes SB3 writes beside the pickle (the policy
                        # class's module), replace the pickle itself
                        data[key] = {**value, **_pickled(_Touch(marker))}
                if extra:
                    data[extra] = _pickled(_Touch(marker))
                raw = json.dumps(data).encode()
            zout.writestr(item, raw)
    for suffix in (".json", ".editor.npz", ".moves.npz", ".blocks.npz"):
        shutil.copy(src.with_name("default" + suffix), out.with_name("crafted" + suffix))
    return out


def test_the_crafted_checkpoint_would_run_code_if_unpickled(tmp_path):
    # the test's own premise: stable-baselines3's plain load does create the marker on this file
    from sb3_contrib import MaskablePPO

    marker = tmp_path / "ran"
    crafted = _craft(tmp_path, marker)
    # the unpickled objects are file handles, not spaces: the load fails after running them
    with contextlib.suppress(Exception):
        MaskablePPO.load(str(crafted), device="cpu")
    assert marker.exists()


@pytest.mark.parametrize("mode", ["learned-ppo", "learned-greedy", "learned"])
def test_planning_with_a_crafted_checkpoint_runs_none_of_its_code(tmp_path, mode):
    marker = tmp_path / "ran"
    crafted = _craft(tmp_path, marker)
    trace = tmp_path / "t.json"
    assert main(["profile", "mlp", "--size", "tiny", "--out", str(trace)]) == 0
    assert main(["plan", "--trace", str(trace), "--policy", f"{mode}:{crafted}", "--hardware", "h100-pcie5",
                 "--budget", "90%", "--out", str(tmp_path / "plan.json")]) == 0
    assert not marker.exists()


def test_compare_with_a_crafted_checkpoint_runs_none_of_its_code(tmp_path):
    marker = tmp_path / "ran"
    crafted = _craft(tmp_path, marker)
    trace = tmp_path / "t.json"
    assert main(["profile", "mlp", "--size", "tiny", "--out", str(trace)]) == 0
    assert main(["compare", "--traces", str(trace), "--budgets", "90%", "--no-progress",
                 "--policies", f"min,learned-ppo:{crafted},learned:{crafted}"]) == 0
    assert not marker.exists()


def test_resume_from_a_crafted_checkpoint_runs_none_of_its_code(tmp_path):
    from tests.swapsched.test_cli import TINY_TRAIN

    marker = tmp_path / "ran"
    crafted = _craft(tmp_path, marker)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_TRAIN + "search_extra_splits: []\n")  # the search parts on the zoo alone: what is tested is the resume
    out = tmp_path / "resumed.zip"
    assert main(["train-policy", "--config", str(cfg), "--out", str(out), "--no-progress", "--resume", str(crafted),
                 "--timesteps", "64"]) == 0
    assert not marker.exists()
    card = json.loads(out.with_suffix(".json").read_text())
    assert card["timesteps"] > json.loads(crafted.with_suffix(".json").read_text())["timesteps"]


def test_an_unknown_pickled_field_is_refused_in_one_line(tmp_path, capsys):
    marker = tmp_path / "ran"
    crafted = _craft(tmp_path, marker, extra="features_extractor_class")
    with pytest.raises(CheckpointError, match=r"pickled field\(s\) \['features_extractor_class'\].*would run code"):
        load_ppo(crafted)
    assert not marker.exists()


def test_policy_kwargs_naming_a_class_is_refused(tmp_path):
    out = tmp_path / "kw.zip"
    with zipfile.ZipFile(checkpoint_dir() / "default.zip") as zin, zipfile.ZipFile(out, "w") as zout:
        for item in zin.infolist():
            raw = zin.read(item.filename)
            if item.filename == "data":
                data = json.loads(raw)
                data["policy_kwargs"] = {"net_arch": [128, 128], "activation_fn": "os.system"}
                raw = json.dumps(data).encode()
            zout.writestr(item, raw)
    with pytest.raises(CheckpointError, match="policy_kwargs may hold only 'net_arch'"):
        load_ppo(out)


def test_every_pickled_field_of_the_shipped_checkpoint_is_rebuilt():
    with zipfile.ZipFile(checkpoint_dir() / "default.zip") as z:
        data = json.loads(z.read("data"))
    pickled = {k for k, v in data.items() if isinstance(v, dict) and ":serialized:" in v}
    assert pickled and pickled <= set(REBUILT_ENTRIES)


def test_the_shipped_checkpoint_loads_with_its_weights():
    import torch
    from sb3_contrib import MaskablePPO

    safe = load_ppo(checkpoint_dir() / "default.zip", device="cpu")
    assert isinstance(safe, MaskablePPO)
    with zipfile.ZipFile(checkpoint_dir() / "default.zip") as z, z.open("policy.pth") as f:
        weights = torch.load(f, weights_only=True)
    got = safe.policy.state_dict()
    assert set(got) == set(weights) and all(torch.equal(got[k], weights[k]) for k in weights)
