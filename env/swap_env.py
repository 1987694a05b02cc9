"""SwapEnv: the gymnasium environment the swap policy learns in; a thin adapter over the simulator."""

from __future__ import annotations

import math
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from swapsched.budget import BudgetError, parse_budget
from swapsched.env.simulator import Simulation
from swapsched.hardware import Hardware, load_hardware
from swapsched.plan import LEADS, Eviction, lead_eviction
from swapsched.trace import Trace

__all__ = ["SwapEnv", "N_FEATURES", "DEFAULT_HARDWARE"]

N_FEATURES = 13
DEFAULT_HARDWARE = ("v100-pcie3", "a100-pcie4", "h100-pcie5", "rtx4090-pcie4")


class SwapEnv(gym.Env):
    """Decide, tensor by tensor, which saved activations to evict and when to prefetch them.

    ## Description
    One episode is one training step of one trace under one device-memory budget on one hardware
    profile. The agent sees the saved tensors in the order their swap-out would be issued (their last
    forward pack, ties by id) and decides for each: keep it on the device, or evict it and prefetch
    it with a chosen lead. The discrete-event simulator (``swapsched.env.simulator``, rules R1-R8)
    executes the decisions as they are made, so the state includes what the copy engines are doing.

    Why this action shape: one decision per tensor keeps the episode length equal to the number of
    saved tensors (tens to hundreds), and expressing the prefetch lead in transfer times *of that
    tensor* makes the same action mean the same thing on a 4 KiB and a 4 GiB tensor, on PCIe 3 and on
    NVLink-C2C, so the action space is fixed across traces and a policy transfers between models.

    ## Action Space
    ``Discrete(1 + len(LEADS))`` = ``Discrete(7)``:

    | action | meaning |
    | --- | --- |
    | 0 | keep the tensor resident |
    | 1 | evict at its last forward pack; bring it back on demand at its first unpack (no prefetch) |
    | 2..5 | evict; prefetch at the latest event at least 1, 2, 4, 8 of its host->device transfer times before its first unpack (ideal timing) |
    | 6 | evict; prefetch as early as possible (right after the swap-out is issued) |

    ``action_masks()`` (sb3-contrib's MaskablePPO protocol) keeps a per-gap account of the bytes the
    decisions so far put on the device: what every plan must hold (R7), the tensors kept, and each
    evicted tensor from its prefetch event to its first unpack. An action is offered only if adding
    this tensor over the gaps it would occupy (kept: until its first unpack; evicted: from its
    prefetch) keeps that account within the budget. Swap-outs still in flight are the only other
    memory, and compute waits for those (R4), so **an agent that follows the mask never causes an
    OOM**. Evicting on demand (action 1) occupies no extra gap and is always offered.

    ## Observation Space
    ``Box(0, 1, (13,), float32)``; every feature is bounded by construction, no running statistics:

    | # | feature | unit / normalisation |
    | --- | --- | --- |
    | 0 | tensor bytes | / (budget - static bytes), clipped to 1 |
    | 1 | tensor bytes | / largest tensor of the trace |
    | 2 | free interval vs round trip | x / (1 + x), x = ideal time from swap-out to first unpack / (d2h + h2d time) |
    | 3 | free interval | / ideal step time |
    | 4 | position in the step | ideal time of the swap-out event / ideal step time |
    | 5 | device memory now | simulated bytes / budget, clipped to 1 |
    | 6 | projected peak if kept | lower-bound peak over the rest of the step / budget, / 2 and clipped to 1 |
    | 7 | bytes still to evict | (peak if every undecided tensor stays - budget)+ / (budget - static), clipped to 1 |
    | 8 | device->host backlog | seconds until the engine is idle / ideal step, clipped to 1 |
    | 9 | host->device backlog | seconds until the engine is idle / ideal step, clipped to 1 |
    | 10 | stall so far | seconds / ideal step, clipped to 1 |
    | 11 | budget | (budget - static) / (no-swap peak - static) |
    | 12 | progress | decisions made / tensors |

    ## Rewards
    After each decision the simulation runs to the next decision point; the reward is minus the
    stall it added, divided by the ideal step time. An OOM gives ``-oom_penalty`` (default 10) and ends
    the episode. Without OOM the episode return is therefore minus the step's overhead (R8).

    ## Starting State
    ``reset`` draws a trace, a hardware profile and a budget fraction (uniform in ``budget_range``,
    raised to the smallest feasible budget) with ``self.np_random``. ``options`` may fix each:
    ``{"trace": index, "hardware": index, "budget": "60%" | bytes-string, "budget_bytes": int}``.

    ## Episode End
    Terminated when the last tensor is decided and the step has been simulated to its end, or at an
    OOM. Never truncated: an episode has exactly as many steps as the trace has tensors, or fewer.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        traces: Sequence[Trace] | None = None,
        hardware: Sequence[Hardware | str] | None = None,
        budget_range: tuple[float, float] = (0.3, 0.9),
        oom_penalty: float = 10.0,
    ):
        super().__init__()
        if traces is None:
            from swapsched.env.corpus import load_corpus

            traces = load_corpus(split="train")
        if not traces:
            raise ValueError("SwapEnv needs at least one trace")
        self.traces = list(traces)
        self.hardware = [load_hardware(h) for h in (hardware or DEFAULT_HARDWARE)]
        lo, hi = budget_range
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"budget_range must satisfy 0 < low <= high <= 1, got {budget_range}")
        self.budget_range = (float(lo), float(hi))
        self.oom_penalty = float(oom_penalty)
        self.action_space = spaces.Discrete(1 + len(LEADS))
        self.observation_space = spaces.Box(0.0, 1.0, (N_FEATURES,), dtype=np.float32)
        self.evictions: list[Eviction] = []

    # ------------------------------------------------------------------ episode set-up
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        options = options or {}
        rng = self.np_random
        ti = options.get("trace", int(rng.integers(len(self.traces))))
        hi = options.get("hardware", int(rng.integers(len(self.hardware))))
        tr, hw = self.traces[ti], self.hardware[hi]
        if "budget_bytes" in options:
            budget = int(options["budget_bytes"])
            if budget < tr.min_feasible_bytes:
                raise BudgetError(f"budget {budget} is below the smallest feasible {tr.min_feasible_bytes} for {tr.name!r}")
        elif "budget" in options:
            budget = parse_budget(options["budget"], tr)
        else:
            above = tr.peak_bytes_no_swap - tr.static_bytes
            frac = rng.uniform(*self.budget_range)
            budget = max(int(tr.static_bytes + frac * above), tr.min_feasible_bytes)
        self._start(tr, hw, budget)
        return self._obs(), self._info()

    def _start(self, tr: Trace, hw: Hardware, budget: int) -> None:
        self.trace, self.hw, self.budget = tr, hw, budget
        self.sim = Simulation(tr, hw, budget)
        self.ideal = tr.ideal_s + hw.hook_cost_s * tr.n_events
        b = tr.tensor_bytes
        self.order = np.lexsort((np.arange(tr.n_tensors), tr.last_forward_pack)).tolist()
        self.pos = 0
        self.evictions = []
        self.room = max(budget - tr.static_bytes, 1)
        self.max_bytes = max(int(b.max()), 1)
        base = tr.static_bytes + tr.other_bytes
        self.lower = (base + tr.must_resident_bytes).astype(np.int64)  # every plan holds at least this
        self.if_kept = (base + tr.resident_bytes_no_swap).astype(np.int64)  # undecided tensors all kept
        self.times = tr.event_times
        self.last_stall = 0.0
        self.result = None
        self._cand_pos = -1
        self.above = max(tr.peak_bytes_no_swap - tr.static_bytes, 1)
        self._advance()

    # ------------------------------------------------------------------ the current decision
    @property
    def tensor(self) -> int:
        return self.order[self.pos]

    def _keep_range(self, k: int) -> tuple[int, int]:
        """Gaps where keeping ``k`` adds to the lower bound: after its last forward pack, before its first unpack."""
        return int(self.trace.last_forward_pack[k]) + 1, int(self.trace.first_unpack[k])

    def _candidates(self) -> tuple[list[Eviction], list[tuple[int, int]]]:
        """The evictions actions 1.. would make for the current tensor, and the gaps each action
        would add the tensor to the account (see action_masks), computed once per decision."""
        if self._cand_pos != self.pos:
            k = self.tensor
            evs = [lead_eviction(self.trace, k, l, self.hw) for l in range(len(LEADS))]
            a, z = self._keep_range(k)
            self._cand = (evs, [(a, z)] + [(max(e.prefetch_at, a), z) for e in evs])
            self._cand_pos = self.pos
        return self._cand

    def action_masks(self) -> np.ndarray:
        mask = np.ones(self.action_space.n, dtype=bool)
        if self.pos >= len(self.order):
            return mask
        b = int(self.trace.tensor_bytes[self.tensor])
        room = self.budget - b
        lower = self.lower
        for i, (a, z) in enumerate(self._candidates()[1]):
            if z > a and lower[a:z].max() > room:
                mask[i] = False
        return mask

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        action = int(action)
        if not self.action_space.contains(action):
            raise ValueError(f"action {action} outside {self.action_space}")
        if self.pos >= len(self.order):
            raise RuntimeError("step() after the episode ended; call reset()")
        k = self.tensor
        b = int(self.trace.tensor_bytes[k])
        evs, spans = self._candidates()
        a, z = spans[action]
        self.lower[a:z] += b
        if action > 0:
            ev = evs[action - 1]
            self.sim.schedule(ev.tensor, ev.swap_out_at, ev.prefetch_at)
            self.evictions.append(ev)
            ka, kz = spans[0]
            self.if_kept[ka:kz] -= b
        self.pos += 1
        self._advance()
        if self.sim.oom_event is not None:
            return self._obs(), -self.oom_penalty, True, False, self._info()
        stall = self.sim.stall_s
        reward = -(stall - self.last_stall) / self.ideal
        self.last_stall = stall
        terminated = self.pos >= len(self.order)
        return self._obs(), float(reward), terminated, False, self._info()

    def _advance(self) -> None:
        """Run the simulation to the next decision point, or to the end of the step."""
        if self.pos < len(self.order):
            self.sim.run_until(int(self.trace.last_forward_pack[self.tensor]))
        else:
            self.result = self.sim.finish()

    def _obs(self) -> np.ndarray:
        o = np.zeros(N_FEATURES, dtype=np.float32)
        sim, tr = self.sim, self.trace
        ideal = self.ideal
        o[5] = min((sim.static + sim.cur_other + sim.used) / self.budget, 1.0)
        o[8] = min(max(sim.d2h_free - sim.t, 0.0) / ideal, 1.0)
        o[9] = min(max(sim.h2d_free - sim.t, 0.0) / ideal, 1.0)
        o[10] = min(sim.stall_s / ideal, 1.0) if math.isfinite(sim.stall_s) else 1.0
        o[11] = min(self.room / self.above, 1.0)
        o[12] = self.pos / max(len(self.order), 1)
        if self.pos >= len(self.order):
            return o
        k = self.tensor
        b = int(tr.tensor_bytes[k])
        so, fu = int(tr.last_forward_pack[k]), int(tr.first_unpack[k])
        free = float(self.times[fu] - self.times[so])
        rt = self.hw.d2h_time(b) + self.hw.h2d_time(b)
        x = free / rt
        o[0] = min(b / self.room, 1.0)
        o[1] = b / self.max_bytes
        o[2] = x / (1.0 + x)
        o[3] = min(free / ideal, 1.0)
        o[4] = min(float(self.times[so]) / ideal, 1.0)
        a, z = self._keep_range(k)
        future = self.lower[so:]
        peak = int(future.max()) if future.size else 0
        if z > a:
            peak = max(peak, int(self.lower[a:z].max()) + b)
        o[6] = min(peak / self.budget / 2.0, 1.0)
        over = int(self.if_kept[so:].max()) - self.budget
        o[7] = min(max(over, 0) / self.room, 1.0)
        return o

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"trace": self.trace.name, "hardware": self.hw.name, "budget_bytes": self.budget}
        if self.sim.oom_event is not None:
            info["oom_event"] = self.sim.oom_event
        if self.result is not None:
            info["overhead"] = self.result.overhead
        return info


if "swapsched/Swap-v0" not in gym.registry:
    gym.register(id="swapsched/Swap-v0", entry_point="swapsched.env.swap_env:SwapEnv")
