"""Train a swap policy with MaskablePPO on SwapEnv, and evaluate it on held-out traces.

``swapsched train-policy --config configs/train/default.yaml --out checkpoints/NAME.zip`` writes
the checkpoint and ``NAME.json`` beside it: the configuration, the traces it trained on, and its
held-out results against the baselines, measured on the simulator at the end of training.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from swapsched._paths import atomic_path
from swapsched.agents import blocks, editor, guide
from swapsched.agents.checkpoint import check_card, load_ppo, resolve_checkpoint
from swapsched.agents.evaluate import PolicySummary, StepRatio, compare, feasible_cases, step_ratio, summarize
from swapsched.agents.heuristics import Belady
from swapsched.agents.learned import ENV_VERSION, LearnedPolicy, greedy_rollout
from swapsched.errors import UserError, read_yaml
from swapsched.hardware import DEFAULT_GPU_HARDWARE, TRAINING_HARDWARE, load_hardware
from swapsched.jsonfile import write_json

__all__ = ["TrainConfig", "TrainResult", "SearchParts", "load_train_config", "train_policy", "train_search", "evaluate", "validation_ratio"]


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
    eval: dict[str, Any] = field(default_factory=lambda: {"budgets": ["30%", "50%", "70%"], "hardware": [DEFAULT_GPU_HARDWARE],
                                                          "baselines": ["swap-all", "min", "capuchin"]})
    ppo: dict[str, Any] = field(default_factory=dict)
    # families of the train split kept out of training to choose the best checkpoint by
    validation_families: tuple[str, ...] = ("bert",)
    eval_every: int = 50_000
    # the search's learned move prior (agents/guide.py): searches per training trace, seconds each
    prior_cases_per_trace: int = 3
    prior_seconds: float = 0.5
    # the plan editor (agents/editor.py): searches per training trace, seconds each, and how much
    # more a wrong edit costs than a missed one (chosen on the validation family: 1 let a drop cause
    # an OOM; 2 and 3 gave 0.997 and 0.998 of the best heuristic's step)
    editor_cases_per_trace: int = 4
    editor_seconds: float = 1.0
    editor_keep_weight: float = 2.0
    # then fine-tuned on the simulator by self-critical REINFORCE (editor.finetune), batches of 16
    # cases: on the validation family 150 iterations took the imitated editor from 1.065 (one OOM)
    # to 0.9996 of min's step, 600 to 0.9998
    editor_rl_iterations: int = 300
    # the block chooser (agents/blocks.py): random cases per training trace with blocks, each
    # choice simulated on each; an ensemble of ``blocks_members`` networks of ``blocks_hidden``
    # units. Session 13 chose 60 cases and 64 units on the corpus's held-out split (for 25 choices
    # scored from the case alone); session 18 chose 5 members outside the zoo (one network's
    # worst case there ranged 1.11-1.33x ``default``'s step over five seeds, three ensembles' 1.11x;
    # scripts/exp_chooser_members.py)
    blocks_cases_per_trace: int = 60
    blocks_hidden: int = 64
    blocks_members: int = 5
    # corpus splits the search's learned parts (prior, editor, chooser) also learn from, beside
    # ``corpus_split``: ``generated`` is 32 random architectures (swapsched/generated.py), so that
    # what they learn is not the zoo's five families. With them, 54 training traces instead of 22,
    # the cases per trace above were halved (prior 6, editor 8, chooser 120 before), for about as
    # many searches and cases as before
    search_extra_splits: tuple[str, ...] = ("generated",)

    def scaled(self, timesteps: int) -> TrainConfig:
        """This config with the search's learned parts sized to a run of ``timesteps`` PPO steps:
        each count and time box in proportion to ``timesteps / total_timesteps`` (never above the
        config's), down to one case per trace, 0.1 s searches, 10 REINFORCE iterations, 2
        chooser cases per trace and one chooser network: a short run (``--timesteps 2048``, ``--quick``) is short end to
        end, where its PPO part alone would be."""
        s = min(1.0, timesteps / self.total_timesteps)
        if s >= 1.0:
            return self

        def count(n: int, least: int) -> int:
            return max(least, round(n * s))

        return replace(self, total_timesteps=int(timesteps),
                       prior_cases_per_trace=count(self.prior_cases_per_trace, 1),
                       prior_seconds=max(0.1, self.prior_seconds * s),
                       editor_cases_per_trace=count(self.editor_cases_per_trace, 1),
                       editor_seconds=max(0.1, self.editor_seconds * s),
                       editor_rl_iterations=count(self.editor_rl_iterations, 10),
                       blocks_cases_per_trace=count(self.blocks_cases_per_trace, 2),
                       blocks_members=count(self.blocks_members, 1))


#: What each phase costs on this kind of machine (2 cores), for the plan a run prints first, as
#: ``swapsched train-policy`` from scratch on the default config measured them (session 18, 27 min
#: in all): PPO over SwapEnv with 4 environments, 1,507,328 steps in 938 s, after a start of about
#: 10 s; the block chooser's data, 3,300 cases x 49 choices simulated in 240 s, then 20 s per
#: network it fits; the editor's REINFORCE, 300 iterations in 6 s; the held-out evaluation, 96 cases
#: in 52 s. The prior's and the editor's searches are time-boxed: their time is their box.
PPO_START_S = 10.0
PPO_STEPS_PER_S = 1600.0
CHOOSER_SIMULATIONS_PER_S = 670.0
CHOOSER_FIT_S = 20.0
EDITOR_RL_ITERATION_S = 0.02
EVALUATION_CASE_S = 0.55


def phase_plan(config: TrainConfig, n_ppo_traces: int, n_search_traces: int, timesteps: int,
               n_eval_traces: int = 0) -> list[tuple[str, float]]:
    """Each phase of a run and about how long it takes (seconds): PPO, the move prior, the plan
    editor (its searches, then REINFORCE), the block chooser, and the held-out evaluation."""
    from swapsched.agents.blocks import CHOICES

    n_eval = n_eval_traces * len(config.eval["budgets"]) * len(config.eval["hardware"])
    return [
        (f"PPO, {timesteps:,} steps on {n_ppo_traces} traces", PPO_START_S + timesteps / PPO_STEPS_PER_S),
        (f"move prior, {config.prior_cases_per_trace} search(es) of {config.prior_seconds:.2g} s per trace",
         n_search_traces * config.prior_cases_per_trace * config.prior_seconds),
        (f"plan editor, {config.editor_cases_per_trace} search(es) of {config.editor_seconds:.2g} s per trace, "
         f"then {config.editor_rl_iterations} REINFORCE iterations",
         n_search_traces * config.editor_cases_per_trace * config.editor_seconds
         + config.editor_rl_iterations * EDITOR_RL_ITERATION_S),
        (f"block chooser, {config.blocks_cases_per_trace} case(s) per trace with blocks, {config.blocks_members} network(s)",
         n_search_traces * config.blocks_cases_per_trace * len(CHOICES) / CHOOSER_SIMULATIONS_PER_S
         + config.blocks_members * CHOOSER_FIT_S),
        (f"held-out evaluation, {n_eval} cases", n_eval * EVALUATION_CASE_S),
    ]


def load_train_config(path: str | Path) -> TrainConfig:
    p = Path(path)
    data = read_yaml(p, TrainConfigError) or {}
    if not isinstance(data, dict):
        raise TrainConfigError(f"{p}: expected a mapping of fields, got {type(data).__name__}")
    known = set(TrainConfig.__dataclass_fields__)
    unknown = set(data) - known
    if unknown:
        raise TrainConfigError(f"{p}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    if "budget_range" in data:
        data["budget_range"] = tuple(float(x) for x in data["budget_range"])
    for k in ("hardware", "validation_families", "search_extra_splits"):
        if k in data:
            data[k] = tuple(data[k])
    for k in ("total_timesteps", "n_envs", "eval_every", "prior_cases_per_trace", "editor_cases_per_trace",
              "editor_rl_iterations", "blocks_cases_per_trace", "blocks_hidden", "blocks_members"):
        if k in data and (not isinstance(data[k], int) or data[k] <= 0):
            raise TrainConfigError(f"{p}: field {k}: expected a positive integer, got {data[k]!r}")
    return TrainConfig(**data)


@dataclass(frozen=True)
class TrainResult:
    """What ``train_policy`` wrote and measured."""

    checkpoint: Path
    card: Path
    best_checkpoint: Path | None
    timesteps: int
    train_seconds: float
    interrupted: bool
    held_out: HeldOut | None  # None when training was interrupted (no evaluation ran)
    #: the phase an interrupted run stopped in ("ppo", "search parts", "evaluation"), None if it finished
    stopped_in: str | None = None


@dataclass(frozen=True)
class HeldOut:
    """The trained policy and the baselines on the held-out traces (simulated)."""

    traces: tuple[str, ...]
    budgets: tuple[str, ...]
    hardware: tuple[str, ...]
    summary: tuple[PolicySummary, ...]
    #: the learned parts alone (greedy) over the searched plan and over the best baseline, and the
    #: searched plan over the best baseline (issue 36's figures)
    ratios: tuple[StepRatio, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"traces": list(self.traces), "budgets": list(self.budgets), "hardware": list(self.hardware),
                "summary": [s.to_dict() for s in self.summary],
                "ratios": [r.to_dict() for r in self.ratios]}  # NaN becomes null as the card is written


def _callbacks(total: int, progress: bool, config: TrainConfig, out: Path, validation: list, extra: list) -> Any:
    """SB3 callbacks: a tqdm bar over timesteps (SB3's own needs rich); every ``eval_every`` steps
    the greedy policy on the validation traces against min (a short table, TensorBoard scalars,
    the best checkpoint kept as ``NAME.best.zip``)."""
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList
    from tqdm import tqdm

    hws = [load_hardware(h) for h in config.eval["hardware"]]

    class Bar(BaseCallback):
        def _on_training_start(self) -> None:
            self.bar = tqdm(total=total, initial=0, unit="step", disable=not progress, dynamic_ncols=True, desc="training")

        def _on_step(self) -> bool:
            self.bar.update(self.training_env.num_envs)
            return True

        def _on_training_end(self) -> None:
            self.bar.close()

    class Validate(BaseCallback):
        best = math.inf
        next_at = 0

        def _on_training_start(self) -> None:
            self.next_at = self.num_timesteps + config.eval_every

        def _on_step(self) -> bool:
            if not validation or self.num_timesteps < self.next_at:
                return True
            self.next_at += config.eval_every
            ratio = validation_ratio(self.model, validation, config.eval["budgets"], hws)
            self.logger.record("eval/ratio_to_min", ratio)
            if progress:
                tqdm.write(f"step {self.num_timesteps:>9,}  validation step time / min's (geomean): {ratio:.4f}"
                           + ("  (best so far, kept)" if ratio < self.best else ""))
            if ratio < self.best:
                self.best = ratio
                _save_atomic(self.model, out.with_name(out.stem + ".best.zip"))
            return True

    return CallbackList([Bar(), Validate(), *extra])


def validation_ratio(model: Any, traces: list, budgets: list[str], hws: list) -> float:
    """Geometric mean over traces x budgets x hardware of the greedy plan's simulated step over min's
    (an OOM counts as 10x); the number the best checkpoint is chosen by."""
    from swapsched.env.simulator import simulate

    logs = []
    for tr, _, budget, hw in feasible_cases(traces, budgets, hws):
        ref = simulate(tr, Belady().plan(tr, budget, hw), hw, budget, validate=False)
        mine = simulate(tr, greedy_rollout(model, tr, budget, hw, "validation"), hw, budget, validate=False)
        ratio = 10.0 if mine.oom else mine.iteration_s / ref.iteration_s if not ref.oom else 1.0
        logs.append(math.log(ratio))
    return math.exp(sum(logs) / len(logs)) if logs else math.nan


def _save_atomic(model: Any, path: Path) -> None:
    """Write a checkpoint to a temporary file, then rename it: a crash never leaves half a file."""
    with atomic_path(path) as tmp:
        model.save(str(tmp))


@dataclass(frozen=True)
class SearchParts:
    """What ``train_search`` wrote, what it learned from and how long it took."""

    prior: Path
    editor: Path
    chooser: Path
    splits: tuple[str, ...]
    traces: int
    seconds: float

    @property
    def paths(self) -> tuple[Path, Path, Path]:
        return self.prior, self.editor, self.chooser

    def card_entry(self) -> dict[str, Any]:
        return {"splits": list(self.splits), "traces": self.traces, "seconds": self.seconds}


def train_search(config: TrainConfig, checkpoint: str | Path, *, progress: bool = True, card: bool = True) -> SearchParts:
    """Learn, on the training traces (validation families held out), the search's move prior, then
    the plan editor (imitating searches that use the prior, then fine-tuned by REINFORCE on the
    simulator) and the block chooser (from every choice's simulated outcome), and save them beside
    ``checkpoint`` as ``NAME.moves.npz``, ``NAME.editor.npz`` and ``NAME.blocks.npz``; a card
    ``NAME.json`` beside it gets their ``search_parts`` entry (splits, traces, seconds) unless
    ``card=False`` (``train_policy``, which writes the whole card afterwards)."""
    from swapsched.env.corpus import corpus_index, load_corpus

    t0 = time.perf_counter()
    family = {r["name"]: r["family"] for r in corpus_index()}
    splits = (config.corpus_split, *config.search_extra_splits)
    pools = {split: load_corpus(split=split) for split in splits}
    empty = [split for split, got in pools.items() if not got]
    if empty:
        raise TrainConfigError(f"no corpus traces in split(s) {empty}; the corpus has train, test and generated "
                               "(rebuild it with: python scripts/build_traces.py)")
    traces = [t for got in pools.values() for t in got if family.get(t.name) not in config.validation_families]
    hws = [load_hardware(h) for h in config.hardware]
    tried, improved = guide.collect(traces, hws, cases_per_trace=config.prior_cases_per_trace,
                                    seconds=config.prior_seconds, seed=config.seed, progress=progress)
    prior = guide.fit(tried, improved)
    prior_file = prior.save(guide.prior_path(Path(checkpoint)))
    x, y = editor.collect(traces, hws, cases_per_trace=config.editor_cases_per_trace, seconds=config.editor_seconds,
                          seed=config.seed + 1, prior=prior, progress=progress)
    ed = editor.fit(x, y, keep_weight=config.editor_keep_weight, seed=config.seed)
    ed = editor.finetune(ed, traces, hws, iterations=config.editor_rl_iterations, seed=config.seed, progress=progress)
    editor_file = ed.save(editor.editor_path(Path(checkpoint)))
    x, costs = blocks.collect(traces, hws, cases_per_trace=config.blocks_cases_per_trace, seed=config.seed + 2,
                              progress=progress)
    ch = blocks.fit(x, costs, hidden=config.blocks_hidden, seed=config.seed, members=config.blocks_members)
    parts = SearchParts(prior_file, editor_file, ch.save(blocks.chooser_path(Path(checkpoint))), splits, len(traces),
                        round(time.perf_counter() - t0, 1))
    card_path = Path(checkpoint).with_suffix(".json")
    if card and card_path.is_file():
        write_json({**json.loads(card_path.read_text()), "search_parts": parts.card_entry()}, card_path, indent=1)
    return parts


def train_policy(config: TrainConfig, out: str | Path, *, progress: bool = True, timesteps: int | None = None,
                 resume: str | Path | None = None, tensorboard: str | Path | None = None,
                 callbacks: list | None = None) -> TrainResult:
    """Train, save ``out`` (.zip) and its card (``out`` with .json: code version, config, families,
    seed, wall time, held-out table). ``resume``: continue a checkpoint (step count, optimizer state
    and learning-rate schedule). Ctrl-C (KeyboardInterrupt) saves the checkpoint reached and returns
    with ``interrupted=True``."""
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    from swapsched.env.corpus import corpus_index, load_corpus
    from swapsched.env.swap_env import SwapEnv

    torch.set_num_threads(1)  # the MLP is small: one thread is fastest and leaves the other cores free
    out = Path(out)
    if out.suffix != ".zip":
        out = out.with_suffix(".zip")
    index = corpus_index()
    family = {r["name"]: r["family"] for r in index}
    pool = load_corpus(split=config.corpus_split)
    traces = [t for t in pool if family.get(t.name) not in config.validation_families]
    validation = [t for t in pool if family.get(t.name) in config.validation_families]
    if not traces:
        raise TrainConfigError(f"no training traces left after holding out {list(config.validation_families)}")
    hws = [load_hardware(h) for h in config.hardware]

    def make(i: int):
        return lambda: SwapEnv(traces=traces, hardware=hws, budget_range=config.budget_range)

    fns = [make(i) for i in range(config.n_envs)]
    venv = SubprocVecEnv(fns, start_method="fork") if config.n_envs > 1 else DummyVecEnv(fns)
    venv.seed(config.seed)
    tb = str(tensorboard) if tensorboard else None
    if resume is not None:
        path = resolve_checkpoint(resume)
        # spaces from the environment, schedules from the card's config: nothing unpickled
        model = load_ppo(path, venv, card=check_card(path), device="cpu", tensorboard_log=tb)
    else:
        ppo = dict(config.ppo)
        net_arch = ppo.pop("net_arch", [128, 128])
        model = MaskablePPO("MlpPolicy", venv, seed=config.seed, device="cpu", verbose=0, tensorboard_log=tb,
                            policy_kwargs={"net_arch": list(net_arch)}, **ppo)
    total = timesteps or config.total_timesteps
    rollout = int(model.n_steps * model.n_envs)
    if total % rollout:
        # PPO updates after whole rollouts: learn() runs on to the next multiple
        print(f"note: PPO learns in whole rollouts of n_steps x n_envs = {rollout} steps; {total} requested, "
              f"{-(-total // rollout) * rollout} will run", file=sys.stderr)
    start_steps = model.num_timesteps
    # the search parts' traces, counted from the index (train_search loads them when it runs)
    search_splits = (config.corpus_split, *config.search_extra_splits)
    search_traces = sum(1 for r in index if r["split"] in search_splits and r["family"] not in config.validation_families)
    n_eval_traces = sum(1 for r in index if r["split"] == "test")
    phases = phase_plan(config, len(traces), search_traces, -(-total // rollout) * rollout, n_eval_traces)
    print("phases (about, on 2 cores): " + "; ".join(f"{i}/{len(phases)} {what}" + (f" ~{_duration(s)}" if s else "")
                                                     for i, (what, s) in enumerate(phases, 1)), file=sys.stderr)
    t0 = time.perf_counter()
    stopped_in: str | None = None
    try:
        model.learn(total_timesteps=total, callback=_callbacks(total, progress, config, out, validation, callbacks or []),
                    reset_num_timesteps=resume is None, tb_log_name=out.stem)
    except KeyboardInterrupt:
        stopped_in = "ppo"
    finally:
        venv.close()
    _save_atomic(model, out)
    parts = results = None
    best = out.with_name(out.stem + ".best.zip")
    held_out = load_corpus(split="test")
    ev = config.eval
    if stopped_in is None:
        # an interruption from here on leaves the PPO checkpoint whole, and a card that says where it stopped
        try:
            stopped_in = "search parts"
            parts = train_search(config, out, progress=progress, card=False)
            stopped_in = "evaluation"
            results = evaluate([LearnedPolicy(out, mode="greedy"), LearnedPolicy(out, mode="search")], held_out,
                               ev["budgets"], [load_hardware(h) for h in ev["hardware"]], ev.get("baselines", []),
                               progress=progress)
            stopped_in = None
        except KeyboardInterrupt:
            pass
    interrupted = stopped_in is not None
    train_s = time.perf_counter() - t0
    card = {
        "checkpoint": out.name,
        "env_version": ENV_VERSION,
        "algorithm": "MaskablePPO (sb3-contrib)",
        "timesteps": int(model.num_timesteps),
        "timesteps_this_run": int(model.num_timesteps - start_steps),
        "timesteps_requested": int(total),
        "resumed_from": str(resume) if resume is not None else None,
        "interrupted": interrupted,
        "stopped_in": stopped_in,
        "seed": config.seed,
        "train_seconds": round(train_s, 1),
        "config": asdict(config),
        "trained_on": [t.name for t in traces],
        "training_families": sorted({family[t.name] for t in traces}),
        "validation_families": list(config.validation_families),
        "held_out": results.to_dict() if results is not None else {},
        "search_parts": parts.card_entry() if parts is not None else {},
    }
    card_path = out.with_suffix(".json")
    write_json(card, card_path, indent=1)
    return TrainResult(out, card_path, best if best.is_file() else None, int(model.num_timesteps), train_s,
                       interrupted, results, stopped_in)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def evaluate(policies: list, traces: list, budgets: list[str], hardware: list, baselines: list[str], *,
             progress: bool = False) -> HeldOut:
    """Mean overhead and OOMs of the trained ``policies`` (the learned parts alone, then the searched
    planner) and each baseline over traces x budgets x hardware; and each policy's step over the
    next one's and over the best baseline's, case by case."""

    names = [p.name for p in policies]
    rows = compare(traces, budgets, hardware, [*policies, *baselines], progress=progress)
    ratios = [step_ratio(rows, a, [b]) for a, b in zip(names, names[1:], strict=False)]  # each over the next
    if baselines:
        ratios += [step_ratio(rows, p, baselines) for p in names]
    return HeldOut(tuple(t.name for t in traces), tuple(budgets), tuple(h.name for h in hardware),
                   tuple(summarize(rows, [*names, *baselines])), tuple(ratios))
