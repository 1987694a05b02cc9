"""The small tanh MLP the plan editor and the block chooser share: evaluated in numpy when a plan
is made (no torch on that path), trained with torch, saved as an ``.npz`` with its feature version."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from swapsched._paths import atomic_path
from swapsched.errors import UserError

__all__ = ["TanhMLP", "torch_mlp", "exported"]

_M = TypeVar("_M", bound="TanhMLP")


@dataclass(frozen=True)
class TanhMLP:
    """``n_in -> hidden -> hidden -> n_out`` (tanh), inputs standardized by ``mean`` and ``std``.
    A subclass says what it is (``KIND``, for errors), its feature version (``VERSION``: a saved
    network of another version is refused) and how to retrain one (``RETRAIN``)."""

    weights: tuple[np.ndarray, ...]
    mean: np.ndarray
    std: np.ndarray
    KIND: ClassVar[str] = "network"
    VERSION: ClassVar[int] = 1
    RETRAIN: ClassVar[str] = "swapsched train-policy"

    def logits(self, x: np.ndarray) -> np.ndarray:
        w1, b1, w2, b2, w3, b3 = self.weights
        h = np.tanh(((x - self.mean) / self.std) @ w1 + b1)
        h = np.tanh(h @ w2 + b2)
        return h @ w3 + b3

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        with atomic_path(p) as tmp:
            np.savez(tmp, *self.weights, mean=self.mean, std=self.std, version=np.array(self.VERSION))
        return p

    @classmethod
    def load(cls: type[_M], path: str | Path) -> _M:
        try:
            with np.load(path) as z:
                version = int(z["version"])
                weights = tuple(z[f"arr_{i}"] for i in range(6))
                mean, std = z["mean"], z["std"]
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # not an npz, cut short, other arrays
            raise UserError(f"cannot load {cls.KIND} {path}: {exc}") from None
        if version != cls.VERSION:
            raise UserError(f"{cls.KIND} {path} has feature version {version}, this swapsched {cls.VERSION}; "
                            f"retrain it with: {cls.RETRAIN}")
        return cls(weights, mean, std)


def torch_mlp(n_in: int, hidden: int, n_out: int) -> Any:
    """The torch twin of :class:`TanhMLP`'s shape, to train."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                               torch.nn.Tanh(), torch.nn.Linear(hidden, n_out))


def exported(net: Any) -> tuple[np.ndarray, ...]:
    """A trained :func:`torch_mlp`'s weights as :class:`TanhMLP` holds them (float64, inputs by rows)."""
    p = [q.detach().numpy().astype(np.float64) for q in net.parameters()]
    return (p[0].T, p[1], p[2].T, p[3], p[4].T, p[5])
