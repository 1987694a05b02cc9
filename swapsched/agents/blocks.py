"""A network that chooses which blocks to recompute (R9), and how, in one pass, learned from
simulated outcomes.

Which blocks to recompute is what decides a step on a PCIe link below ~85% of the activation peak:
no swap plan there can beat R8's floor, and checkpointing costs about one extra forward. The block
chooser ranks the blocks as Capuchin does (Peng et al., ASPLOS 2020: bytes freed per second of
recompute, MSPS) and chooses one of :data:`CHOICES`: how far down that ranking to recompute (an
eighth of the blocks at a time), how (whole; selectively; selectively where a block has cheap
members, else whole), and whether to leave out the block backward reaches first. MIN swaps what
the chosen blocks leave (:func:`~swapsched.agents.heuristics.min_around_blocks`) and the plan
editor edits that plan: ``default-greedy``'s joint plan, with no candidates and no search.
``default`` adds the plans of the network's two most likely choices to the candidates its search
starts from.

The network scores each choice from a row of features that need no simulation
(:func:`choice_features`): the case's (the overshoot against what the blocks could free and what
the link could move during backward), then the choice's own (what it rebuilds and what that costs,
the overshoot it leaves at the new peak, and what swapping that would cost the link in bytes and
in copy latencies). It is trained on the simulator's outcome of every choice on random training
cases (:func:`collect`): the loss is the expected log step time over the best choice's
(:func:`fit`), so a near miss costs little and an out-of-memory choice much. Saved beside a policy
checkpoint as ``NAME.blocks.npz``.

Two earlier versions (NOTES.md): one state per block (an MLP per block, imitating the joint
search's states, then REINFORCE) gave 0.982-1.013 of the best technique's step on the held-out
split across four trainings, with whole families lost in some; then one class per choice from the
case's features alone, which could not tell an overshoot the link carries from one it carries only
in bandwidth (an LSTM LM's thousand small tensors, 1.71x ``default``'s step outside the zoo).
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

__all__ = ["BlockChooser", "CHOICES", "STATES", "features", "choice_features", "states_of", "last_block", "joint_plan", "collect",
           "fit", "chooser_path"]

#: A block's states, by index (R9).
STATES = tuple(BlockState)
#: How the chosen blocks are recomputed: ``whole``; ``selective`` (a block with no cheap member is
#: kept); ``mixed`` (selective where the block has cheap members, else whole).
WAYS = ("whole", "selective", "mixed")
#: The choices, by class index: recompute nothing, or the top ``eighths``/8 of the blocks ranked
#: by MSPS (rounded up), one of ``WAYS``, with (``last`` True) or without the block forward runs
#: last. That block is the first backward reaches: rebuilding it frees its bytes only from the end
#: of forward to the start of backward, where it is rebuilt at once, next to the gradients backward
#: is starting to make. On unet at 30% the joint search's plan recomputes every block but that one;
#: no prefix of the ranking comes within 1.5x of it, while with these variants the best choice per
#: case comes within 1.3x (issue 36, NOTES.md).
CHOICES: tuple[tuple[str, int, bool], ...] = (("none", 0, True), *((w, e, True) for w in WAYS for e in range(1, 9)),
                                              *((w, e, False) for w in WAYS for e in range(1, 9)))
#: The case's features (:func:`features`), then each choice's own (:func:`choice_features`).
N_CASE_FEATURES = 16
N_FEATURES = N_CASE_FEATURES + 13
FEATURE_VERSION = 4
#: How many of the network's most likely choices :meth:`BlockChooser.plan` simulates, to take
#: the fastest (issue 54: 3 took the first that fit, and the U-Nets' best was often the fourth)
GUARD_TRIES = 4
#: The cost of a choice that runs out of memory, in log step time over the best choice (x20).
OOM_COST = 3.0


def chooser_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.stem + ".blocks.npz")


def states_of(trace: Trace, choice: int) -> list[int]:
    """Each block's state (an index into ``STATES``) under ``CHOICES[choice]``."""
    way, eighths, last = CHOICES[choice]
    segs = trace.segments
    out = [0] * len(segs)
    if not eighths:
        return out
    for s in by_msps(segs, way)[: -(-len(segs) * eighths // 8)]:  # at least one block
        out[s.index] = 1 if way == "whole" or (way == "mixed" and not s.cheap) else 2 if s.cheap else 0
    if not last:
        out[last_block(trace)] = 0
    return out


def last_block(trace: Trace) -> int:
    """The index of the block forward runs last (its anchor packed last): backward's first."""
    return max(trace.segments, key=lambda s: int(trace.first_pack[s.anchor])).index


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


def choice_features(trace: Trace, budget: int, hardware: Hardware) -> np.ndarray:
    """One row per choice (``len(CHOICES) x N_FEATURES``, nothing simulated): the case's
    :func:`features`, then what the choice is, what it frees and costs, and what it leaves MIN to
    swap, and what that costs the link:

    - the way (one-hot), the eighths, whether it leaves the last block out, whether it rebuilds it;
    - the bytes it rebuilds over the overshoot, its recompute time over the ideal step;
    - the overshoot left at the new peak (a rebuilt member is absent from its release to its
      block's recompute, R9), over the old overshoot;
    - to swap that: the fewest tensors that carry it, taken largest first among those outside the
      rebuilt ones that are released before the new peak, read after it, and whose round trip
      (out and back, with the copy latency) fits between release and first unpack. Their copy
      back against backward's compute (log), their copy latencies against the ideal step, and
      the share of the overshoot no such tensor can carry.

    The last part is why there is more than the case row: an LSTM LM at 50% on gh200-c2c has its
    overshoot in 1,030 small tensors besides a logits tensor with no idle window; the link's
    bandwidth carries them, their copy latencies do not (MIN: 1.87x the ideal step)."""
    segs = trace.segments
    base = features(trace, budget, hardware)
    ideal, bwd = max(trace.ideal_s, TINY_S), max(trace.backward_compute_s, TINY_S)
    demand = (trace.static_bytes + trace.other_bytes + trace.resident_bytes_no_swap).astype(np.float64)
    over = max(float(demand.max()) - budget, 1.0)
    b = trace.tensor_bytes.astype(np.float64)
    rel, fu = trace.release, trace.first_unpack
    done = np.cumsum(trace.gaps)
    lat = hardware.copy_latency_s
    trip = b / hardware.link_bytes_per_s("d2h") + b / hardware.link_bytes_per_s("h2d") + 2 * lat
    fits_window = done[fu] - done[rel] >= trip
    by_size = np.argsort(-b, kind="stable")
    h2d, n_events, last = hardware.link_bytes_per_s("h2d"), trace.n_events, last_block(trace) if segs else -1
    rows = np.zeros((len(CHOICES), N_FEATURES))
    rows[:, :N_CASE_FEATURES] = base
    for c, (way, eighths, keeps_last) in enumerate(CHOICES):
        states = states_of(trace, c)
        rebuilt = np.zeros(trace.n_tensors, dtype=bool)
        freed = rec = 0.0
        absent = np.zeros(n_events + 1)
        for sg, st in zip(segs, states, strict=True):
            if not st:
                continue
            members = np.asarray(sg.members if st == 1 else sg.cheap, dtype=np.int64)
            freed += sg.bytes if st == 1 else sg.cheap_bytes
            rec += sg.forward_s if st == 1 else sg.cheap_forward_s
            if len(members):
                rebuilt[members] = True
                start = np.minimum(rel[members] + 1, sg.at)
                np.add.at(absent, start, b[members])
                np.add.at(absent, np.full(len(members), sg.at), -b[members])
        after = demand - np.cumsum(absent)[:-1]
        peak = int(np.argmax(after))
        left = max(float(after[peak]) - budget, 0.0)
        ok = ~rebuilt & (rel < peak) & (fu > peak) & fits_window
        carried = np.cumsum(b[by_size][ok[by_size]])
        if left <= 0:
            n_take = 0
        elif len(carried) and carried[-1] >= left:
            n_take = int(np.searchsorted(carried, left)) + 1  # the first prefix that carries ``left``
        else:
            n_take = len(carried)  # all of them, and the rest is short
        taken = float(carried[n_take - 1]) if n_take else 0.0
        swap_s = taken / h2d + n_take * lat
        rows[c, N_CASE_FEATURES:] = [
            way == "whole", way == "selective", way == "mixed", eighths / 8.0, not keeps_last,
            bool(segs) and states[last] != 0,
            min(freed / over, 4.0) / 4.0, rec / ideal, left / over,
            float(np.clip(np.log10(max(swap_s, TINY_S) / bwd), -3, 3)) / 3.0,
            min(n_take * 2 * lat / ideal, 4.0) / 4.0, max(left - taken, 0.0) / over,
            left > 0]
    return rows


def joint_plan(trace: Trace, budget: int, hardware: Hardware, states: Sequence[int], name: str) -> SwapPlan:
    """The blocks in ``states`` recomputed as chosen, the rest swapped by MIN around them."""
    return min_around_blocks(trace, budget, hardware, recompute=[i for i, c in enumerate(states) if c == 1],
                             selective=[i for i, c in enumerate(states) if c == 2], name=name)


@dataclass(frozen=True)
class BlockChooser(TanhMLP):
    """An ensemble of MLPs ``N_FEATURES -> hidden -> hidden -> 1`` (tanh), evaluated in numpy,
    their weights stacked on a leading axis (one per member, as :func:`fit` trains them from
    successive seeds): each scores every choice from the choice's row of :func:`choice_features`,
    and the choice with the highest mean log-probability over the members is chosen. One network
    scores every choice from what the choice does, not a class per choice: it reads the trade it
    faces (recompute seconds against link seconds and copy latencies), which carries to models
    whose blocks are nothing like the training families'. Members because one network's choices
    on unseen models vary with its seed (outside the zoo, five seeds: 1.008-1.024 of ``default``'s
    step, worst case 1.11-1.33x); their mean did not (three ensembles: 1.010-1.011, worst 1.11x;
    ``scripts/exp_chooser_members.py``)."""

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
        return [int(c) for c in np.argsort(-self.scores(choice_features(trace, budget, hardware)), kind="stable")]

    def scores(self, x: np.ndarray) -> np.ndarray:
        """Each row's mean log-probability over the members (``x``: choices x ``N_FEATURES``)."""
        w1, b1, w2, b2, w3, b3 = self.weights
        h = np.tanh(np.einsum("cf,kfh->kch", (x - self.mean) / self.std, w1) + b1[:, None, :])
        h = np.tanh(np.einsum("kch,khg->kcg", h, w2) + b2[:, None, :])
        logits = np.einsum("kcg,kgo->kco", h, w3)[..., 0] + b3
        logits -= logits.max(axis=1, keepdims=True)
        return (logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))).mean(axis=0)

    def states(self, trace: Trace, budget: int, hardware: Hardware) -> list[int]:
        return states_of(trace, self.choice(trace, budget, hardware))

    def plan(self, trace: Trace, budget: int, hardware: Hardware, name: str) -> SwapPlan:
        """The chosen blocks recomputed and MIN around them: of the network's first
        ``GUARD_TRIES`` choices, the fastest in simulation (the most likely where they tie), else
        MIN alone where it fits, else the first choice's plan. On ViT-B/16 at 70% on a100-pcie4
        (outside the zoo) the first choice ran out of memory, MIN alone took 6.2x the best
        technique's step, and the second choice was the best of all; on the held-out U-Net
        (medium, bf16) at 50% on h100-pcie5 the first choice that fit took 2.7x ``default``'s step
        and the fourth 1.01x (issue 54)."""
        best: tuple[float, SwapPlan] | None = None
        states = [states_of(trace, c) for c in self.ranked(trace, budget, hardware)[:GUARD_TRIES]]  # never empty
        plans = [joint_plan(trace, budget, hardware, st, name) for st in states]
        for plan in plans:
            r = simulate(trace, plan, hardware, budget, validate=False)
            if not r.oom and (best is None or r.iteration_s < best[0]):
                best = (r.iteration_s, plan)
        if best is not None:
            return best[1]
        if not all(any(st) for st in states):  # MIN alone was one of them, and ran out of memory too
            return plans[0]
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
    """Every choice's features (:func:`choice_features`) and cost (:func:`choice_costs`) on random
    cases (budgets and hardware) of the traces that have blocks: ``(cases, choices, features)``
    and ``(cases, choices)``."""
    rng = np.random.default_rng(seed)
    xs, cs = [], []
    for tr, hw, budget in training_cases([tr for tr in traces if tr.segments], hardware, rng, cases_per_trace=cases_per_trace,
                                         budget_range=budget_range, progress=progress, desc="block chooser data"):
        costs = choice_costs(tr, budget, hw)
        if costs.min() < OOM_COST:  # a case no choice fits teaches nothing
            xs.append(choice_features(tr, budget, hw))
            cs.append(costs)
    if not xs:
        return np.zeros((0, len(CHOICES), N_FEATURES)), np.zeros((0, len(CHOICES)))
    return np.stack(xs), np.stack(cs)


