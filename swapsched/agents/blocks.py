"""A network that chooses which blocks to recompute (R9), and how, in one pass, learned from
simulated outcomes.

Which blocks to recompute is what decides a step on a PCIe link below ~85% of the activation peak:
no swap plan there can beat R8's floor, and checkpointing costs about one extra forward. The block
chooser ranks the blocks as Capuchin does (Peng et al., ASPLOS 2020: bytes freed per second of
recompute, MSPS) and predicts, from features of the trace, the budget and the link that need no
simulation (:func:`features`), one of :data:`CHOICES`: how far down that ranking to recompute (an
eighth of the blocks at a time) and how (whole; selectively; selectively where a block has cheap
members, else whole). MIN swaps what the chosen blocks leave
(:func:`~swapsched.agents.heuristics.min_around_blocks`) and the plan editor edits that plan:
``default-greedy``'s joint plan, with no candidates and no search. ``default`` adds the plans of
the network's two most likely choices to the candidates its search starts from.

It is trained on the simulator's outcome of every choice on random training cases (:func:`collect`):
the loss is the expected log step time over the best choice's (:func:`fit`), so a near miss costs
little and an out-of-memory choice much. Saved beside a policy checkpoint as ``NAME.blocks.npz``.

A first version chose each block's state on its own (an MLP per block, imitating the joint
search's states, then REINFORCE): 0.982-1.013 of the best technique's step on the held-out split
across four trainings, with whole families (unet, GPT-1.3B at 50%) lost in some of them; per-block
choices that depend on one another were the weak point. Every prefix of the ranking, in each of the
three ways, would give 0.950 there (the best of them per case).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from swapsched.agents.heuristics import min_around_blocks
from swapsched.agents.mlp import TanhMLP, exported, torch_mlp
from swapsched.agents.recompute import by_msps
from swapsched.agents.scoring import TINY_S, training_cases
from swapsched.env.simulator import simulate
from swapsched.errors import UserError
from swapsched.hardware import Hardware
from swapsched.plan import BlockState, SwapPlan
from swapsched.trace import Trace

__all__ = ["BlockChooser", "CHOICES", "STATES", "features", "states_of", "joint_plan", "collect", "fit", "chooser_path"]

#: A block's states, by index (R9).
STATES = tuple(BlockState)
#: How the chosen blocks are recomputed: ``whole``; ``selective`` (a block with no cheap member is
#: kept); ``mixed`` (selective where the block has cheap members, else whole).
WAYS = ("whole", "selective", "mixed")
#: The choices, by class index: recompute nothing, or the top ``eighths``/8 of the blocks ranked
#: by MSPS (rounded up), one of ``WAYS``.
CHOICES: tuple[tuple[str, int], ...] = (("none", 0), *((w, e) for w in WAYS for e in range(1, 9)))
N_FEATURES = 16
FEATURE_VERSION = 3
#: How many of the network's choices the guard of :meth:`BlockChooser.plan` simulates at most.
GUARD_TRIES = 3
#: The cost of a choice that runs out of memory, in log step time over the best choice (x20).
OOM_COST = 3.0


def chooser_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.stem + ".blocks.npz")


def states_of(trace: Trace, choice: int) -> list[int]:
    """Each block's state (an index into ``STATES``) under ``CHOICES[choice]``."""
    way, eighths = CHOICES[choice]
    segs = trace.segments
    out = [0] * len(segs)
    if not eighths:
        return out
    for s in by_msps(segs, way)[: -(-len(segs) * eighths // 8)]:  # at least one block
        out[s.index] = 1 if way == "whole" or (way == "mixed" and not s.cheap) else 2 if s.cheap else 0
    return out


def features(trace: Trace, budget: int, hardware: Hardware) -> np.ndarray:
    """One row for the case (nothing simulated): the overshoot against what the blocks could free
    and what the link could move during backward, what rebuilding costs against moving, and how
    many of the ranked blocks it takes to cover the overshoot, whole and selectively."""
    segs = trace.segments
    ideal = max(trace.ideal_s, TINY_S)
    demand = trace.static_bytes + trace.other_bytes + trace.resident_bytes_no_swap
    over = max(float(demand.max()) - budget, 1.0)
    peak, low = trace.peak_bytes_no_swap, trace.min_feasible_bytes
    total = max(sum(s.bytes for s in segs), 1)
    cheap = sum(s.cheap_bytes for s in segs)
    fwd, cheap_fwd = sum(s.forward_s for s in segs), sum(s.cheap_forward_s for s in segs)
    n = max(len(segs), 1)

    def to_cover(way: str, size: Any) -> float:  # the share of the ranked blocks that frees ``over``
        acc = 0.0
        for i, s in enumerate(by_msps(segs, way)):
            acc += size(s)
            if acc >= over:
                return (i + 1) / n
        return 1.25

    def log_ratio(a: float, b: float) -> float:
        return float(np.clip(np.log10(max(a, TINY_S) / max(b, TINY_S)), -3, 3)) / 3.0

    return np.array([
        (budget - low) / max(peak - low, 1),
        log_ratio(hardware.h2d_time(over), ideal),
        min(hardware.link_bytes_per_s("h2d") * trace.backward_compute_s / over, 4.0) / 4.0,
        min(total / over, 4.0) / 4.0,
        min(cheap / over, 4.0) / 4.0,
        cheap / total,
        fwd / ideal,
        cheap_fwd / ideal,
        log_ratio(fwd, hardware.h2d_time(total)),
        log_ratio(cheap_fwd, hardware.h2d_time(cheap)) if cheap else 1.0,
        sum(1 for s in segs if s.cheap) / n,
        to_cover("whole", lambda s: s.bytes),
        to_cover("selective", lambda s: s.cheap_bytes),
        total / max(trace.saved_bytes_peak, 1),
        np.log2(n) / 8.0,
        over / max(peak - trace.static_bytes, 1),
    ])


def joint_plan(trace: Trace, budget: int, hardware: Hardware, states: Sequence[int], name: str) -> SwapPlan:
    """The blocks in ``states`` recomputed as chosen, the rest swapped by MIN around them."""
    return min_around_blocks(trace, budget, hardware, recompute=[i for i, c in enumerate(states) if c == 1],
                             selective=[i for i, c in enumerate(states) if c == 2], name=name)


@dataclass(frozen=True)
class BlockChooser(TanhMLP):
    """An MLP ``N_FEATURES -> hidden -> hidden -> len(CHOICES)`` (tanh), evaluated in numpy."""

    KIND: ClassVar[str] = "block chooser"
    VERSION: ClassVar[int] = FEATURE_VERSION
    RETRAIN: ClassVar[str] = "swapsched train-policy --search-only"

    def choice(self, trace: Trace, budget: int, hardware: Hardware) -> int:
        """The most likely of ``CHOICES`` (none where the trace has no block)."""
        return self.ranked(trace, budget, hardware)[0]

    def ranked(self, trace: Trace, budget: int, hardware: Hardware) -> list[int]:
        """``CHOICES`` by the network's preference, the most likely first (none where no block)."""
        if not trace.segments:
            return [0]
        return [int(c) for c in np.argsort(-self.logits(features(trace, budget, hardware)), kind="stable")]

    def states(self, trace: Trace, budget: int, hardware: Hardware) -> list[int]:
        return states_of(trace, self.choice(trace, budget, hardware))

    def plan(self, trace: Trace, budget: int, hardware: Hardware, name: str) -> SwapPlan:
        """The chosen blocks recomputed and MIN around them. Like the editor's memory account, one
        guard: the network's most likely of its first ``GUARD_TRIES`` choices whose plan does not
        run out of memory (recomputing nothing is MIN's plan, taken unsimulated), else MIN alone
        where it fits, else the first choice's plan. On ViT-B/16 at 70% on a100-pcie4 (outside the
        zoo) the first choice ran out of memory, MIN alone took 6.2x the best technique's step, and
        the second choice was the best of all."""
        plans = []
        for c in self.ranked(trace, budget, hardware)[:GUARD_TRIES]:
            states = states_of(trace, c)
            plan = joint_plan(trace, budget, hardware, states, name)
            if not any(states) or not simulate(trace, plan, hardware, budget, validate=False).oom:
                return plan
            plans.append(plan)
        alone = joint_plan(trace, budget, hardware, [], name)
        return alone if not simulate(trace, alone, hardware, budget, validate=False).oom else plans[0]


def choice_costs(trace: Trace, budget: int, hardware: Hardware) -> np.ndarray:
    """Each choice's simulated step as ``log(step / the best choice's step)`` (``OOM_COST`` for
    one that runs out of memory; all ``OOM_COST`` where every one does)."""
    steps = np.full(len(CHOICES), np.inf)
    for c in range(len(CHOICES)):
        r = simulate(trace, joint_plan(trace, budget, hardware, states_of(trace, c), "c"), hardware, budget, validate=False)
        if not r.oom:
            steps[c] = r.iteration_s
    if not np.isfinite(steps).any():
        return np.full(len(CHOICES), OOM_COST)
    return np.where(np.isfinite(steps), np.log(steps / steps.min()), OOM_COST)


def collect(traces: Sequence[Trace], hardware: Sequence[Hardware], *, cases_per_trace: int = 120,
            budget_range: tuple[float, float] = (0.25, 0.95), seed: int = 0,
            progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Features and every choice's cost (:func:`choice_costs`) on random cases (budgets and
    hardware) of the traces that have blocks."""
    rng = np.random.default_rng(seed)
    xs, cs = [], []
    for tr, hw, budget in training_cases([tr for tr in traces if tr.segments], hardware, rng, cases_per_trace=cases_per_trace,
                                         budget_range=budget_range, progress=progress, desc="block chooser data"):
        costs = choice_costs(tr, budget, hw)
        if costs.min() < OOM_COST:  # a case no choice fits teaches nothing
            xs.append(features(tr, budget, hw))
            cs.append(costs)
    if not xs:
        return np.zeros((0, N_FEATURES)), np.zeros((0, len(CHOICES)))
    return np.stack(xs), np.stack(cs)


def fit(x: np.ndarray, costs: np.ndarray, *, hidden: int = 64, steps: int = 1500, seed: int = 0,
        weight_decay: float = 1e-4) -> BlockChooser:
    """Minimize the expected cost of the network's choice distribution (full batch, Adam), with a
    cross-entropy term toward each case's best choice, which starts it where the signal is."""
    import torch

    if len(x) == 0:
        raise UserError("no block-chooser training data: no training trace has a recomputable block that fits")
    torch.manual_seed(seed)
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
    xt = torch.tensor((x - mean) / std, dtype=torch.float32)
    ct = torch.tensor(costs, dtype=torch.float32)
    best = ct.argmin(dim=1)
    net = torch_mlp(x.shape[1], hidden, len(CHOICES))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=weight_decay)
    for i in range(steps):
        opt.zero_grad()
        lg = net(xt)
        expected = (torch.softmax(lg, dim=1) * ct).sum(dim=1).mean()
        ce = torch.nn.functional.cross_entropy(lg, best)
        loss = expected + (0.1 if i < steps // 2 else 0.01) * ce
        loss.backward()
        opt.step()
    return BlockChooser(exported(net), mean, std)
