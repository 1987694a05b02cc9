"""Shared by the bench_*.py scripts: write the JSON, print the table."""

from __future__ import annotations

import math
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from swapsched.jsonfile import write_json
from swapsched.report import format_grid


def environment() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write(out: str | Path, data: dict[str, Any]) -> Path:
    p = write_json({"environment": environment(), **data}, out, indent=1)
    print(f"wrote {p}", file=sys.stderr)
    return p


def geomean(xs: Sequence[float]) -> float:
    """The geometric mean of positive ``xs`` (NaN for none)."""
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    return format_grid(head, [[str(c) for c in r] for r in rows])
