"""A trained checkpoint as a policy: ``LearnedPolicy("default", mode="search").plan(trace, budget, hardware)``.

A checkpoint is ``checkpoints/NAME.zip`` (the MaskablePPO policy) with, beside it, ``NAME.json`` (its
card: code version, what it was trained on, its held-out results), ``NAME.editor.npz`` (the plan
editor) and ``NAME.moves.npz`` (the search's move prior). See :class:`LearnedPolicy` for the modes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swapsched.agents.checkpoint import ENV_VERSION, CheckpointError, check_card, resolve_checkpoint
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.trace import Trace

__all__ = ["LearnedPolicy", "CheckpointError", "resolve_checkpoint", "check_card", "greedy_rollout", "ENV_VERSION"]


#: How a checkpoint plans: ``search`` (``default``), ``greedy`` (``default-greedy``), ``ppo`` (``default-ppo``).
MODES = ("search", "greedy", "ppo")


@dataclass
class LearnedPolicy:
    """Plans with a trained checkpoint: its MaskablePPO policy (``NAME.zip``), its plan editor
    (``NAME.editor.npz``, :mod:`swapsched.agents.editor`) and its move prior (``NAME.moves.npz``,
    :mod:`swapsched.agents.guide`), each loaded once, on first use.

    - ``mode="greedy"`` (``default-greedy``): the plan editor alone, one pass over min's plan; no
      simulation of candidates, no search, so the learned part's own worth is visible.
    - ``mode="search"`` (``default``): the editor's plan and the single-pass heuristics' exact plans
      are the candidates; the best, scored on the simulator, is improved by
      :func:`~swapsched.agents.local_search.improve` drawing its moves from the move prior, until the
      planning time is spent: ``search_seconds``, or by default 0.9 s up to 500 saved tensors,
      growing to 2.7 s at 2,000 (all of the planning included). Never worse than the best heuristic
      on the simulator, since its plan is a candidate. With ``recompute=True`` (``default``; R9) it
      plans keep / swap / recompute jointly: checkpoint-all, the best swap plan with every block
      recomputed, and the best swap plan made hybrid by Capuchin's step are candidates too, and the
      search also toggles blocks' recompute (the learned prior weights only the swap moves: it was
      trained on them). ``recompute=False`` (``default-swap``) is the swap-only planner.
    - ``mode="ppo"`` (``default-ppo``): the MaskablePPO policy's one deterministic rollout in
      ``SwapEnv``, the reinforcement-learned planner this project started from.
    """

    checkpoint: str | Path = "default"
    name: str = "learned"
    mode: str = "ppo"
    search_seconds: float | None = None
    seed: int = 0
    recompute: bool = True
    _model: Any = field(default=None, init=False, repr=False)
    _prior: Any = field(default=None, init=False, repr=False)
    _editor: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise CheckpointError(f"unknown mode {self.mode!r}; one of {', '.join(MODES)}")
        self.path = resolve_checkpoint(self.checkpoint)
        self.card = check_card(self.path)
        if self.name == "learned":
            suffix = {"search": "" if self.recompute else "-swap", "greedy": "-greedy", "ppo": "-ppo"}[self.mode]
            self.name = f"default{suffix}" if self.path.stem == "default" else f"learned{suffix}:{self.path.stem}"

    def _load(self) -> Any:
        if self._model is None:
            from swapsched.agents.checkpoint import load_ppo

            self._model = load_ppo(self.path, card=self.card, device="cpu")  # deserializes no pickle
        return self._model

    def _move_prior(self) -> Any:
        """The checkpoint's learned move prior, or None (the search's uniform proposal)."""
        from swapsched.agents.guide import MovePrior, prior_path

        if self._prior is None:
            p = prior_path(self.path)
            self._prior = MovePrior.load(p) if p.is_file() else False
        return self._prior or None

    def _plan_editor(self) -> Any:
        from swapsched.agents.editor import PlanEditor, editor_path

        if self._editor is None:
            p = editor_path(self.path)
            if not p.is_file():
                raise CheckpointError(f"checkpoint {self.path.name} has no plan editor ({p.name}); learn one with: "
                                      f"swapsched train-policy --search-only --out {self.path}")
            self._editor = PlanEditor.load(p)
        return self._editor

    def rollout(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        """The PPO network's own plan: one deterministic rollout in ``SwapEnv``."""
        plan = greedy_rollout(self._load(), trace, budget, hardware, self.name)
        return SwapPlan.of(trace, self.name, plan.evictions, checkpoint=str(self.path))

    def edited(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        """The plan editor's one pass over min's plan."""
        from swapsched.agents.heuristics import Belady

        return self._plan_editor().edit(trace, budget, hardware, Belady().plan(trace, budget, hardware), self.name)

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        if self.mode == "ppo":
            self._load()  # once per process, not part of a plan's time
            return self.rollout(trace, budget, hardware)
        editor = self._plan_editor()  # loaded outside the planning time
        prior = self._move_prior()
        t0 = time.perf_counter()
        if self.mode == "greedy":
            return self.edited(trace, budget, hardware)
        from swapsched.agents.local_search import best_plan, heuristic_plans, improve, planning_seconds
        from swapsched.env.simulator import analytic_floor, joint_floor

        total = self.search_seconds if self.search_seconds is not None else planning_seconds(trace)
        heur = heuristic_plans(trace, budget, hardware, deadline=t0 + total / 2)
        min_plan = next(p for p in heur if p.policy == "min")
        cands = [editor.edit(trace, budget, hardware, min_plan, "editor"), *heur]
        start, score = best_plan(trace, budget, hardware, cands)
        joint = self.recompute and bool(trace.segments)
        evals = 0
        # stop early where the plan meets the floor (R8, or R8 over the joint space): nothing can be faster
        swap_floor = analytic_floor(trace, budget, hardware)
        floor = joint_floor(trace, budget, hardware) if joint else swap_floor
        t1 = time.perf_counter()
        rest = max(total - (t1 - t0), 0.0)  # the floors' time is planning time too
        if joint and floor >= swap_floor * (1 - 1e-9):
            # recomputing cannot lower R8's floor here: the swaps decide the step (on the held-out
            # bench the best recompute technique was within 1% of the swap search wherever the
            # floors agree), so the swap search gets most of the time, as default-swap has it
            start, score, evals = improve(trace, budget, hardware, start, seconds=0.7 * rest, seed=self.seed,
                                          prior=prior, target=swap_floor)
        if joint and score > floor * (1 + 1e-9):
            from swapsched.agents.recompute import CheckpointAll, CheckpointSelective, hybridize, with_all_recomputed

            # the best swap plan and capuchin's swap half, each made hybrid by Capuchin's step
            swaps = [start, *(p for p in heur if p.policy == "capuchin" and p is not start)]
            cands = [start, CheckpointAll().plan(trace, budget, hardware), with_all_recomputed(trace, start, "swap+checkpoint"),
                     CheckpointSelective().plan(trace, budget, hardware),
                     with_all_recomputed(trace, start, "swap+selective", selective=True),
                     *(hybridize(trace, budget, hardware, p, deadline=t1 + (0.35 + 0.2 * i) * rest) for i, p in enumerate(swaps))]
            start, _ = best_plan(trace, budget, hardware, cands)
        left = total - (time.perf_counter() - t0)
        plan, _, more = improve(trace, budget, hardware, start, seconds=max(left, 0.0), seed=self.seed, prior=prior,
                                target=floor, recompute=joint)
        return SwapPlan.of(trace, self.name, plan.evictions, recompute=plan.recompute, selective=plan.selective,
                           checkpoint=str(self.path),
                           start=start.policy, search_evals=evals + more)


def greedy_rollout(model: Any, trace: Trace, budget: int, hardware: Hardware, name: str) -> SwapPlan:
    """One deterministic rollout of a MaskablePPO ``model`` in ``SwapEnv``; its decisions as a plan."""
    from swapsched.env.swap_env import SwapEnv

    env = SwapEnv(traces=[trace], hardware=[hardware])
    obs, _ = env.reset(options={"trace": 0, "budget_bytes": budget, "hardware": 0})
    done = False
    while not done:
        action, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=True)
        obs, _, terminated, truncated, _ = env.step(int(action))
        done = terminated or truncated
    return SwapPlan.of(trace, name, env.evictions)
