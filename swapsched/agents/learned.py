"""A trained checkpoint as a policy: ``LearnedPolicy("default", mode="search").plan(trace, budget, hardware)``.

A checkpoint is ``checkpoints/NAME.zip`` (the MaskablePPO policy) with, beside it, ``NAME.json`` (its
card: code version, what it was trained on, its held-out results), ``NAME.editor.npz`` (the plan
editor), ``NAME.blocks.npz`` (the block chooser) and ``NAME.moves.npz`` (the search's move prior).
See :class:`LearnedPolicy` for the modes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from swapsched.agents.blocks import BlockChooser, chooser_path, joint_plan, states_of
from swapsched.agents.checkpoint import ENV_VERSION, CheckpointError, check_card, load_ppo, resolve_checkpoint
from swapsched.agents.editor import PlanEditor, editor_path
from swapsched.agents.guide import MovePrior, prior_path
from swapsched.agents.heuristics import Belady
from swapsched.agents.joint import joint_search, planning_seconds
from swapsched.agents.recompute import CheckpointAll, CheckpointSelective, hybridize
from swapsched.agents.scoring import best_plan
from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.trace import Trace

__all__ = ["LearnedPolicy", "CheckpointError", "resolve_checkpoint", "check_card", "greedy_rollout", "ENV_VERSION"]


#: How a checkpoint plans: ``search`` (``default``), ``greedy`` (``default-greedy``), ``guarded``
#: (``default-greedy-guarded``), ``ppo`` (``default-ppo``).
MODES = ("search", "greedy", "guarded", "ppo")
#: The guarded greedy plan's time box for its hybrid candidate (issue 36: a learned plan in <= 100 ms)
GUARD_SECONDS = 0.05


@dataclass
class LearnedPolicy:
    """Plans with a trained checkpoint: its MaskablePPO policy (``NAME.zip``), its plan editor
    (``NAME.editor.npz``, :mod:`swapsched.agents.editor`), its block chooser (``NAME.blocks.npz``,
    :mod:`swapsched.agents.blocks`) and its move prior (``NAME.moves.npz``,
    :mod:`swapsched.agents.guide`), each loaded once, on first use.

    - ``mode="greedy"`` (``default-greedy``): the learned parts alone, no candidates and no search,
      so their own worth is visible: the block chooser picks which blocks to recompute and how (R9; the fastest in
      simulation of its four most likely choices), MIN swaps
      what they leave, and the plan editor edits that plan in one pass. A checkpoint without a
      chooser (or ``recompute=False``) edits MIN's plan: swap only.
    - ``mode="search"`` (``default``): :func:`~swapsched.agents.joint.joint_search` with the
      editor's plan and the chooser's two most likely choices among its candidates and the move prior drawing its moves,
      for ``search_seconds``, or by default 0.9 s up to 500 saved tensors, growing to 2.7 s at 2,000
      (all of the planning included). Never worse than the best heuristic on the simulator, since
      its plan is a candidate. ``recompute=True`` (``default``) plans keep / swap / recompute
      jointly; ``recompute=False`` (``default-swap``) is the swap-only planner. ``guided=False``
      draws the search's moves uniformly instead of from the move prior (what
      ``scripts/bench_prior.py`` compares it with).
    - ``mode="guarded"`` (``default-greedy-guarded``): the greedy plan with a safety net: the best
      in simulation of it, the chooser's next two choices with MIN around them, checkpoint-all,
      checkpoint-selective and Capuchin's hybrid step over MIN's plan (time-boxed to
      ``GUARD_SECONDS``). Reported apart from ``greedy``: the candidates are not learned.
    - ``mode="ppo"`` (``default-ppo``): the MaskablePPO policy's one deterministic rollout in
      ``SwapEnv``, the reinforcement-learned planner this project started from.
    """

    checkpoint: str | Path = "default"
    name: str = "learned"
    mode: str = "ppo"
    search_seconds: float | None = None
    seed: int = 0
    recompute: bool = True
    guided: bool = True
    _model: Any = field(default=None, init=False, repr=False)
    _prior: Any = field(default=None, init=False, repr=False)
    _editor: Any = field(default=None, init=False, repr=False)
    _chooser: Any = field(default=None, init=False, repr=False)
    _greedy: Any = field(default=None, init=False, repr=False)  # this checkpoint in greedy mode: screens state placements

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise CheckpointError(f"unknown mode {self.mode!r}; one of {', '.join(MODES)}")
        self.path = resolve_checkpoint(self.checkpoint)
        self.card = check_card(self.path)
        if self.name == "learned":
            suffix = {"search": "" if self.recompute else "-swap", "greedy": "-greedy", "guarded": "-greedy-guarded",
                      "ppo": "-ppo"}[self.mode]
            suffix += "" if self.guided else "-unguided"
            self.name = f"default{suffix}" if self.path.stem == "default" else f"learned{suffix}:{self.path.stem}"

    def _load(self) -> Any:
        if self._model is None:
            self._model = load_ppo(self.path, card=self.card, device="cpu")  # deserializes no pickle
        return self._model

    def _move_prior(self) -> Any:
        """The checkpoint's learned move prior, or None (the search's uniform proposal)."""

        if not self.guided:
            return None
        if self._prior is None:
            p = prior_path(self.path)
            self._prior = MovePrior.load(p) if p.is_file() else False
        return self._prior or None

    def _plan_editor(self) -> Any:
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

    def _block_chooser(self) -> Any:
        """The checkpoint's block chooser, or None (a checkpoint trained before it: swap-only greedy)."""

        if self._chooser is None:
            p = chooser_path(self.path)
            self._chooser = BlockChooser.load(p) if p.is_file() else False
        return self._chooser or None

    def greedy(self, trace: Trace, budget: int, hardware: Hardware, name: str | None = None) -> SwapPlan:
        """The learned parts' own plan: the block chooser's states with MIN around them (where the
        trace has blocks and the checkpoint a chooser; else MIN's plan), edited by the plan editor
        unless its edits run out of memory where the unedited plan does not."""
        from swapsched.env.simulator import simulate

        chooser = self._block_chooser() if self.recompute and trace.segments else None
        start = chooser.plan(trace, budget, hardware, "min") if chooser else Belady().plan(trace, budget, hardware)
        out = self._plan_editor().edit(trace, budget, hardware, start, name or self.name)
        # the editor's memory account plans without stalls; where its edits run out of memory and
        # the plan it edited does not, that plan (one simulation of each, as the chooser's guard)
        if (out != start and simulate(trace, out, hardware, budget, validate=False).oom
                and not simulate(trace, start, hardware, budget, validate=False).oom):
            return SwapPlan.of(trace, name or self.name, start.evictions, recompute=start.recompute,
                               selective=start.selective)
        return out

    def guarded(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        """The greedy plan, or the best in simulation of the cheap candidates beside it (see ``mode``)."""
        t0 = time.perf_counter()
        first = self.greedy(trace, budget, hardware)
        cands = [first]
        chooser = self._block_chooser() if self.recompute and trace.segments else None
        if chooser is not None:
            cands += [joint_plan(trace, budget, hardware, states_of(trace, c), self.name)
                      for c in chooser.ranked(trace, budget, hardware)[1:3] if c]
            cands += [CheckpointAll().plan(trace, budget, hardware), CheckpointSelective().plan(trace, budget, hardware)]
            cands.append(hybridize(trace, budget, hardware, Belady().plan(trace, budget, hardware),
                                   deadline=t0 + GUARD_SECONDS))
        best, _ = best_plan(trace, budget, hardware, cands)  # the greedy plan wins ties
        return SwapPlan.of(trace, self.name, best.evictions, recompute=best.recompute, selective=best.selective,
                           guard=best.policy if best is not first else "none")

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan:
        if trace.state and self.mode in ("search", "greedy", "guarded"):
            # R13-R16: the state is placed too; this policy plans the activations of each placement
            from swapsched.agents.state_search import plan_state

            if self.mode == "greedy":
                screen = self
            else:  # the learned parts' own plan screens the placements (milliseconds each)
                if self._greedy is None:
                    self._greedy = replace(self, mode="greedy", name=self.name)
                screen = self._greedy
            return plan_state(trace, budget, hardware, inner=self, screen=screen, name=self.name)
        if self.mode == "ppo":
            self._load()  # once per process, not part of a plan's time
            return self.rollout(trace, budget, hardware)
        editor = self._plan_editor()  # loaded outside the planning time
        prior, chooser = self._move_prior(), self._block_chooser()
        if self.mode == "greedy":
            return self.greedy(trace, budget, hardware)
        if self.mode == "guarded":
            return self.guarded(trace, budget, hardware)

        def proposals(min_plan: SwapPlan) -> list[SwapPlan]:
            out = [editor.edit(trace, budget, hardware, min_plan, "editor")]
            if chooser and self.recompute and trace.segments:
                # the chooser's two most likely choices, MIN around each (recomputing nothing is
                # MIN's plan, a candidate already); the search scores them, so no guard
                out += [joint_plan(trace, budget, hardware, states_of(trace, c), "blocks")
                        for c in chooser.ranked(trace, budget, hardware)[:2] if c]
            return out

        total = self.search_seconds if self.search_seconds is not None else planning_seconds(trace)
        plan, evals = joint_search(trace, budget, hardware, seconds=total, proposals=proposals, prior=prior, seed=self.seed,
                                   recompute=self.recompute)
        return SwapPlan.of(trace, self.name, plan.evictions, recompute=plan.recompute, selective=plan.selective,
                           checkpoint=str(self.path), start=plan.meta["start"], search_evals=evals)


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
