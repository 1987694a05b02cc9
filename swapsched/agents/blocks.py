"""A network that chooses each block's state (kept, recomputed whole, recomputed selectively, R9)
in one pass, learned from what the joint search chose.

Which blocks to recompute is what decides a step on a PCIe link below ~85% of the activation peak:
no swap plan there can beat R8's floor, and checkpointing costs about one extra forward. The block
chooser predicts, for every block of the trace at once, the state the joint search
(:func:`~swapsched.agents.joint.joint_search`) gave it, from features of the block, the budget and
the link that need no simulation (:func:`features`): how much of the overshoot the block's members
and cheap members cover, what rebuilding them costs against moving them over the link, how far the
no-swap demand is over budget while they are saved, and where the block sits in the step. Then it
is fine-tuned on the simulator by self-critical REINFORCE, as the plan editor is.

What the chosen blocks leave is swapped by MIN (:func:`~swapsched.agents.heuristics.min_around_blocks`)
and handed to the plan editor: ``default-greedy``'s joint plan, with no candidates and no search.
``default`` adds that plan to the candidates its search starts from. Saved beside a policy
checkpoint as ``NAME.blocks.npz``.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from swapsched._paths import atomic_path
from swapsched.agents.heuristics import min_around_blocks
from swapsched.agents.local_search import draw_case
from swapsched.env.simulator import simulate
from swapsched.errors import UserError
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.trace import Trace

__all__ = ["BlockChooser", "STATES", "features", "state_labels", "joint_plan", "collect", "fit", "finetune", "chooser_path"]

#: A block's states, by class index (R9).
STATES = ("kept", "whole", "selective")
N_FEATURES = 14
FEATURE_VERSION = 1


def chooser_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.stem + ".blocks.npz")


def features(trace: Trace, budget: int, hardware: Hardware) -> np.ndarray:
    """One row per block of ``trace.segments`` (in order); nothing simulated."""
    segs = trace.segments
    rows = np.zeros((len(segs), N_FEATURES))
    if not segs:
        return rows
    ideal = max(trace.ideal_s, 1e-12)
    demand = trace.static_bytes + trace.other_bytes + trace.resident_bytes_no_swap
    over = max(float(demand.max()) - budget, 1.0)
    peak, low = trace.peak_bytes_no_swap, trace.min_feasible_bytes
    budget_pos = (budget - low) / max(peak - low, 1)
    total = max(sum(s.bytes for s in segs), 1)
    cheap_total = sum(s.cheap_bytes for s in segs)
    link = np.log10(max(hardware.h2d_time(over) / ideal, 1e-9)) / 3.0
    release = trace.release
    for i, s in enumerate(segs):
        h = hardware.h2d_time(max(s.bytes, 1))
        hc = hardware.h2d_time(max(s.cheap_bytes, 1))
        lo = int(min(release[k] for k in s.members)) + 1
        window = demand[lo: s.at] if s.at > lo else demand[s.at: s.at + 1]
        rows[i] = (
            np.clip(np.log2(s.bytes / over), -10, 4) / 10.0,
            s.cheap_bytes / max(s.bytes, 1),
            s.forward_s / ideal,
            s.cheap_forward_s / max(s.forward_s, 1e-12),
            np.clip(np.log10(max(s.forward_s, 1e-12) / h), -3, 3) / 3.0,
            np.clip(np.log10(max(s.cheap_forward_s, 1e-12) / hc), -3, 3) / 3.0 if s.cheap else 1.0,
            budget_pos,
            link,
            s.at / trace.n_events,
            s.bytes / total,
            min(total / over, 4.0) / 4.0,
            min(cheap_total / over, 4.0) / 4.0,
            np.clip((float(window.max()) - budget) / over, -1, 1),
            1.0 if s.cheap else 0.0,
        )
    return rows


def state_labels(trace: Trace, plan: SwapPlan) -> list[int]:
    """Each block's state in ``plan``, as an index into ``STATES``."""
    whole, sel = set(plan.recomputed(trace)), set(plan.recomputed_selectively(trace))
    return [1 if s.index in whole else 2 if s.index in sel else 0 for s in trace.segments]


