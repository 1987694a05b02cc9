"""A learned proposal for the local search: which kinds of move to try, from what helped before.

The local search (``agents/local_search.py``) spends its planning time simulating moves, and most
moves do not help: on the corpus's training traces about 3 in 1,000. Which ones help is learnable
from the search itself (the signal "did this move make this plan faster", where the step time alone
is sparse; the idea behind learned search guidance and Ranked Reward). The prior is the improvement
rate of each move class (``local_search.MOVE_CLASSES``: kind, shift in events, aimed at a stalled
tensor or not), estimated from unguided searches on training traces with Laplace smoothing toward
the overall rate, and the search then draws classes in proportion to it (mixed with the uniform
proposal, so no class is ever excluded).

A first version was a network rating each candidate move from 18 features and simulating the best
of 8; at equal planning time it matched the unguided search (0.999 of its step time on the
validation family) because computing the features cost half of the evaluations. The class prior
costs nothing per move.

Saved beside a policy checkpoint as ``NAME.moves.npz`` (the classes and their weights).
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from swapsched._paths import atomic_path
from swapsched.agents.local_search import MOVE_CLASSES, UNIFORM, improve_best_heuristic
from swapsched.agents.scoring import training_cases
from swapsched.errors import UserError
from swapsched.hardware import Hardware
from swapsched.trace import Trace

__all__ = ["MovePrior", "collect", "fit", "prior_path"]


def prior_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.stem + ".moves.npz")


@dataclass(frozen=True)
class MovePrior:
    """Weights over ``MOVE_CLASSES`` (they sum to 1), with the counts they were estimated from."""

    weights: np.ndarray
    tried: np.ndarray
    improved: np.ndarray

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        with atomic_path(p) as tmp:
            np.savez(tmp, weights=self.weights, tried=self.tried, improved=self.improved,
                     classes=np.array([f"{k}:{d}:{int(a)}" for k, d, a in MOVE_CLASSES]))
        return p

    @classmethod
    def load(cls, path: str | Path) -> MovePrior:
        try:
            with np.load(path) as z:
                classes = [str(c) for c in z["classes"]]
                prior = cls(z["weights"], z["tried"], z["improved"])
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # not an npz, cut short, other arrays
            raise UserError(f"cannot load move prior {path}: {exc}") from None
        if classes != [f"{k}:{d}:{int(a)}" for k, d, a in MOVE_CLASSES]:
            raise UserError(f"move prior {path} was learned for other move classes; retrain it with: swapsched train-policy")
        return prior


def collect(traces: Sequence[Trace], hardware: Sequence[Hardware], *, cases_per_trace: int = 6,
            seconds: float = 0.5, budget_range: tuple[float, float] = (0.3, 0.95), seed: int = 0,
            progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per move class: moves simulated and moves that improved, over unguided searches from the
    best heuristic's plan on random budgets (fractions of the activation range) and hardware."""
    rng = np.random.default_rng(seed)
    tried = np.zeros(len(MOVE_CLASSES))
    improved = np.zeros(len(MOVE_CLASSES))
    for tr, hw, budget in training_cases(traces, hardware, rng, cases_per_trace=cases_per_trace, budget_range=budget_range,
                                         progress=progress, desc="search data"):
        log: list = []
        improve_best_heuristic(tr, budget, hw, seconds=seconds, seed=int(rng.integers(0, 2**31)), log=log)
        for c, better in log:
            tried[c] += 1
            improved[c] += better
    return tried, improved


def fit(tried: np.ndarray, improved: np.ndarray, *, smoothing: float = 20.0, mix: float = 0.2) -> MovePrior:
    """Weights proportional to each class's smoothed improvement rate, mixed with ``UNIFORM``."""
    if tried.sum() == 0 or improved.sum() == 0:
        raise UserError("the search data has no improving move; collect on more or harder cases")
    base = improved.sum() / tried.sum()
    rate = (improved + smoothing * base) / (tried + smoothing)
    w = (1 - mix) * rate / rate.sum() + mix * UNIFORM
    return MovePrior(w / w.sum(), tried, improved)
