"""swapsched/budget.py: bytes, percentages, and clear errors."""

from __future__ import annotations

import pytest

from swapsched.budget import BudgetError, format_bytes, parse_budget
from tests.conftest import make_trace


@pytest.fixture
def trace():
    # static 1000, no-swap peak 1000 + 200; smallest feasible 1000 + 100
    return make_trace([100, 100], [("pack", 0, 1), ("pack", 1, 1), ("unpack", 1, 1), ("unpack", 0, 1)], static=1000)


def test_absolute():
    assert parse_budget("6GiB") == 6 * 2**30
    assert parse_budget("6e9") == 6_000_000_000
    assert parse_budget("1.5 MB") == 1_500_000
    assert parse_budget(4096) == 4096


def test_percent_of_activation_peak(trace):
    assert parse_budget("100%", trace) == 1200
    assert parse_budget("50%", trace) == 1100
    assert parse_budget("75%", trace) == 1150


def test_a_percentage_that_does_not_divide_evenly_rounds_down(trace):
    # 77.7% of the 200 B above static is 155.4 B: the budget is 1155, never more than asked for
    assert parse_budget("77.7%", trace) == 1155
    assert parse_budget("50.9%", trace) == 1101  # 101.8 B


@pytest.mark.parametrize("spec, message", [
    ("-1GiB", "must be a positive amount"), ("0", "must be a positive amount"),
    ("lots", "not understood"), ("150%", "over 100%"), ("5 parsecs", "unknown unit"),
])
def test_bad_budgets(trace, spec, message):
    with pytest.raises(BudgetError, match=message):
        parse_budget(spec, trace)


def test_infeasible_budget_states_the_smallest(trace):
    with pytest.raises(BudgetError, match=r"smallest feasible budget is .*1100 bytes, 50.0%"):
        parse_budget("40%", trace)


def test_percent_needs_a_trace():
    with pytest.raises(BudgetError, match="needs a trace"):
        parse_budget("50%")


def test_check_budget_rejects_malformed_and_absurd_budgets_without_a_trace():
    from swapsched.budget import check_budget

    assert check_budget("60%") == "60%" and check_budget("6GiB") == "6GiB"
    for bad, msg in (("abc", "not understood"), ("150%", "over 100%"), ("1e99GiB", "more bytes"), ("0.5B", "less than one byte"),
                     ("6XB", "unknown unit")):
        with pytest.raises(BudgetError, match=msg):
            check_budget(bad)
    assert format_bytes(3 * 2**50) == "3.00 PiB"


@pytest.mark.parametrize("spec, expected", [
    ("1", 1), ("1B", 1), ("1kb", 10**3), ("1MB", 10**6), ("1gb", 10**9), ("1TB", 10**12),
    ("1KiB", 2**10), ("1mib", 2**20), ("1GiB", 2**30), ("1TiB", 2**40), (float(2**63), 2**63),
])
def test_every_unit_is_its_own_size(spec, expected):
    assert parse_budget(spec) == expected


def test_the_edges_of_what_a_budget_may_be():
    for bad, msg in ((True, "bytes or a percentage"), ("100.5%", "over 100%"), (1.5 * 2**63, "more bytes"),
                     ("1e10GiB", "more bytes"), ("0.9B", "less than one byte")):
        with pytest.raises(BudgetError, match=msg):
            parse_budget(bad)


@pytest.mark.parametrize("n, text", [
    (1023, "1023 B"), (2**10, "1.00 KiB"), (2**20, "1.00 MiB"), (2**30, "1.00 GiB"), (2**40, "1.00 TiB"),
    (2**50, "1.00 PiB"), (3 * 2**29, "1.50 GiB"),
])
def test_format_bytes_at_each_unit(n, text):
    assert format_bytes(n) == text
