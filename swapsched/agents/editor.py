"""A network that edits the best heuristic's plan in one pass, learned from what the search changed.

The local search improves the best single-pass heuristic's exact plan (usually min's) by moves; most
of what it finds is the same few edits: drop an eviction min did not need, or issue a prefetch that
stalled a few events earlier. The plan editor predicts, for each evicted tensor of the start plan
at once, which edit the search would make (``EDITS``), from per-tensor features of the start plan
(``features``): the tensor's size and copy time, its prefetch lead, whether its unpack stalled and by
how much, the memory slack where its prefetch lands, how far the no-swap demand is over budget
while it is away, where it sits in the step, and the budget's position. It is search distillation
(amortized search, as in expert iteration): trained by cross-entropy on the searches' outcomes on
training traces, it never simulates at inference.

Its edited plan is the network's own answer (``default-greedy``: no simulation, no candidates), and
``default`` adds it to the candidates the search starts from, so the search starts where the
network believes the improvement is. Saved beside a policy checkpoint as ``NAME.editor.npz``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from swapsched.agents.heuristics import Belady, planned_demand, rebuilt_at
from swapsched.agents.local_search import improve_best_heuristic
from swapsched.agents.mlp import TanhMLP, exported, torch_mlp
from swapsched.agents.scoring import training_cases
from swapsched.env.result import SimResult
from swapsched.env.simulator import simulate
from swapsched.errors import UserError
from swapsched.hardware import Hardware
from swapsched.plan import Eviction, SwapPlan
from swapsched.trace import Trace

__all__ = ["PlanEditor", "EDITS", "features", "edit_labels", "apply_edits", "collect", "fit", "finetune", "editor_path"]

#: The edits, by class index: keep the eviction as it is, drop it, or move its prefetch earlier by
#: the number of events given.
EDITS: tuple[tuple[str, int], ...] = (("keep", 0), ("drop", 0), ("earlier", 2), ("earlier", 8))
N_FEATURES = 13
FEATURE_VERSION = 1


def editor_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.stem + ".editor.npz")


def features(trace: Trace, budget: int, hardware: Hardware, plan: SwapPlan, result: SimResult) -> tuple[list[int], np.ndarray]:
    """The evicted tensors of ``plan`` (in its order) and one feature row each; ``result`` is the
    plan's simulation with its timeline recorded."""

    evs = list(plan.evictions)
    ids = [e.tensor for e in evs]
    if not evs:
        return ids, np.zeros((0, N_FEATURES))
    t = trace.event_times
    ideal = max(trace.ideal_s, 1e-12)
    b = trace.tensor_bytes.astype(np.float64)
    med = max(float(np.median(b)), 1.0)
    fu, lfp = trace.first_unpack, trace.last_forward_pack
    stall_at: dict[int, float] = {}
    for s0, s1, ev in result.timeline.stalls if result.timeline else ():
        stall_at[int(ev)] = stall_at.get(int(ev), 0.0) + (s1 - s0)
    demand = planned_demand(trace, evs, hardware, rebuilt_at(trace, plan.recomputed(trace), plan.recomputed_selectively(trace)))
    over = trace.static_bytes + trace.other_bytes + trace.resident_bytes_no_swap - budget
    peak, low = trace.peak_bytes_no_swap, trace.min_feasible_bytes
    budget_pos = (budget - low) / max(peak - low, 1)
    stall_frac = 0.0 if result.oom else min(result.stall_s / ideal, 4.0) / 4.0
    rows = np.zeros((len(evs), N_FEATURES))
    for i, e in enumerate(evs):
        k = e.tensor
        h = hardware.h2d_time(float(b[k]))
        f_u, l_p = int(fu[k]), int(lfp[k])
        stall = stall_at.get(f_u, 0.0)
        window = over[l_p + 1: f_u] if f_u > l_p + 1 else np.zeros(1)
        rows[i] = (
            np.log2(b[k] / med) / 10.0,
            np.log1p(max(t[f_u] - t[e.prefetch_at], 0.0) / h) / 3.0,
            (t[f_u] - t[l_p]) / ideal,
            1.0 if stall > 0 else 0.0,
            min(stall / h, 4.0) / 4.0,
            f_u / trace.n_events,
            np.log10(max(h / ideal, 1e-9)) / 9.0 + 1.0,
            np.clip((budget - demand[e.prefetch_at]) / b[k], -4, 4) / 4.0,
            np.clip(float(window.max()) / b[k], -4, 4) / 4.0,
            budget_pos,
            stall_frac,
            len(evs) / max(trace.n_tensors, 1),
            (e.swap_out_at - l_p) / max(f_u - l_p, 1),
        )
    return ids, rows


