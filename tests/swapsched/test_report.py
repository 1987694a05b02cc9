"""report.py: the ratio table that train-policy prints under its held-out summary."""

from __future__ import annotations

import math

from swapsched.agents.evaluate import StepRatio
from swapsched.report import format_ratios


def test_ratios_table_names_the_reference_the_worst_case_and_the_ooms():
    rows = [StepRatio("default-greedy", "default", 1.0387, 2.1820, ("unet", "30%", "a100-pcie4"), 96, 0),
            StepRatio("default-greedy", "best of min, capuchin, checkpoint-all", 0.944, 1.049, ("bert", "50%", "h100-pcie5"), 95, 1),
            StepRatio("x", "best of min, capuchin", math.nan, math.nan, None, 0, 3)]
    lines = format_ratios(rows).splitlines()
    assert lines[0].split() == ["policy", "over", "step", "(geomean)", "worst", "cases", "OOM", "where", "it", "fits"]
    assert lines[2].split() == ["default-greedy", "default", "1.039x", "2.182x", "(unet", "30%", "a100-pcie4)", "96", "0"]
    assert lines[3].split()[:3] == ["default-greedy", "best", "baseline"] and lines[3].split()[-2:] == ["95", "1"]
    # two references are named; nothing compared shows dashes
    assert lines[4].split() == ["x", "best", "of", "min,", "capuchin", "-", "-", "0", "3"]
