"""env/swap_env.py: the gymnasium adapter over the simulator."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env

from swapsched.budget import BudgetError
from swapsched.env.corpus import load_corpus
from swapsched.env.simulator import simulate
from swapsched.env.swap_env import N_FEATURES, SwapEnv
from swapsched.plan import Eviction, SwapPlan
from tests.conftest import make_hw, make_trace


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(split="train")


def test_gymnasium_check_env(corpus):
    gym_check_env(SwapEnv(traces=corpus[:6]), skip_render_check=True)


def test_sb3_check_env(corpus):
    from stable_baselines3.common.env_checker import check_env

    check_env(SwapEnv(traces=corpus[:6]), warn=True)


def test_registered_id():
    env = gym.make("swapsched/Swap-v0", traces=load_corpus(split="train")[:2])
    obs, _ = env.reset(seed=1)
    assert obs.shape == (N_FEATURES,)


def test_seeded_resets_are_reproducible(corpus):
    a, b = SwapEnv(traces=corpus), SwapEnv(traces=corpus)
    for seed in range(5):
        oa, ia = a.reset(seed=seed)
        ob, ib = b.reset(seed=seed)
        assert ia == ib and np.array_equal(oa, ob)


def _rollout(env, choose, seed=0, options=None):
    obs, info = env.reset(seed=seed, options=options)
    total, done = 0.0, False
    while not done:
        mask = env.action_masks()
        a = choose(mask, obs)
        assert mask[a], "agent chose a masked action"
        obs, r, term, trunc, info = env.step(a)
        assert env.observation_space.contains(obs)
        total += r
        done = term or trunc
    return total, info


def test_return_is_minus_overhead_and_matches_simulate(corpus):
    env = SwapEnv(traces=corpus)
    rng = np.random.default_rng(0)
    for seed in range(10):
        total, info = _rollout(env, lambda m, o: int(rng.choice(np.flatnonzero(m))), seed=seed)
        plan = SwapPlan.of(env.trace, "env", env.evictions)
        r = simulate(env.trace, plan, env.hw, env.budget)
        if r.oom:
            assert total <= -env.oom_penalty + 1e-9 and "oom_event" in info
        else:
            assert total == pytest.approx(-r.overhead, abs=1e-9) and info["overhead"] == pytest.approx(r.overhead)


def test_return_includes_the_copies_host_costs(corpus):
    """With host costs in the profile (a calibrated one), the return is still minus the overhead:
    the stall alone would leave them out."""
    from dataclasses import replace

    from swapsched.hardware import load_hardware

    hw = replace(load_hardware("cpu-emulated"), copy_issue_s=1e-4, copy_host_s_per_byte=1e-10, wait_resume_s=2e-5)
    env = SwapEnv(traces=corpus[:4], hardware=[hw], budget_range=(0.3, 0.5))
    rng = np.random.default_rng(2)
    for seed in range(4):
        total, info = _rollout(env, lambda m, o: int(rng.choice(np.flatnonzero(m))), seed=seed)
        r = simulate(env.trace, SwapPlan.of(env.trace, "env", env.evictions), env.hw, env.budget)
        assert r.host_s > 0 and total == pytest.approx(-r.overhead, abs=1e-9)


def test_keep_is_masked_when_it_cannot_fit():
    # Two 100 B tensors alive together, budget 150: keeping T0 leaves no room for T1 (certain OOM).
    tr = make_trace([100, 100], [("pack", 0, 1), ("pack", 1, 1), ("unpack", 1, 1), ("unpack", 0, 1)])
    env = SwapEnv(traces=[tr], hardware=[make_hw()])
    env.reset(options={"trace": 0, "hardware": 0, "budget_bytes": 150})
    mask = env.action_masks()
    assert env.tensor == 0 and not mask[0] and mask[1]
    env.reset(options={"trace": 0, "hardware": 0, "budget_bytes": 200})
    assert env.action_masks().all()


def _held_after_swap_out(tr, released_at: dict[int, int]):
    """``tr`` with tensors held by the program through a later gap than their last pack (R2)."""
    from dataclasses import replace

    tensors = tuple(replace(t, released_at=released_at.get(t.id)) for t in tr.tensors)
    return replace(tr, tensors=tensors)


def test_an_early_prefetch_counts_beside_the_original_the_program_still_holds():
    # T0, T1 of 100 B: e0 pack0 @1, e1 pack1 @1, e2 unpack1, e3 unpack0; the program holds T0
    # through gap 1 (it computes T1 from it: released_at 1). Budget 250.
    # Evicting T0 at e0 with its prefetch at e0 (action 6): the swap-in buffer is allocated at e0,
    # so gap 1 holds T0 (the program's), its swap-in buffer and T1 = 300 > 250: an OOM, since the
    # swap-out frees nothing while the program holds T0. Keeping T0 holds 200 at gap 1; evicting
    # on demand holds 200 too. Only the earliest prefetch may be refused.
    tr = _held_after_swap_out(make_trace([100, 100], [("pack", 0, 1), ("pack", 1, 1), ("unpack", 1, 1), ("unpack", 0, 1)]),
                              {0: 1})
    hw = make_hw()
    env = SwapEnv(traces=[tr], hardware=[hw])
    env.reset(options={"trace": 0, "hardware": 0, "budget_bytes": 250})
    mask = env.action_masks()
    assert env.tensor == 0 and mask[0] and mask[1] and not mask[6]
    assert simulate(tr, [Eviction(0, 0, 0)], hw, 250).oom  # what the refused action would do
    assert not simulate(tr, [Eviction(0, 0, 3)], hw, 250).oom


def test_an_agent_following_the_mask_never_ooms_where_the_program_holds_tensors_late(corpus):
    """As below, on traces whose tensors are released gaps after their last pack, as the runtime
    measures them (the corpus's are released at their last pack)."""
    rng = np.random.default_rng(2)
    traces = []
    for tr in corpus[:8]:
        late = {t: int(min(tr.last_forward_pack[t] + rng.integers(0, 4), tr.first_unpack[t] - 1))
                for t in range(tr.n_tensors) if rng.random() < 0.5}
        traces.append(_held_after_swap_out(tr, late))
    env = SwapEnv(traces=traces, budget_range=(0.01, 0.6))
    for seed in range(60):
        _, info = _rollout(env, lambda m, o: int(rng.choice(np.flatnonzero(m))), seed=seed)
        assert "oom_event" not in info, (env.trace.name, env.budget)


def test_an_agent_following_the_mask_never_ooms(corpus):
    """The mask's account is sound: random masked actions, at tight budgets, never OOM."""
    env = SwapEnv(traces=corpus, budget_range=(0.01, 0.5))
    rng = np.random.default_rng(1)
    for seed in range(60):
        total, info = _rollout(env, lambda m, o: int(rng.choice(np.flatnonzero(m))), seed=seed)
        assert "oom_event" not in info, (env.trace.name, env.budget)
        assert info["overhead"] == pytest.approx(-total)
    for seed in range(10):  # greedy keeper: keep whenever offered
        _, info = _rollout(env, lambda m, o: 0 if m[0] else 1, seed=seed)
        assert "oom_event" not in info


def test_budget_below_feasible_is_an_error(corpus):
    env = SwapEnv(traces=corpus[:1])
    with pytest.raises(BudgetError, match="smallest feasible"):
        env.reset(options={"trace": 0, "budget_bytes": 1})


def test_bad_action_is_rejected(corpus):
    env = SwapEnv(traces=corpus[:1])
    env.reset(seed=0)
    with pytest.raises(ValueError, match="outside"):
        env.step(99)


def test_decision_table_places_prefetches_like_lead_eviction(corpus):
    """The env's vectorised placement is swapsched.plan.lead_eviction, tensor by tensor."""
    from swapsched.env.swap_env import _decision_table
    from swapsched.hardware import load_hardware
    from swapsched.plan import LEADS, lead_eviction

    for tr in corpus[:8]:
        for hw in (load_hardware("h100-pcie5"), load_hardware("cpu-emulated")):
            table = _decision_table(tr, hw)
            for p, k in enumerate(table.order):
                for lead in range(len(LEADS)):
                    ev = lead_eviction(tr, k, lead, hw)
                    assert (table.swap_out[p], table.prefetch[p][lead]) == (ev.swap_out_at, ev.prefetch_at)
