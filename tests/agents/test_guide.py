"""agents/guide.py: the move prior favours the classes that improved, and the search draws from it."""

from __future__ import annotations

import numpy as np
import pytest

from swapsched.agents.guide import MovePrior, fit
from swapsched.agents.local_search import MOVE_CLASSES, UNIFORM, improve
from swapsched.env.corpus import load_corpus
from swapsched.errors import UserError
from swapsched.hardware import load_hardware


def test_fit_weights_improving_classes_up_and_never_excludes_one():
    tried = np.full(len(MOVE_CLASSES), 1000.0)
    improved = np.zeros(len(MOVE_CLASSES))
    drop = MOVE_CLASSES.index(("drop", 0, False))
    improved[drop] = 50
    prior = fit(tried, improved)
    assert prior.weights.sum() == pytest.approx(1.0)
    assert prior.weights[drop] == prior.weights.max() and prior.weights[drop] > 0.5
    assert (prior.weights >= 0.2 * UNIFORM - 1e-12).all()  # the uniform share keeps every class alive
    with pytest.raises(UserError, match="no improving move"):
        fit(tried, np.zeros(len(MOVE_CLASSES)))


def test_the_search_draws_classes_by_the_prior(tmp_path):
    w = np.zeros(len(MOVE_CLASSES))
    w[MOVE_CLASSES.index(("drop", 0, False))] = 1.0
    prior = MovePrior(w, np.ones_like(w), np.zeros_like(w))
    back = MovePrior.load(prior.save(tmp_path / "p.moves.npz"))
    tr = load_corpus(names=["resnet-tiny-cpu"])[0]
    hw = load_hardware("h100-pcie5")
    from swapsched.agents.heuristics import SwapAll

    budget = tr.peak_bytes_no_swap
    log: list = []
    improve(tr, budget, hw, SwapAll().plan(tr, budget, hw), seconds=1e9, max_evals=20, prior=back, log=log)
    assert log and {c for c, _ in log} == {MOVE_CLASSES.index(("drop", 0, False))}
    assert any(better for _, better in log)  # at the full budget, dropping swap-all's evictions helps


def test_an_unguided_default_searches_with_uniform_moves():
    """``guided=False`` (scripts/bench_prior.py's reference): the same planner without the prior."""
    from swapsched.agents.learned import LearnedPolicy

    guided, unguided = LearnedPolicy("default", mode="search"), LearnedPolicy("default", mode="search", guided=False)
    assert unguided.name == "default-unguided" and unguided._move_prior() is None
    assert isinstance(guided._move_prior(), MovePrior)
    tr = load_corpus(names=["resnet-tiny-cpu"])[0]
    hw = load_hardware("h100-pcie5")
    LearnedPolicy("default", mode="search", guided=False, search_seconds=0.2).plan(tr, tr.peak_bytes_no_swap // 2, hw).validate(tr)
