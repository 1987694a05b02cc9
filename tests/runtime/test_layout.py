"""runtime/layout.py: a plan laid out per event for the hooks, with its simulated step time, on
the hand-made family of ``tests/runtime/test_plans.py`` (``fam``)."""

from __future__ import annotations

import pytest

from swapsched.plan import SwapPlan
from swapsched.runtime.layout import lay_out
from swapsched.runtime.shapes import structure
from tests.conftest import make_hw
from tests.runtime.test_plans import SIGHT, evict_t0, fam


def test_a_layout_puts_the_plan_on_its_events_with_the_simulated_time():
    t = fam(100)
    lay = lay_out(t, evict_t0(t), make_hw(), 210, first_sight=SIGHT)
    assert lay.out_at == [(0,), (), (), ()] and lay.prefetch_at == [(), (0,), (), ()]
    assert lay.expected_codes == [0, 1, ~1, ~0]
    # work after e0 (a swap-out), e1 (a prefetch), e2 (T1's last use frees it), e3 (T0's)
    assert lay.work_at == [True, True, True, True]
    assert lay.predicted_s == pytest.approx(5.0) and lay.budget_bytes == 210
    assert lay.shape_key == 100 and lay.family == structure(t) and lay.plan_source == "searched"


def test_a_layout_of_a_plan_that_cannot_fit_predicts_no_time():
    t = fam(100)
    assert lay_out(t, evict_t0(t), make_hw(), 150, first_sight=SIGHT).predicted_s is None  # below T1's 200 B
    keep = lay_out(t, SwapPlan.of(t, "keep", []), make_hw(), 300, first_sight={})
    assert keep.work_at == [False, False, True, True]  # only the frees
