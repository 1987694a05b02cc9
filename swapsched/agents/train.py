"""Train a swap policy with MaskablePPO on SwapEnv, and evaluate it on held-out traces.

``swapsched train-policy --config configs/train/default.yaml --out checkpoints/NAME.zip`` writes
the checkpoint and ``NAME.json`` beside it: the configuration, the traces it trained on, and its
held-out results against the baselines, measured on the simulator at the end of training.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from swapsched.errors import UserError
from swapsched.hardware import TRAINING_HARDWARE

__all__ = ["TrainConfig", "load_train_config", "train_policy", "evaluate"]


class TrainConfigError(UserError):
    """A training configuration is missing or malformed."""


@dataclass(frozen=True)
class TrainConfig:
    total_timesteps: int = 1_500_000
    n_envs: int = 4
    seed: int = 0
    corpus_split: str = "train"
    budget_range: tuple[float, float] = (0.25, 0.9)
    hardware: tuple[str, ...] = TRAINING_HARDWARE
    eval: dict[str, Any] = field(default_factory=lambda: {"budgets": ["30%", "50%", "70%"], "hardware": ["h100-pcie5"],
                                                          "baselines": ["swap-all", "min", "capuchin"]})
    ppo: dict[str, Any] = field(default_factory=dict)


def load_train_config(path: str | Path) -> TrainConfig:
    p = Path(path)
    if not p.is_file():
        raise TrainConfigError(f"{p}: no such file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise TrainConfigError(f"{p}: not valid YAML ({exc})") from None
    known = set(TrainConfig.__dataclass_fields__)
    unknown = set(data) - known
    if unknown:
        raise TrainConfigError(f"{p}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    if "budget_range" in data:
        data["budget_range"] = tuple(float(x) for x in data["budget_range"])
    if "hardware" in data:
        data["hardware"] = tuple(data["hardware"])
    for k in ("total_timesteps", "n_envs"):
        if k in data and (not isinstance(data[k], int) or data[k] <= 0):
            raise TrainConfigError(f"{p}: field {k}: expected a positive integer, got {data[k]!r}")
    return TrainConfig(**data)


class _ProgressBar:
    """SB3 callback drawing a tqdm bar over timesteps (SB3's own bar needs rich)."""

    def __new__(cls, total: int, enabled: bool):  # built lazily: SB3 imports are heavy
        from stable_baselines3.common.callbacks import BaseCallback
        from tqdm import tqdm

        class Bar(BaseCallback):
            def _on_training_start(self) -> None:
                self.bar = tqdm(total=total, unit="step", disable=not enabled, dynamic_ncols=True, desc="training")

            def _on_step(self) -> bool:
                self.bar.update(self.training_env.num_envs)
                return True

            def _on_training_end(self) -> None:
                self.bar.close()

        return Bar()


def train_policy(config: TrainConfig, out: str | Path, *, progress: bool = True, timesteps: int | None = None) -> Path:
    """Train, save ``out`` (.zip) and ``out`` with .json (config, traces, held-out evaluation)."""
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.vec_env import DummyVecEnv

    from swapsched.env.corpus import load_corpus
    from swapsched.env.swap_env import SwapEnv
    from swapsched.hardware import load_hardware

    torch.set_num_threads(1)  # the MLP is small: one thread is fastest and leaves the other core free
    out = Path(out)
    if out.suffix != ".zip":
        out = out.with_suffix(".zip")
    traces = load_corpus(split=config.corpus_split)
    hws = [load_hardware(h) for h in config.hardware]

    def make(i: int):
        return lambda: SwapEnv(traces=traces, hardware=hws, budget_range=config.budget_range)

    venv = DummyVecEnv([make(i) for i in range(config.n_envs)])
    venv.seed(config.seed)
    ppo = dict(config.ppo)
    net_arch = ppo.pop("net_arch", [128, 128])
    model = MaskablePPO("MlpPolicy", venv, seed=config.seed, device="cpu", verbose=0,
                        policy_kwargs={"net_arch": list(net_arch)}, **ppo)
    total = timesteps or config.total_timesteps
    t0 = time.perf_counter()
    model.learn(total_timesteps=total, callback=_ProgressBar(total, progress))
    train_s = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(str(out))

    from swapsched.agents.learned import LearnedPolicy

    held_out = load_corpus(split="test")
    ev = config.eval
    results = evaluate(LearnedPolicy(out), held_out, ev["budgets"], [load_hardware(h) for h in ev["hardware"]],
                       ev.get("baselines", []))
    meta = {
        "checkpoint": out.name,
        "algorithm": "MaskablePPO (sb3-contrib)",
        "timesteps": total,
        "train_seconds": round(train_s, 1),
        "config": asdict(config),
        "trained_on": [t.name for t in traces],
        "held_out": results,
    }
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


def evaluate(policy: Any, traces: list, budgets: list[str], hardware: list, baselines: list[str]) -> dict[str, Any]:
    """Mean overhead and OOMs of ``policy`` and each baseline over traces x budgets x hardware."""
    from swapsched.agents.evaluate import compare, summarize

    names = [policy.name, *baselines]
    rows = compare(traces, budgets, hardware, [policy, *baselines], progress=False)
    summary = summarize(rows, names)
    return {
        "traces": [t.name for t in traces], "budgets": budgets, "hardware": [h.name for h in hardware],
        "summary": [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in s.to_dict().items()}
                    for s in summary],
    }
