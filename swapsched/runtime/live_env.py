"""LiveSwapEnv: SwapEnv whose episodes end in a real training step on the device.

A policy trained in the simulator can be fine-tuned here on measured steps: the decisions are
made exactly as in :class:`~swapsched.env.swap_env.SwapEnv` (same observations, same action masks,
over the trace this device just measured), and when the last tensor is decided the plan is executed
by :class:`~swapsched.runtime.swapper.PolicyRuntime` in real training steps of the given model.

It lives with the runtime, which it drives; the simulator and ``SwapEnv`` never import torch.
"""

from __future__ import annotations

import statistics
from typing import Any

import gymnasium as gym
import numpy as np

from swapsched.env.swap_env import SwapEnv
from swapsched.errors import UserError, present
from swapsched.plan import SwapPlan
from swapsched.runtime.swapper import PolicyRuntime
from swapsched.zoo import ModelCase, build_model

__all__ = ["LiveSwapEnv"]


class LiveSwapEnv(gym.Env):
    """Swap decisions over a measured trace, rewarded by a measured training step.

    ## Action Space, Observation Space, Action masks
    As :class:`SwapEnv` (``Discrete(7)``, ``Box(0, 1, (13,))``), on the trace profiled from
    ``model`` by the runtime at construction, under ``budget`` on the runtime's hardware profile.

    ## Rewards
    0 for every decision but the last; the last decision's reward is minus the *measured* overhead:
    the median of ``steps_per_episode`` real steps executing the plan, over the median plain step
    of the same model (measured at construction), minus 1. So the episode return is minus the
    measured overhead. ``info`` of the last step has ``measured_step_s``, ``plain_step_s``,
    ``predicted_step_s`` (the simulator's), ``peak_device_bytes``, ``budget_bytes`` and ``plan_followed``.

    ## Starting State
    Every episode is the same case (one model, one budget, one device).

    ## Episode End
    Terminated after the last tensor's decision and the measured steps. Never truncated.
    """

    metadata = {"render_modes": []}

    def __init__(self, model: str | ModelCase = "mlp", *, size: str | None = "tiny", budget: str = "50%",
                 backend: str = "cpu", bandwidth: float | None = None, hardware: str | None = None,
                 steps_per_episode: int = 3, plain_steps: int = 5):
        super().__init__()
        device = "cuda" if backend == "cuda" else "cpu"
        self.case = model if isinstance(model, ModelCase) else build_model(model, size, device=device)
        # unhook=False: every plan's step is measured as the simulator predicts it, hooks included
        self.runtime = PolicyRuntime(budget=budget, policy=None, backend=backend, bandwidth=bandwidth,
                                     hardware=hardware, model=self.case.model, unhook=False)
        for _ in range(self.runtime.profile_steps):
            self._train_step(self.runtime.step)
        if self.runtime.trace is None:
            raise UserError(f"{self.case.name}: its training step saved no tensor for backward: nothing to swap")
        self.plain_step_s = statistics.median(self._train_step(None) for _ in range(plain_steps))
        self.steps_per_episode = int(steps_per_episode)
        self.sim_env = SwapEnv(traces=[self.runtime.trace], hardware=[self.runtime.hardware])
        self.action_space = self.sim_env.action_space
        self.observation_space = self.sim_env.observation_space

    def _train_step(self, wrap: Any) -> float:
        _, seconds = self.case.timed_step(wrap)
        self.case.model.zero_grad(set_to_none=True)  # the weights never change: every episode is the same step
        return seconds

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return self.sim_env.reset(seed=seed, options={"trace": 0, "hardware": 0,
                                                      "budget_bytes": self.runtime.budget_bytes})

    def action_masks(self) -> np.ndarray:
        return self.sim_env.action_masks()

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, _, terminated, truncated, info = self.sim_env.step(action)
        if not terminated:
            return obs, 0.0, False, False, info
        plan = SwapPlan.of(present(self.runtime.trace, "the profiled trace"), "live-env", self.sim_env.evictions)
        self.runtime.use_plan(plan)
        measured = statistics.median(self._train_step(self.runtime.step) for _ in range(self.steps_per_episode))
        rep = self.runtime.report()
        info = {**info, "measured_step_s": measured, "plain_step_s": self.plain_step_s,
                "predicted_step_s": self.runtime.predicted_s, "peak_device_bytes": rep.peak_device_bytes,
                "budget_bytes": rep.budget_bytes, "plan_followed": rep.plan_followed}
        return obs, -(measured / self.plain_step_s - 1.0), True, False, info

    def close(self) -> None:
        self.runtime.close()