def edit_labels(start: SwapPlan, improved: SwapPlan) -> list[int]:
    """For each eviction of ``start``, the edit class nearest to what ``improved`` did with it."""
    after = {e.tensor: e for e in improved.evictions}
    out = []
    for e in start.evictions:
        a = after.get(e.tensor)
        if a is None:
            out.append(1)
        elif a.prefetch_at < e.prefetch_at:
            out.append(2 if e.prefetch_at - a.prefetch_at <= 4 else 3)
        else:
            out.append(0)
    return out


def apply_edits(trace: Trace, plan: SwapPlan, classes: Sequence[int], name: str) -> SwapPlan:
    """``plan`` with each eviction edited by its class (prefetches clamped to R7's window)."""
    evs = []
    for e, c in zip(plan.evictions, classes, strict=True):
        kind, d = EDITS[int(c)]
        if kind == "drop":
            continue
        if kind == "earlier":
            evs.append(Eviction(e.tensor, e.swap_out_at, max(e.prefetch_at - d, e.swap_out_at)))
        else:
            evs.append(e)
    return SwapPlan.of(trace, name, evs, recompute=plan.recompute, selective=plan.selective)


@dataclass(frozen=True)
class PlanEditor(TanhMLP):
    """An MLP ``N_FEATURES -> hidden -> hidden -> len(EDITS)`` (tanh), evaluated in numpy."""

    KIND: ClassVar[str] = "plan editor"
    VERSION: ClassVar[int] = FEATURE_VERSION
    RETRAIN: ClassVar[str] = "swapsched train-policy"

    def edit(self, trace: Trace, budget: int, hardware: Hardware, plan: SwapPlan, name: str) -> SwapPlan:
        """The network's one-pass edit of ``plan`` (no simulation beyond reading its stalls).

        Like ``SwapEnv``'s action mask, a memory account keeps edits from making the plan infeasible
        on paper: where the edited plan's planned demand (``heuristics.planned_demand``, no stalls)
        exceeds both the budget and the original plan's, the edits are undone, the least confident
        first, in halves, until it does not."""

        res = simulate(trace, plan, hardware, budget, record=True, validate=False)
        ids, x = features(trace, budget, hardware, plan, res)
        if not ids:
            return SwapPlan.of(trace, name, plan.evictions, recompute=plan.recompute, selective=plan.selective)
        lg = self.logits(x)
        classes = np.argmax(lg, axis=1)
        rebuilt = rebuilt_at(trace, plan.recomputed(trace), plan.recomputed_selectively(trace))  # R9
        limit = max(budget, int(planned_demand(trace, plan.evictions, hardware, rebuilt).max()))
        edited = np.flatnonzero(classes != 0)
        p = np.exp(lg - lg.max(axis=1, keepdims=True))
        conf = (p / p.sum(axis=1, keepdims=True))[np.arange(len(classes)), classes]
        order = list(edited[np.argsort(conf[edited], kind="stable")])
        while True:
            out = apply_edits(trace, plan, classes.tolist(), name)
            if not order or planned_demand(trace, out.evictions, hardware, rebuilt).max() <= limit:
                return out
            undo, order = order[: max(len(order) // 2, 1)], order[max(len(order) // 2, 1):]
            classes[undo] = 0


def collect(traces: Sequence[Trace], hardware: Sequence[Hardware], *, cases_per_trace: int = 6, seconds: float = 1.0,
            budget_range: tuple[float, float] = (0.3, 0.95), seed: int = 0, prior: object = None,
            progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Features of every eviction of the best heuristic's plan and the edit a search made to it,
    over random budgets and hardware."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for tr, hw, budget in training_cases(traces, hardware, rng, cases_per_trace=cases_per_trace, budget_range=budget_range,
                                         progress=progress, desc="editor data"):
        start, better = improve_best_heuristic(tr, budget, hw, seconds=seconds, seed=int(rng.integers(0, 2**31)), prior=prior)
        res = simulate(tr, start, hw, budget, record=True, validate=False)
        _, x = features(tr, budget, hw, start, res)
        if len(x):
            xs.append(x)
            ys.extend(edit_labels(start, better))
    if not xs:
        return np.zeros((0, N_FEATURES)), np.zeros(0, dtype=np.int64)
    return np.concatenate(xs), np.array(ys, dtype=np.int64)


def fit(x: np.ndarray, y: np.ndarray, *, hidden: int = 32, steps: int = 800, seed: int = 0,
        keep_weight: float = 1.0) -> PlanEditor:
    """Cross-entropy, full-batch Adam. ``keep_weight`` > 1 makes the network more conservative
    (an edit it is unsure of is worse than none: the plan it starts from is a good one)."""
    import torch

    if len(x) == 0:
        raise UserError("no editor training data: the start plans evicted nothing")
    torch.manual_seed(seed)
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
    xt = torch.tensor((x - mean) / std, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.long)
    counts = np.bincount(y, minlength=len(EDITS)).astype(np.float64)
    w = np.where(counts > 0, len(y) / (len(EDITS) * np.maximum(counts, 1)), 0.0) ** 0.5
    w[0] *= keep_weight
    net = torch_mlp(x.shape[1], hidden, len(EDITS))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    loss_fn = torch.nn.CrossEntropyLoss(weight=torch.tensor(w, dtype=torch.float32))
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(net(xt), yt)
        loss.backward()
        opt.step()
    return PlanEditor(exported(net), mean, std)


def finetune(editor: PlanEditor, traces: Sequence[Trace], hardware: Sequence[Hardware], *, cases_per_trace: int = 4,
             iterations: int = 200, batch: int = 16, lr: float = 1e-3, budget_range: tuple[float, float] = (0.3, 0.95),
             seed: int = 0, progress: bool = False) -> PlanEditor:
    """Fine-tune the editor on the simulator by self-critical REINFORCE: per case, edits sampled
    from the network are rewarded by ``log(min's step / the edited plan's step)`` (an OOM by -1),
    against the greedy edit's reward as the baseline, so the signal sits where the two differ."""
    import torch
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    cases = []
    for tr, hw, budget in training_cases(traces, hardware, rng, cases_per_trace=cases_per_trace, budget_range=budget_range):
        start = Belady().plan(tr, budget, hw)
        res = simulate(tr, start, hw, budget, record=True, validate=False)
        ids, x = features(tr, budget, hw, start, res)
        if ids and not res.oom:
            cases.append((tr, budget, hw, start, res.iteration_s, torch.tensor((x - editor.mean) / editor.std,
                                                                               dtype=torch.float32)))
    if not cases:
        raise UserError("no cases to fine-tune on: min evicts nothing on them")
    w1, b1, w2, b2, w3, b3 = (torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in editor.weights)
    params = [w1, b1, w2, b2, w3, b3]
    opt = torch.optim.Adam(params, lr=lr)

    def logits(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x @ w1 + b1) @ w2 + b2) @ w3 + b3

    def reward(case: tuple, classes: Sequence[int]) -> float:
        tr, budget, hw, start, ref, _ = case
        r = simulate(tr, apply_edits(tr, start, classes, "rl"), hw, budget, validate=False)
        return -1.0 if r.oom else float(np.log(ref / r.iteration_s))

    for _ in tqdm(range(iterations), disable=not progress, desc="editor RL", unit="it", leave=False):
        opt.zero_grad()
        loss = torch.zeros(())
        for i in rng.integers(0, len(cases), batch):
            case = cases[int(i)]
            lg = logits(case[5])
            dist = torch.distributions.Categorical(logits=lg)
            sample = dist.sample()
            adv = reward(case, sample.tolist()) - reward(case, lg.argmax(dim=1).tolist())
            loss = loss - adv * dist.log_prob(sample).sum() / batch
        loss.backward()
        opt.step()
    weights = tuple(p.detach().numpy().astype(np.float64) for p in params)
    return PlanEditor(weights, editor.mean, editor.std)
