"""Every loader, fed bad bytes: only the project's own error type comes out, naming the file.

Random bytes, valid files truncated at any byte (plain and gzipped), and valid files with one field
replaced by a value of another type, sign or range (NaN and infinities included). A mutated file may
still be valid (a float for a float); then it must load. What may never happen is another exception
(a KeyError, a TypeError, a numpy error) or a message that does not say which file.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swapsched.agents.editor import PlanEditor
from swapsched.agents.guide import MovePrior
from swapsched.agents.train import load_train_config
from swapsched.errors import UserError
from swapsched.hardware import HardwareError, load_hardware
from swapsched.plan import Eviction, PlanError, SwapPlan, load_plan
from swapsched.trace import TraceError
from swapsched.trace_file import load_trace, save_trace
from tests.conftest import make_trace

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])
ODD_VALUES = [None, True, "x", "", -1, 0, 2**63, -(2**40), 1e308, -0.5, math.nan, math.inf, -math.inf, [], {}, [1, 2],
              {"a": 1}]


def _trace():
    return make_trace([100, 200, 50], [("pack", 0, 1.0), ("pack", 1, 0.5), ("pack", 2, 0.2), ("unpack", 2, 0.3),
                                       ("unpack", 1, 1.0), ("unpack", 0, 0.7)], tail=0.1, static=64)


def _valid_files(tmp: Path) -> dict[str, Path]:
    tr = _trace()
    save_trace(tr, tmp / "t.json")
    plan = SwapPlan.of(tr, "hand", [Eviction(0, 0, 4), Eviction(1, 1, 3)])
    plan.save(tmp / "p.json")
    (tmp / "h.yaml").write_text("name: fuzz\nd2h_bytes_per_s: 2.0e10\nh2d_bytes_per_s: 2.0e10\ncopy_latency_s: 1.0e-5\n"
                                "device_memory_bytes: 80000000000\npeak_flops: 1.0e14\nmemory_bytes_per_s: 2.0e12\n")
    (tmp / "c.yaml").write_text("total_timesteps: 100\nn_envs: 1\nseed: 3\n")
    return {"trace": tmp / "t.json", "plan": tmp / "p.json", "hardware": tmp / "h.yaml", "config": tmp / "c.yaml"}


LOADERS = {
    "trace": (load_trace, TraceError),
    "plan": (lambda p: load_plan(p, _trace()), PlanError),
    "hardware": (load_hardware, HardwareError),
    "config": (load_train_config, UserError),
}


def _load_or_own_error(kind: str, path: Path) -> None:
    load, error = LOADERS[kind]
    try:
        load(path)
    except error as exc:
        assert str(path) in str(exc) or path.name in str(exc), f"{kind}: message does not name the file: {exc}"
        assert "\n" not in str(exc).strip(), f"{kind}: more than one line: {exc}"


@FUZZ
@given(kind=st.sampled_from(sorted(LOADERS)), data=st.binary(max_size=300), gz=st.booleans())
def test_random_bytes(tmp_path, kind, data, gz):
    path = tmp_path / f"random.{'yaml' if kind in ('hardware', 'config') else 'json'}"
    path.write_bytes(gzip.compress(data) if gz else data)
    _load_or_own_error(kind, path)


@FUZZ
@given(kind=st.sampled_from(sorted(LOADERS)), cut=st.floats(0.0, 1.0, exclude_max=True), gz=st.booleans())
def test_valid_files_truncated_anywhere(tmp_path, kind, cut, gz):
    src = _valid_files(tmp_path)[kind]
    raw = src.read_bytes()
    if gz:
        raw = gzip.compress(raw)
    path = tmp_path / ("cut-" + src.name)
    path.write_bytes(raw[: int(cut * len(raw))])
    _load_or_own_error(kind, path)


def _paths(x: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside a JSON/YAML tree."""
    out = [prefix] if prefix else []
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, (*prefix, i))
    return out


def _set(x: Any, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        x = x[k]
    x[path[-1]] = value


@FUZZ
@given(kind=st.sampled_from(["trace", "plan"]), pick=st.integers(0, 10**6), value=st.sampled_from(ODD_VALUES),
       gz=st.booleans())
def test_json_files_with_one_field_mutated(tmp_path, kind, pick, value, gz):
    src = _valid_files(tmp_path)[kind]
    data = json.loads(src.read_text())
    paths = _paths(data)
    _set(data, paths[pick % len(paths)], value)
    raw = json.dumps(data).encode()  # NaN and Infinity written as the tokens Python's json reads back
    path = tmp_path / ("mutated-" + src.name + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(raw) if gz else raw)
    _load_or_own_error(kind, path)


@FUZZ
@given(kind=st.sampled_from(["trace", "plan"]), pick=st.integers(0, 10**6), gz=st.booleans())
def test_json_files_with_a_field_removed_or_events_reordered(tmp_path, kind, pick, gz):
    src = _valid_files(tmp_path)[kind]
    data = json.loads(src.read_text())
    if kind == "trace" and pick % 2:
        rng = np.random.default_rng(pick)
        data["events"] = [data["events"][i] for i in rng.permutation(len(data["events"]))]
    else:
        paths = [p for p in _paths(data) if isinstance(p[-1], str)]
        victim = paths[pick % len(paths)]
        parent = data
        for k in victim[:-1]:
            parent = parent[k]
        del parent[victim[-1]]
    raw = json.dumps(data).encode()
    path = tmp_path / ("cut-field-" + src.name)
    path.write_bytes(gzip.compress(raw) if gz else raw)
    _load_or_own_error(kind, path)


@FUZZ
@given(kind=st.sampled_from(["hardware", "config"]), line=st.integers(0, 100), value=st.sampled_from(
    ["", "-1", "0", ".nan", ".inf", "-.inf", "x", "[1, 2]", "{a: 1}", "1e400", "null", "true", "99999999999999999999"]))
def test_yaml_files_with_one_value_mutated(tmp_path, kind, line, value):
    src = _valid_files(tmp_path)[kind]
    lines = src.read_text().splitlines()
    i = line % len(lines)
    key = lines[i].split(":")[0]
    lines[i] = f"{key}: {value}"
    path = tmp_path / ("mutated-" + src.name)
    path.write_text("\n".join(lines) + "\n")
    _load_or_own_error(kind, path)


@pytest.mark.parametrize("cls", [MovePrior, PlanEditor])
def test_learned_artifacts_that_are_not_what_they_claim(tmp_path, cls):
    """Not an npz, a truncated npz, and an npz of other arrays: one line naming the file."""
    bad = tmp_path / "x.npz"
    for raw in (b"not a zip", b"PK\x03\x04" + b"\0" * 20):
        bad.write_bytes(raw)
        with pytest.raises(UserError, match="x.npz"):
            cls.load(bad)
    np.savez(bad, something=np.zeros(3))
    with pytest.raises(UserError, match="x.npz"):
        cls.load(bad)
