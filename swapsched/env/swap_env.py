"""SwapEnv: the gymnasium environment the swap policy learns in; a thin adapter over the simulator."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from swapsched.budget import BudgetError, parse_budget
from swapsched.env.result import SimResult
from swapsched.env.simulator import Simulation
from swapsched.hardware import TRAINING_HARDWARE, Hardware, load_hardware
from swapsched.plan import LEADS, Eviction
from swapsched.trace import Trace

__all__ = ["SwapEnv", "N_FEATURES", "DEFAULT_HARDWARE"]

N_FEATURES = 13
DEFAULT_HARDWARE = TRAINING_HARDWARE


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
    overhead it added (the stall, and the copies' host costs where the hardware profile measures
    them: R6, R8), divided by the ideal step time. An OOM gives ``-oom_penalty`` (default 10) and ends
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

    @staticmethod
    def spaces() -> tuple[spaces.Box, spaces.Discrete]:
        """The observation and action spaces, the same for every trace (a checkpoint is loaded
        against these, not against spaces unpickled from its file)."""
        return spaces.Box(0.0, 1.0, (N_FEATURES,), dtype=np.float32), spaces.Discrete(1 + len(LEADS))

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
        self.observation_space, self.action_space = self.spaces()
        self.n_actions = int(self.action_space.n)
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
        self.table = _decision_table(tr, hw)
        self.order = self.table.order
        self.pos = 0
        self.evictions = []
        self.room = max(budget - tr.static_bytes, 1)
        base = tr.static_bytes + tr.other_bytes
        self.lower = (base + tr.must_resident_bytes).astype(np.int64)  # every plan holds at least this
        self.if_kept = (base + tr.resident_bytes_no_swap).astype(np.int64)  # undecided tensors all kept
        self.last_cost = 0.0
        self.result: SimResult | None = None
        self._mask_pos = -1
        self._mask: np.ndarray = np.ones(self.n_actions, dtype=bool)
        self.above = max(tr.peak_bytes_no_swap - tr.static_bytes, 1)
        self._advance()

    # ------------------------------------------------------------------ the current decision
    @property
    def tensor(self) -> int:
        return self.order[self.pos]

    def action_masks(self) -> np.ndarray:
        if self._mask_pos == self.pos:
            return self._mask.copy()
        mask = np.ones(self.n_actions, dtype=bool)
        if self.pos < len(self.order):
            t = self.table
            p = self.pos
            a, z = t.keep_from[p], t.first_unpack[p]
            # the account over the gaps the choices would occupy, each a suffix of [lo, z): keeping
            # from the program's release (a), an eviction from its prefetch, which may come before
            # that release (R2: the swap-in buffer and the original held by the program coexist)
            lo = t.swap_out[p] + 1  # <= a, and <= every occupy_from
            if z > lo:
                suffix_max = np.maximum.accumulate(self.lower[lo:z][::-1])[::-1]
                room = self.budget - t.bytes[p]
                if z > a:
                    mask[0] = suffix_max[a - lo] <= room
                for i, start in enumerate(t.occupy_from[p]):
                    if start < z:
                        mask[1 + i] = suffix_max[start - lo] <= room
        self._mask, self._mask_pos = mask, self.pos
        return mask.copy()

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        action = int(action)
        if not 0 <= action < self.n_actions:
            raise ValueError(f"action {action} outside {self.action_space}")
        if self.pos >= len(self.order):
            raise RuntimeError("step() after the episode ended; call reset()")
        t, p = self.table, self.pos
        k, b, z = self.order[p], t.bytes[p], t.first_unpack[p]
        if action == 0:
            self.lower[t.keep_from[p]:z] += b
        else:
            pf = t.prefetch[p][action - 1]
            self.lower[t.occupy_from[p][action - 1]:z] += b
            ev = Eviction(k, t.swap_out[p], pf)
            self.sim.schedule(k, ev.swap_out_at, pf)
            self.evictions.append(ev)
            self.if_kept[t.keep_from[p]:z] -= b
        self.pos += 1
        self._advance()
        if self.sim.oom_event is not None:
            return self._obs(), -self.oom_penalty, True, False, self._info()
        cost = self.sim.stall_s + self.sim.host_s
        reward = -(cost - self.last_cost) / self.ideal
        self.last_cost = cost
        terminated = self.pos >= len(self.order)
        # the episode's identity and result are in the info of reset() and of the last step
        return self._obs(), float(reward), terminated, False, self._info() if terminated else {}

    def _advance(self) -> None:
        """Run the simulation to the next decision point, or to the end of the step."""
        if self.pos < len(self.order):
            self.sim.run_until(self.table.swap_out[self.pos])
        else:
            self.result = self.sim.finish()

    def _obs(self) -> np.ndarray:
        sim, ideal, budget = self.sim, self.ideal, self.budget
        stall = sim.stall_s
        dynamic = [
            min((sim.static + sim.cur_other + sim.used) / budget, 1.0),  # 5
            min(max(sim.engines.d2h_free - sim.t, 0.0) / ideal, 1.0),  # 8
            min(max(sim.engines.h2d_free - sim.t, 0.0) / ideal, 1.0),  # 9
            min(stall / ideal, 1.0) if stall < math.inf else 1.0,  # 10
            min(self.room / self.above, 1.0),  # 11
            self.pos / len(self.order),  # 12
        ]
        if self.pos >= len(self.order):
            return np.array([0.0] * 5 + dynamic[:1] + [0.0, 0.0] + dynamic[1:], dtype=np.float32)
        t, p = self.table, self.pos
        b, so, a, z = t.bytes[p], t.swap_out[p], t.keep_from[p], t.first_unpack[p]
        lower = self.lower
        peak = int(lower[so:].max())
        if z > a:
            peak = max(peak, int(lower[a:z].max()) + b)
        over = int(self.if_kept[so:].max()) - budget
        o = [min(b / self.room, 1.0), *t.static_features[p], dynamic[0],
             min(peak / budget / 2.0, 1.0), min(max(over, 0) / self.room, 1.0), *dynamic[1:]]
        return np.array(o, dtype=np.float32)

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"trace": self.trace.name, "hardware": self.hw.name, "budget_bytes": self.budget}
        if self.sim.oom_event is not None:
            info["oom_event"] = self.sim.oom_event
        if self.result is not None:
            info["overhead"] = self.result.overhead
        return info


class _DecisionTable:
    """Per (trace, hardware): the decisions in order and everything about them that does not
    depend on the budget or on earlier decisions, as plain lists (the env's hot path)."""

    def __init__(self, tr: Trace, hw: Hardware):
        order = np.lexsort((np.arange(tr.n_tensors), tr.last_forward_pack))
        self.order = order.tolist()
        b = tr.tensor_bytes[order]
        so = tr.last_forward_pack[order]
        fu = tr.first_unpack[order]
        self.bytes = b.tolist()
        self.swap_out = so.tolist()
        self.first_unpack = fu.tolist()
        # keeping occupies the gaps after the program releases it (R2; its last forward pack by default)
        self.keep_from = (tr.release[order] + 1).tolist()
        times = tr.event_times
        h2d = hw.copy_latency_s + b / hw.link_bytes_per_s("h2d")
        pf_cols = []
        for lead in LEADS:  # the same placement as swapsched.plan.lead_eviction, for all tensors at once
            if lead == 0:
                pf = fu
            elif math.isinf(lead):
                pf = so
            else:
                pf = np.searchsorted(times, times[fu] - lead * h2d, side="right") - 1
                pf = np.minimum(np.maximum(pf, so), fu)
            pf_cols.append(pf)
        pf_mat = np.stack(pf_cols, axis=1)
        self.prefetch = pf_mat.tolist()
        # an evicted tensor occupies the gaps from its prefetch (after the swap-out's gap) to its unpack
        self.occupy_from = np.maximum(pf_mat, (so + 1)[:, None]).tolist()
        free = times[fu] - times[so]
        rt = 2 * hw.copy_latency_s + b / hw.link_bytes_per_s("d2h") + b / hw.link_bytes_per_s("h2d")
        x = free / rt
        ideal = tr.ideal_s + hw.hook_cost_s * tr.n_events
        self.static_features = np.stack([
            b / max(int(tr.tensor_bytes.max()), 1), x / (1.0 + x), np.minimum(free / ideal, 1.0),
            np.minimum(times[so] / ideal, 1.0),
        ], axis=1).tolist()


def _decision_table(tr: Trace, hw: Hardware) -> _DecisionTable:
    key = ("env", hw)  # computed once per trace and hardware (kept in ``trace.derived``)
    if key not in tr.derived:
        tr.derived[key] = _DecisionTable(tr, hw)
    return tr.derived[key]


if "swapsched/Swap-v0" not in gym.registry:
    gym.register(id="swapsched/Swap-v0", entry_point="swapsched.env.swap_env:SwapEnv")
