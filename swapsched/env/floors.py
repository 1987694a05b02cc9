"""Lower bounds on a step's time under a budget, without simulating a plan: R8's floor and the
joint floor over swapping and recomputing (DESIGN.md, R8 and R9). Every plan the simulator times
is at or above them; ``agents/bound.py`` proves a tighter bound where a solver may take its time.
"""

from __future__ import annotations

import numpy as np

from swapsched.hardware import Hardware
from swapsched.trace import Trace

__all__ = ["analytic_floor", "joint_floor"]


def analytic_floor(trace: Trace, budget: int, hardware: Hardware) -> float:
    """R8's lower bound on the step time, split at the gap where it binds.

    At gap *j* at least ``must_j`` = demand_j - budget bytes are off the device, so they finished
    their swap-out before the gap started and start their swap-in after it: the step takes at least
    ``max(compute before j, must_j / B_d2h) + max(compute from j on, must_j / B_h2d)``. The bound is
    the largest over all gaps (R8 states it with *j* at the forward/backward boundary).
    """
    if trace.n_events == 0:
        return trace.ideal_s
    _, before, after, must = _floor_terms(trace, budget, hardware, swaps_only=True)
    bound = np.maximum(before, must / hardware.link_bytes_per_s("d2h")) + np.maximum(after, must / hardware.link_bytes_per_s("h2d"))
    return float(bound.max())


def _floor_terms(trace: Trace, budget: int, hardware: Hardware, swaps_only: bool) -> tuple[np.ndarray, ...]:
    """Per gap *j*, what both floors start from: the gaps, the compute before *j* and from *j* on,
    and ``must_j``, the bytes that must be off the device. Each gap has the hooks' cost only where
    every plan bounded pays it (the simulator's ``Simulation._hook_cost``): plans of swaps alone
    (``swaps_only``) where some bytes must move; a plan that moves nothing pays none, and one that
    recomputes blocks may move nothing."""
    demand = trace.static_bytes + trace.other_bytes + trace.resident_bytes_no_swap
    must = np.maximum(demand - budget, 0).astype(np.float64)
    gaps = trace.gaps + (hardware.hook_cost_s if swaps_only and must.max(initial=0.0) > 0 else 0.0)
    before = np.concatenate(([0.0], np.cumsum(gaps)[:-1]))
    after = gaps.sum() + trace.tail_compute_s - before
    return gaps, before, after, must


def joint_floor(trace: Trace, budget: int, hardware: Hardware) -> float:
    """R8's floor over the joint space of keep / swap / recompute (R9): no plan of either kind is faster.

    At gap *j*, ``must_j`` bytes are off the device: ``x`` of them swapped (copied out before the gap,
    back after it, as in :func:`analytic_floor`) and the rest members of recomputed blocks, absent
    from their release to their block's recompute, which costs the block's forward time after the
    gap. The cheapest way to free ``y`` bytes by recompute is at least the fractional knapsack over
    the blocks absent at *j* (seconds per byte, cheapest first), ``R_j(y)``, convex and piecewise
    linear. So the step takes at least
    ``min over x of max(before_j, x / B_d2h) + max(after_j + R_j(must_j - x), x / B_h2d)``, a convex
    piecewise-linear function of ``x`` whose minimum lies at one of its breakpoints, all of which are
    evaluated. The floor is the largest over the gaps, and equals :func:`analytic_floor` where no
    block can be recomputed. Selective recompute (a block's cheap members for its cheap forward
    time) is one of the knapsack's items, so the floor holds for those plans too."""
    segments = trace.segments
    if not segments or trace.n_events == 0:
        return analytic_floor(trace, budget, hardware)
    gaps, before, after, must = _floor_terms(trace, budget, hardware, swaps_only=False)
    rel, b = trace.release, trace.tensor_bytes
    inv_d, inv_h = 1.0 / hardware.link_bytes_per_s("d2h"), 1.0 / hardware.link_bytes_per_s("h2d")
    # Knapsack items, two per block: its cheap members (what a selective recompute rebuilds, for
    # its cheap forward time) and the rest (for the remaining forward time). A whole recompute
    # takes both, a selective one the first; taking the second alone is no plan, but allowing it
    # only lowers the floor. Each item's bytes are absent from the members' release+1 to at.
    items = [(sg, [k for k in sg.members if k in cheap], cost)
             for sg in segments
             for cheap, cost in ((set(sg.cheap), sg.cheap_forward_s),
                                 (set(sg.members) - set(sg.cheap), sg.forward_s - sg.cheap_forward_s))]
    items = [(sg, ks, c) for sg, ks, c in items if ks]
    avail = np.zeros((len(items), trace.n_events + 1), dtype=np.float64)
    for row, (sg, ks, _) in enumerate(items):
        for k in ks:
            lo = int(rel[k]) + 1
            if lo <= sg.at:
                avail[row, lo] += b[k]
                avail[row, sg.at + 1] -= b[k]
    avail = np.cumsum(avail, axis=1)[:, :-1]
    cost = np.array([c for _, _, c in items])
    floor = float(gaps.sum() + trace.tail_compute_s)  # every gap with nothing to free: the compute
    # swapping all must_j (x = must_j, nothing recomputed) is one candidate, so R8's term bounds
    # each gap's value from above: gaps in decreasing order of it, until none can raise the floor
    over = np.flatnonzero(must > 0)
    swap_only = np.maximum(before[over], must[over] * inv_d) + np.maximum(after[over], must[over] * inv_h)
    for j, top in zip(over[np.argsort(-swap_only, kind="stable")], np.sort(swap_only)[::-1], strict=True):
        if top <= floor:
            break
        m, bj, aj = float(must[j]), float(before[j]), float(after[j])
        have = avail[:, j] > 0
        if not have.any():  # only swapping frees bytes here: R8's term
            floor = max(floor, max(bj, m * inv_d) + max(aj, m * inv_h))
            continue
        rates = cost[have] / avail[have, j]
        order = np.argsort(rates, kind="stable")
        rates = rates[order]
        cum_y = np.concatenate(([0.0], np.cumsum(avail[have, j][order])))  # R_j's breakpoints, bytes freed
        cum_r = np.concatenate(([0.0], np.cumsum(cost[have][order])))  # and seconds spent
        # the candidates x (bytes swapped): the ends, where the swap-out starts to bind, each linear
        # piece of R_j's ends in x = m - y, and where after_j + R_j = x / B_h2d inside a piece
        x_hi, x_lo = m - cum_y[:-1], m - cum_y[1:]
        cross = (aj + cum_r[:-1] + rates * x_hi) / (inv_h + rates)
        inside = (cross >= np.maximum(x_lo, 0.0)) & (cross <= np.minimum(x_hi, m))
        ends = np.concatenate((x_hi, x_lo))
        x = np.concatenate(([0.0, m, min(bj / inv_d, m)], ends[(ends >= 0.0) & (ends <= m)], cross[inside]))
        # R_j(m - x): the fractional knapsack, cheapest seconds per byte first; 0 where nothing is
        # left to free, inf where recompute cannot free that much here
        y = m - x
        p = np.clip(np.searchsorted(cum_y, y, side="left") - 1, 0, len(rates) - 1)
        r = np.where(y <= 0, 0.0, np.where(y > cum_y[-1] * (1 + 1e-12), np.inf, cum_r[p] + rates[p] * (y - cum_y[p])))
        lb = float(np.min(np.maximum(bj, x * inv_d) + np.maximum(aj + r, x * inv_h)))
        floor = max(floor, lb)
    return floor
