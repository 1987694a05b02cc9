"""compiled/step_budget.py: the step's budget over its graphs, computed by hand (R10)."""

from __future__ import annotations

import pytest

from swapsched.budget import BudgetError
from swapsched.compiled.step_budget import (
    activation_budget,
    graph_memory,
    held_after_forward,
    nested_min,
    smallest_step,
    step_peak,
    with_nested,
)
from swapsched.plan import Eviction, SwapPlan
from tests.conftest import make_trace


def first() -> object:
    """Graph A: T0 (100 B) and T1 (200 B) packed, unpacked in reverse; 50 B of static bytes.
    No-swap: 300 B peak, 300 B held after its forward."""
    return make_trace([100, 200], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)],
                      static=50, name="a")


def tail() -> object:
    """Graph B, the loss: one 80 B tensor, and 40 B held (unoffloadable) through its gaps."""
    return make_trace([80], [("pack", 0, 1.0), ("unpack", 0, 1.0)], other=[40, 40], name="b")


def test_memory_of_a_graph_with_and_without_a_plan():
    a = first()
    g = graph_memory(a)
    assert (g.static, g.peak, g.held, g.peak_no_swap, g.held_no_swap) == (50, 300, 300, 300, 300)
    # T1 evicted: 100 B kept after the forward
    plan = SwapPlan.of(a, "hand", [Eviction(1, 1, 2)])
    assert held_after_forward(a, {1}) == 100
    assert graph_memory(a, plan, planned_peak=350).held == 100 and graph_memory(a, plan, planned_peak=350).peak == 300
    b = tail()
    assert held_after_forward(b) == 80 + 40 and held_after_forward(b, {0}) == 40


def test_the_step_peak_counts_earlier_runs_held_bytes():
    graphs = {0: graph_memory(first()), 1: graph_memory(tail())}
    # B runs while A holds 300 B: 300 + B's 120 B
    assert step_peak([0, 1], graphs) == 420
    assert step_peak([1, 0], graphs) == max(120, 120 + 300)
    # a graph run twice before the backward holds twice (per-block compile of identical blocks)
    assert step_peak([0, 0, 1], graphs) == 300 + 300 + 120


def test_relative_and_byte_budgets_of_the_step():
    graphs = {0: graph_memory(first()), 1: graph_memory(tail())}
    assert activation_budget("50%", [0, 1], graphs) == 210  # half of 420
    assert activation_budget("50%", [0], graphs) == 150  # before the tail is known: half of A's own 300
    assert activation_budget(1000, [0, 1], graphs) == 1000 - 50  # less the statics, once per graph
    assert activation_budget(1000, [0, 0, 1], graphs) == 950


def test_what_runs_later_is_nested_in_the_first_backward_gap():
    a = first()
    n = with_nested(a, 120)
    assert list(n.other_bytes) == [0, 0, 120, 0] and n.segments == a.segments
    # A alone needs 200 B: T1 from its first pack on (produced, then needed at e2), while T0 can be
    # away from its release (e0) to its unpack (e3); with 120 B nested at e2, 320 B
    assert nested_min(a, 0) == 200 and nested_min(a, 120) == 320
    assert with_nested(a, 0) is a


def test_smallest_step_walks_back_from_the_last_run():
    a, b = first(), tail()
    least, worst = smallest_step([0, 1], {0: a, 1: b})
    # B needs 120 B (its tensor is needed at its only unpack, beside 40 B held); A with that
    # nested at its first unpack needs 200 + 120; statics once. A needs most of its own (200 B)
    assert least == 50 + 320 and worst == 0


def test_a_byte_budget_below_one_byte_is_refused():
    with pytest.raises(BudgetError):
        activation_budget("0.1B", [0], {0: graph_memory(first())})
