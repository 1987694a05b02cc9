"""jsonfile.py: strict JSON written, gzip by name, unreadable files named in the error."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from swapsched.jsonfile import open_json, write_json


def test_write_json_is_strict_and_plain(tmp_path):
    p = write_json({"a": math.nan, "b": [np.float64(1.5), np.int64(2), math.inf], "c": np.arange(2)}, tmp_path / "x.json",
                   indent=1)
    assert json.loads(p.read_text()) == {"a": None, "b": [1.5, 2, None], "c": [0, 1]}


def test_a_gz_name_is_written_gzip_and_read_back(tmp_path):
    p = write_json({"k": [1, 2]}, tmp_path / "x.json.gz")
    assert p.read_bytes()[:2] == b"\x1f\x8b" and open_json(p, ValueError) == {"k": [1, 2]}


def test_unreadable_files_raise_the_given_error_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        open_json(tmp_path / "missing.json", ValueError)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON"):
        open_json(bad, ValueError)
