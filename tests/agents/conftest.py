"""Hand traces the agents' tests share."""

from __future__ import annotations

import pytest

from tests.conftest import make_trace

# three blocks, each an anchor (10 B) and two members: a cheap one (pointwise op) and a saved one (mm)
#   block 0: 100 B relu + 200 B mm, forward gaps 1+1+2 = 4 s -> MSPS 300/4 = 75; cheap 100/1 = 100
#   block 1: 400 B gelu + 100 B mm, gaps 1+1+1 = 3 s        -> MSPS 500/3 = 167; cheap 400/1 = 400
#   block 2: 500 B add + 50 B mm, gaps 1+1+8 = 10 s         -> MSPS 550/10 = 55; cheap 500/1 = 500
SIZES = [10, 100, 200, 10, 400, 100, 10, 500, 50]
OPS = ["", "relu", "mm", "", "gelu", "mm", "", "add", "mm"]
MODULES = [f"blocks.{i // 3}.{'abc'[i % 3]}" for i in range(9)]
GAPS = [1, 1, 2, 1, 1, 1, 1, 1, 8]


@pytest.fixture
def blocks3():
    events = [("pack", k, float(GAPS[k])) for k in range(9)] + [("unpack", k, 1.0) for k in reversed(range(9))]
    return make_trace(SIZES, events, ops=OPS, modules=MODULES)
