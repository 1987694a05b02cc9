"""scripts/soak.py: 2,000 steps under the runtime stay flat (slow: about a minute)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_thousand_steps_stay_flat(tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--steps", "2000", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    res = json.loads(out.read_text())
    assert r.returncode == 0 and res["flat"], r.stdout[-2000:]
    assert res["n_problems"] == 0 and all(row["accounted_bytes"] == 0 for row in res["rows"])
    assert len({row["pool_bytes"] for row in res["rows"]}) == 1 and len({row["threads"] for row in res["rows"]}) == 1