def joint_plan(trace: Trace, budget: int, hardware: Hardware, states: Sequence[int], name: str) -> SwapPlan:
    """The blocks in ``states`` recomputed as chosen, the rest swapped by MIN around them."""
    return min_around_blocks(trace, budget, hardware, recompute=[i for i, c in enumerate(states) if c == 1],
                             selective=[i for i, c in enumerate(states) if c == 2], name=name)


@dataclass(frozen=True)
class BlockChooser:
    """An MLP ``N_FEATURES -> hidden -> hidden -> len(STATES)`` (tanh), evaluated in numpy."""

    weights: tuple[np.ndarray, ...]
    mean: np.ndarray
    std: np.ndarray

    def logits(self, x: np.ndarray) -> np.ndarray:
        w1, b1, w2, b2, w3, b3 = self.weights
        h = np.tanh(((x - self.mean) / self.std) @ w1 + b1)
        h = np.tanh(h @ w2 + b2)
        return _masked(h @ w3 + b3, x)

    def states(self, trace: Trace, budget: int, hardware: Hardware) -> list[int]:
        """The most likely state of each block (selective only where the block has cheap members)."""
        x = features(trace, budget, hardware)
        return [int(c) for c in np.argmax(self.logits(x), axis=1)] if len(x) else []

    def plan(self, trace: Trace, budget: int, hardware: Hardware, name: str) -> SwapPlan:
        """The chosen blocks recomputed and MIN around them. Like the editor's memory account, one
        guard: where that plan runs out of memory and MIN alone does not, MIN alone."""
        states = self.states(trace, budget, hardware)
        plan = joint_plan(trace, budget, hardware, states, name)
        if any(states) and simulate(trace, plan, hardware, budget, validate=False).oom:
            alone = joint_plan(trace, budget, hardware, [], name)
            if not simulate(trace, alone, hardware, budget, validate=False).oom:
                return alone
        return plan

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        with atomic_path(p) as tmp:
            np.savez(tmp, *self.weights, mean=self.mean, std=self.std, version=np.array(FEATURE_VERSION))
        return p

    @classmethod
    def load(cls, path: str | Path) -> BlockChooser:
        try:
            with np.load(path) as z:
                version = int(z["version"])
                weights = tuple(z[f"arr_{i}"] for i in range(6))
                mean, std = z["mean"], z["std"]
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # not an npz, cut short, other arrays
            raise UserError(f"cannot load block chooser {path}: {exc}") from None
        if version != FEATURE_VERSION:
            raise UserError(f"block chooser {path} has feature version {version}, this swapsched {FEATURE_VERSION}; "
                            "retrain it with: swapsched train-policy --search-only")
        return cls(weights, mean, std)


def _masked(logits: Any, x: Any) -> Any:
    """``logits`` with the selective state ruled out for blocks with no cheap member (feature 13)."""
    no_cheap = x[:, 13] < 0.5
    logits[no_cheap, 2] = -1e9
    return logits


