"""A trained checkpoint as a policy: ``LearnedPolicy("default").plan(trace, budget, hardware)``.

The frozen MaskablePPO policy is rolled out deterministically in :class:`~swapsched.env.SwapEnv`
on the given trace, budget and hardware; its decisions are the plan. A checkpoint is
``checkpoints/NAME.zip`` with ``NAME.json`` beside it (what it was trained on, its held-out results).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swapsched._paths import checkpoint_dir
from swapsched.errors import UserError
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.trace import Trace

__all__ = ["LearnedPolicy", "CheckpointError", "resolve_checkpoint"]


class CheckpointError(UserError):
    """A checkpoint is missing or unreadable."""


def resolve_checkpoint(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".zip" or p.is_file():
        if not p.is_file():
            raise CheckpointError(f"checkpoint {p} not found")
        return p
    cand = checkpoint_dir() / f"{name_or_path}.zip"
    if not cand.is_file():
        known = sorted(q.stem for q in checkpoint_dir().glob("*.zip"))
        raise CheckpointError(
            f"no pretrained policy {str(name_or_path)!r}; shipped: {', '.join(known) or 'none'} "
            "(train one with: swapsched train-policy)"
        )
    return cand


@dataclass
class LearnedPolicy:
    """Plans with a trained MaskablePPO checkpoint (loaded once, on first use)."""

    checkpoint: str | Path = "default"
    name: str = "learned"
    _model: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.path = resolve_checkpoint(self.checkpoint)
        if self.name == "learned":
            self.name = "default" if self.path.stem == "default" else f"learned:{self.path.stem}"

    def _load(self) -> Any:
        if self._model is None:
            from sb3_contrib import MaskablePPO

            try:
                self._model = MaskablePPO.load(str(self.path), device="cpu")
            except Exception as exc:  # zip/pickle errors of many kinds: say which file
                raise CheckpointError(f"cannot load checkpoint {self.path}: {exc}") from None
        return self._model

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        from swapsched.env.swap_env import SwapEnv

        model = self._load()
        env = SwapEnv(traces=[trace], hardware=[hardware])
        obs, _ = env.reset(options={"trace": 0, "budget_bytes": budget, "hardware": 0})
        done = False
        while not done:
            action, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=True)
            obs, _, terminated, truncated, _ = env.step(int(action))
            done = terminated or truncated
        return SwapPlan.of(trace, self.name, env.evictions, checkpoint=str(self.path))
