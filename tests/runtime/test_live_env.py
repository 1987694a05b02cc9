"""runtime/live_env.py: episodes that end in a real step on the CPU backend."""

from __future__ import annotations

import numpy as np

from swapsched.runtime.live_env import LiveSwapEnv


def test_a_few_live_episodes_with_random_masked_actions():
    env = LiveSwapEnv("mlp", size="tiny", budget="85%", backend="cpu", bandwidth=2e9, steps_per_episode=2)
    rng = np.random.default_rng(0)
    try:
        for seed in range(3):
            obs, _ = env.reset(seed=seed)
            assert env.observation_space.contains(obs)
            done, total = False, 0.0
            while not done:
                mask = env.action_masks()
                obs, r, term, trunc, info = env.step(int(rng.choice(np.flatnonzero(mask))))
                total += r
                done = term or trunc
            assert info["measured_step_s"] > 0 and info["plain_step_s"] > 0 and total < 1.0
            # the runtime executed exactly the plan the episode decided, and moved its bytes
            assert env.runtime.plan.evictions == tuple(sorted(env.sim_env.evictions))
            rep = env.runtime.report()
            assert rep.mode == "execute" and info["plan_followed"]
            trace = env.runtime.trace
            assert rep.evicted_bytes == sum(trace.tensors[e.tensor].bytes for e in env.runtime.plan.evictions)
            assert info["peak_device_bytes"] <= info["budget_bytes"]
    finally:
        env.close()
