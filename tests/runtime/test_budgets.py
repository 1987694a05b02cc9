"""runtime/budgets.py: the run's budget in bytes per shape, on the hand-made family of
``tests/runtime/test_plans.py`` (``fam(s)``: activation peak 3s, smallest feasible budget 2s)."""

from __future__ import annotations

import pytest

from swapsched.budget import BudgetError
from swapsched.runtime.budgets import DEVICE_MARGIN, ShapeBudgets
from tests.conftest import make_trace
from tests.runtime.test_plans import fam


def test_a_relative_budget_is_resolved_per_shape_and_a_byte_budget_is_the_same_for_all():
    rel = ShapeBudgets("70%")
    assert rel.of(fam(100)) == 210 and rel.of(fam(300)) == 630
    assert rel.take(fam(200)) == 420 and rel.bytes == 420
    abs_ = ShapeBudgets(450)
    assert abs_.take(fam(100)) == 450 and abs_.of(fam(200)) == 450
    with pytest.raises(BudgetError, match="stands for 450 B for every shape"):
        abs_.of(fam(300))  # needs 600 B
    assert abs_.or_zero(fam(300)) == 0


def test_a_relative_budget_below_a_shapes_smallest_feasible_one_runs_there_within_the_runs_bytes():
    budgets = ShapeBudgets("50%")  # 1.5 s: below every size's smallest feasible 2 s
    with pytest.raises(BudgetError, match="smallest feasible budget, 200 B"):
        budgets.take(fam(100))
    # a later shape whose transients weigh more: 70% of its 400 B peak is 280 B, below its 300 B tensor
    skew = make_trace([100, 300], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)])
    held = ShapeBudgets("70%")
    held.take(fam(300))  # the run holds 630 B already: the shape runs at its own smallest feasible 300 B
    assert held.of(skew) == 300
    with pytest.raises(BudgetError, match="smallest feasible budget, 300 B"):
        ShapeBudgets("70%").take(skew)  # as the first shape, nothing is held yet: refused


def test_another_budget_resolves_every_shape_anew_and_a_device_budget_leaves_a_margin():
    budgets = ShapeBudgets("70%")
    budgets.take(fam(100))
    budgets.respecify("90%", fam(100))
    assert budgets.bytes == 270 and budgets.spec == "90%"
    with pytest.raises(BudgetError, match="not understood"):
        budgets.respecify("lots", fam(100))
    dev = ShapeBudgets("device")
    assert dev.device
    dev.resolve_device(1000, 100, static_bytes=0)
    assert not dev.device and dev.spec == int(1000 * (1 - DEVICE_MARGIN)) - 100
    with pytest.raises(BudgetError, match="leave nothing beyond the model"):
        ShapeBudgets("device").resolve_device(1000, 100, static_bytes=900)