def fit(x: np.ndarray, costs: np.ndarray, *, hidden: int = 64, steps: int = 1500, seed: int = 0,
        weight_decay: float = 1e-4, batch: int = 256, members: int = 5) -> BlockChooser:
    """Minimize the expected cost of the network's choice distribution, a softmax over its scores
    of a case's choices (``x``: cases x choices x features; Adam on ``batch`` cases drawn at each
    step), with a cross-entropy term toward each case's best choice, which starts it where the
    signal is. On the default config's 3,300 cases of 49 choices, batches of 256 fit in 20 s what
    the full batch fitted in 250 s, and chose as well (NOTES.md). ``members`` networks, from seeds
    ``seed``, ``seed + 1``, ..., make the ensemble."""
    if len(x) == 0:
        raise UserError("no block-chooser training data: no training trace has a recomputable block that fits")
    rows = x.reshape(-1, x.shape[-1])
    mean, std = rows.mean(axis=0), rows.std(axis=0) + 1e-6
    nets = [_fit_member((x - mean) / std, costs, hidden=hidden, steps=steps, seed=seed + k, weight_decay=weight_decay,
                        batch=batch) for k in range(members)]
    return BlockChooser(tuple(np.stack(ws) for ws in zip(*nets, strict=True)), mean, std)


def _fit_member(z: np.ndarray, costs: np.ndarray, *, hidden: int, steps: int, seed: int, weight_decay: float,
                batch: int) -> tuple[np.ndarray, ...]:
    """One member's weights (:func:`fit`), on standardized features ``z``."""
    import torch

    torch.manual_seed(seed)
    xt = torch.tensor(z, dtype=torch.float32)
    ct = torch.tensor(costs, dtype=torch.float32)
    best = ct.argmin(dim=1)
    net = torch_mlp(z.shape[-1], hidden, 1)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=weight_decay)
    draw = torch.Generator().manual_seed(seed)
    for i in range(steps):
        pick = torch.randint(0, len(xt), (min(batch, len(xt)),), generator=draw)
        opt.zero_grad()
        lg = net(xt[pick]).squeeze(-1)
        expected = (torch.softmax(lg, dim=1) * ct[pick]).sum(dim=1).mean()
        ce = torch.nn.functional.cross_entropy(lg, best[pick])
        loss = expected + (0.1 if i < steps // 2 else 0.01) * ce
        loss.backward()
        opt.step()
    return exported(net)
