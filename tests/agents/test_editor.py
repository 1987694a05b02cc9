"""agents/editor.py: the edits on a hand-made plan, the labels a search's result gives, and a
network that learns a separable rule."""

from __future__ import annotations

import numpy as np
import pytest

from swapsched.agents.editor import EDITS, N_FEATURES, PlanEditor, apply_edits, edit_labels, features, fit
from swapsched.env.simulator import simulate
from swapsched.errors import UserError
from swapsched.plan import Eviction, SwapPlan
from tests.conftest import make_hw, make_trace

# three tensors packed at events 0-2 and unpacked in reverse at events 3-5
TRACE = make_trace([100, 100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("pack", 2, 1.0),
                                     ("unpack", 2, 1.0), ("unpack", 1, 1.0), ("unpack", 0, 1.0)])
PLAN = SwapPlan.of(TRACE, "hand", [Eviction(0, 0, 4), Eviction(1, 1, 3)])


def test_apply_edits_keeps_drops_and_moves_prefetches_within_r7():
    assert [c for c, (kind, _) in enumerate(EDITS)] == [0, 1, 2, 3] and EDITS[1] == ("drop", 0)
    out = apply_edits(TRACE, PLAN, [0, 1], "e")
    assert out.evictions == (Eviction(0, 0, 4),)
    out = apply_edits(TRACE, PLAN, [2, 3], "e")  # 2 earlier: 4 -> 2; 8 earlier: clamped to the swap-out
    assert out.evictions == (Eviction(0, 0, 2), Eviction(1, 1, 1))
    out.validate(TRACE)


def test_labels_say_what_the_search_did_to_each_eviction():
    improved = SwapPlan.of(TRACE, "s", [Eviction(0, 0, 1)])  # tensor 0's prefetch 3 earlier, tensor 1 dropped
    assert edit_labels(PLAN, improved) == [2, 1]
    assert edit_labels(PLAN, SwapPlan.of(TRACE, "s", [Eviction(0, 0, 4), Eviction(1, 1, 3)])) == [0, 0]


def test_features_one_finite_row_per_eviction():
    hw = make_hw()
    res = simulate(TRACE, PLAN, hw, 200, record=True)
    ids, x = features(TRACE, 200, hw, PLAN, res)
    assert ids == [0, 1] and x.shape == (2, N_FEATURES) and np.isfinite(x).all()


def test_fit_learns_a_separable_rule_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, N_FEATURES))
    y = np.where(x[:, 8] < -0.3, 1, 0)  # drop when the demand while away is under budget
    ed = fit(x, y, steps=400)
    assert (np.argmax(ed.logits(x), axis=1) == y).mean() > 0.95
    p = ed.save(tmp_path / "e.editor.npz")
    back = PlanEditor.load(p)
    assert np.allclose(back.logits(x), ed.logits(x))
    bad = tmp_path / "bad.npz"
    np.savez(bad, *ed.weights, mean=ed.mean, std=ed.std, version=np.array(99))
    with pytest.raises(UserError, match="feature version 99"):
        PlanEditor.load(bad)