def collect(traces: Sequence[Trace], hardware: Sequence[Hardware], *, cases_per_trace: int = 8, seconds: float = 1.0,
            budget_range: tuple[float, float] = (0.25, 0.95), seed: int = 0, prior: Any = None,
            progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Features of every block and the state a joint search gave it, over random budgets and
    hardware (traces without blocks are skipped)."""
    from tqdm import tqdm

    from swapsched.agents.joint import joint_search

    rng = np.random.default_rng(seed)
    xs, ys = [], []
    jobs = [tr for tr in traces if tr.segments for _ in range(cases_per_trace)]
    for tr in tqdm(jobs, disable=not progress, desc="block data", unit="case", leave=False):
        hw, budget = draw_case(tr, hardware, rng, budget_range)
        plan, _ = joint_search(tr, budget, hw, seconds=seconds, prior=prior, seed=int(rng.integers(0, 2**31)))
        xs.append(features(tr, budget, hw))
        ys.extend(state_labels(tr, plan))
    if not xs:
        return np.zeros((0, N_FEATURES)), np.zeros(0, dtype=np.int64)
    return np.concatenate(xs), np.array(ys, dtype=np.int64)


def fit(x: np.ndarray, y: np.ndarray, *, hidden: int = 32, steps: int = 800, seed: int = 0) -> BlockChooser:
    """Cross-entropy (classes weighted by inverse square-root frequency), full-batch Adam."""
    import torch

    if len(x) == 0:
        raise UserError("no block-chooser training data: no training trace has a recomputable block")
    torch.manual_seed(seed)
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
    mean[13], std[13] = 0.0, 1.0  # the mask's feature stays readable as 0/1
    xt = torch.tensor((x - mean) / std, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.long)
    counts = np.bincount(y, minlength=len(STATES)).astype(np.float64)
    w = np.where(counts > 0, len(y) / (len(STATES) * np.maximum(counts, 1)), 0.0) ** 0.5
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                              torch.nn.Tanh(), torch.nn.Linear(hidden, len(STATES)))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    loss_fn = torch.nn.CrossEntropyLoss(weight=torch.tensor(w, dtype=torch.float32))
    raw = torch.tensor(x, dtype=torch.float32)
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(_masked(net(xt), raw), yt)
        loss.backward()
        opt.step()
    p = [q.detach().numpy().astype(np.float64) for q in net.parameters()]
    return BlockChooser((p[0].T, p[1], p[2].T, p[3], p[4].T, p[5]), mean, std)


def finetune(chooser: BlockChooser, traces: Sequence[Trace], hardware: Sequence[Hardware], *, cases_per_trace: int = 4,
             iterations: int = 100, batch: int = 8, lr: float = 1e-3, budget_range: tuple[float, float] = (0.25, 0.95),
             seed: int = 0, progress: bool = False) -> BlockChooser:
    """Fine-tune on the simulator by self-critical REINFORCE: per case, states sampled from the
    network are rewarded by ``-log`` of their joint plan's step over the ideal step (an OOM by -3,
    as if 20x slower), against the greedy states' reward as the baseline."""
    import torch
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    cases = []
    for tr in traces:
        if not tr.segments:
            continue
        for _ in range(cases_per_trace):
            hw, budget = draw_case(tr, hardware, rng, budget_range)
            x = features(tr, budget, hw)
            cases.append((tr, budget, hw, torch.tensor((x - chooser.mean) / chooser.std, dtype=torch.float32),
                          torch.tensor(x, dtype=torch.float32)))
    if not cases:
        raise UserError("no cases to fine-tune the block chooser on: no training trace has a recomputable block")
    params = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in chooser.weights]
    w1, b1, w2, b2, w3, b3 = params
    opt = torch.optim.Adam(params, lr=lr)

    def logits(x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        return _masked(torch.tanh(torch.tanh(x @ w1 + b1) @ w2 + b2) @ w3 + b3, raw)

    def reward(case: tuple, states: Sequence[int]) -> float:
        tr, budget, hw = case[:3]
        r = simulate(tr, joint_plan(tr, budget, hw, states, "rl"), hw, budget, validate=False)
        return -3.0 if r.oom else -float(np.log(r.iteration_s / tr.ideal_s))

    for _ in tqdm(range(iterations), disable=not progress, desc="block chooser RL", unit="it", leave=False):
        opt.zero_grad()
        loss = torch.zeros(())
        for i in rng.integers(0, len(cases), batch):
            case = cases[int(i)]
            lg = logits(case[3], case[4])
            dist = torch.distributions.Categorical(logits=lg)
            sample = dist.sample()
            adv = reward(case, sample.tolist()) - reward(case, lg.argmax(dim=1).tolist())
            loss = loss - adv * dist.log_prob(sample).sum() / batch
        loss.backward()
        opt.step()
    weights = tuple(p.detach().numpy().astype(np.float64) for p in params)
    return BlockChooser(weights, chooser.mean, chooser.std)
