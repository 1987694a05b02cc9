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
    assert EDITS == (("keep", 0), ("drop", 0), ("earlier", 2), ("earlier", 8))
    out = apply_edits(TRACE, PLAN, [0, 1], "e")
    assert out.evictions == (Eviction(0, 0, 4),)
    out = apply_edits(TRACE, PLAN, [2, 3], "e")  # 2 earlier: 4 -> 2; 8 earlier: clamped to the swap-out
    assert out.evictions == (Eviction(0, 0, 2), Eviction(1, 1, 1))
    out.validate(TRACE)


def test_labels_say_what_the_search_did_to_each_eviction():
    improved = SwapPlan.of(TRACE, "s", [Eviction(0, 0, 1)])  # tensor 0's prefetch 3 earlier, tensor 1 dropped
    assert edit_labels(PLAN, improved) == [2, 1]
    assert edit_labels(PLAN, SwapPlan.of(TRACE, "s", [Eviction(0, 0, 4), Eviction(1, 1, 3)])) == [0, 0]


def test_features_mean_what_their_comments_say():
    """By hand, at 200 B on a 100 B/s link (a transfer of one tensor: 1 s; ideal step 6 s; events
    at t = 1..6; no swap holds 100, 200, 300, 300, 200, 100 B, so 200 B is exceeded by up to
    100 B while tensor 0 is away (events 1-4) and while tensor 1 is (events 2-3)):
    - size over the median: log2(1) / 10 = 0 for both;
    - prefetch lead in transfers: tensor 0 prefetched at e4, unpacked at e5 (1 s: log1p(1) / 3),
      tensor 1 at e3 for e4 (the same);
    - time away over the step: (6 - 1) / 6 and (5 - 2) / 6;
    - where its first unpack falls in the step: 5/6 and 4/6;
    - a transfer over the step: log10(1/6) / 9 + 1;
    - the most the budget is exceeded while away, over its bytes: 100/100, clipped to 4, over 4;
    - evictions over tensors: 2/3; the swap-out's place in its window: 0 (at the last pack)."""
    hw = make_hw()
    res = simulate(TRACE, PLAN, hw, 200, record=True)
    ids, x = features(TRACE, 200, hw, PLAN, res)
    assert ids == [0, 1] and x.shape == (2, N_FEATURES) and np.isfinite(x).all()
    cols = [0, 1, 2, 5, 6, 8, 11, 12]
    lead = np.log1p(1.0) / 3
    assert x[0, cols] == pytest.approx([0.0, lead, 5 / 6, 5 / 6, np.log10(1 / 6) / 9 + 1, 0.25, 2 / 3, 0.0])
    assert x[1, cols] == pytest.approx([0.0, lead, 3 / 6, 4 / 6, np.log10(1 / 6) / 9 + 1, 0.25, 2 / 3, 0.0])
    # an earlier prefetch is a longer lead; a stalled unpack says so (columns 3 and 4)
    early = SwapPlan.of(TRACE, "hand", [Eviction(0, 0, 2), Eviction(1, 1, 3)])
    _, x2 = features(TRACE, 200, hw, early, simulate(TRACE, early, hw, 200, record=True))
    assert x2[0, 1] == pytest.approx(np.log1p(3.0) / 3)
    stalled = {int(ev) for _, _, ev in res.timeline.stalls}
    assert [x[i, 3] for i in range(2)] == [1.0 if int(TRACE.first_unpack[k]) in stalled else 0.0 for k in ids]


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
