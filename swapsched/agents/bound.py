"""A proven lower bound on the step time of every plan: a linear relaxation of R1-R8, solved by HiGHS.

The R8 floor (``env.floors.analytic_floor``) looks at one gap at a time and lets one copy
stream carry all of the bytes that must be away. This relaxation looks at many gaps together, per
tensor, with the copies' own latencies and the stalls they force.

Formulation (indices are events; gap *j* is the compute before event *j*, R1):

- ``G_j``: ideal start of gap *j* (sum of the earlier gaps, each with the hooks' own cost where
  every plan bounded pays it: swap-only plans where some bytes must move, as the simulator
  charges it; none where a block may be recomputed: such a plan may move nothing, and pay none).
  ``S_j >= 0``: stall accumulated before gap *j* starts, non-decreasing in
  *j* (stalls happen at events and are never undone). Gap *j* starts at ``G_j + S_j`` and ends at
  ``G_{j+1} + S_j``; event *j* completes at ``G_{j+1} + S_{j+1}``.
- ``e[k, j]`` in {0, 1}: tensor *k* is off the device when gap *j* starts. Allowed only where
  R2/R4/R7 let it be away: after the gap through which the program holds it (``release``) and no
  later than the gap of its first unpack.
- Memory (R4, R5): where event *j* is a tensor's first pack, its bytes are allocated before gap *j*
  starts, and at that instant everything resident must fit: the bytes away must cover what the
  no-swap demand of gap *j* exceeds the budget by: ``sum_k bytes_k e[k, j] >= demand_j - budget``.
  (Other instants, a swap-in buffer's allocation, are not constrained: the model does not know when
  they happen. A first version constrained every gap as if a tensor away at its start stayed away
  to its end; the property test found a plan that swaps one tensor in while another leaves within a
  gap, faster than that "bound".)
- Swap-out before (R6): away during gap *j* means its copy to the host (``d_k`` = latency + bytes /
  d2h bandwidth) ran after its first pack's event and finished before gap *j* started:
  ``S_j - S_{fp_k} >= (d_k - (G_j - G_{fp_k+1})) e[k, j]``.
- Swap-in after (R6, R3): its copy back (``h_k``) starts after gap *j* starts and finishes before
  its first unpack completes: ``S_{fu_k+1} - S_j >= (h_k - (G_{fu_k+1} - G_j)) e[k, j]``.
- One copy engine per direction (R6): every tensor away at gap *j* whose first pack is at or after
  event *q* was copied out inside ``[end of gap q, start of gap j]``:
  ``sum_{k: fp_k >= q} d_k e[k, j] <= (G_j - G_{q+1}) + (S_j - S_q)``; and symmetrically every
  tensor away at *j* first unpacked at or before *r* was copied in between the start of gap *j* and
  event *r*: ``sum_{k: fu_k <= r} h_k e[k, j] <= (G_{r+1} - G_j) + (S_{r+1} - S_j)``.
- Recompute (R9), over the joint space: ``r_s`` in {0, 1}: block *s* is recomputed. Its members are
  then away from the gap after their release through the gap of its recompute event ``at_s``, so
  the memory row at gap *j* counts ``avail_s(j) r_s`` too (the members' bytes absent there); and the
  recompute runs on the compute stream at event ``at_s``: ``S_{at_s+1} - S_{at_s} >= forward_s r_s``
  (summed over the blocks recomputed at one event). Selective recompute has its own binary ``q_s``
  with the cheap members' bytes and forward time. A member is never also evicted:
  ``e[k, j] + r_s + q_s <= 1``, which also keeps a block from being recomputed both ways (without it a member's bytes counted twice in a memory row, and the
  block's recompute stall paid for the member's swap-in). The anchor's presence at ``at_s``, and the
  rebuilt members' room, are not constrained (relaxed).
- Objective: minimize ``S_n``; the bound is ``G_n + tail + S_n``, and never below the floor (R8's,
  or over the joint space ``env.floors.joint_floor``).

What is relaxed (so the bound stays a bound): each tensor's away-gaps need not be contiguous; the FIFO order of
each copy engine (R6) becomes only its capacity over windows; the host's own cost per copy
(``copy_issue_s``, ``copy_host_s_per_byte``, ``wait_resume_s``) is left out; the swap-out may start
at the first pack (R7 allows it there); only a subset of gaps (the most over budget, up to
``max_gaps``) and of copy windows are constrained. Each of these only removes constraints, so every
plan the simulator runs satisfies the model with its own times, and the LP optimum is at most its
step time. The property test (``tests/agents/test_bound.py``) checks this against every policy's
plans and random plans.

HiGHS, through ``scipy.optimize.linprog``: already a dependency (scipy), a maintained
simplex/interior-point solver, and on the corpus (up to ~400 tensors and 840 events, a few hundred
thousand nonzeros) it solves in seconds, where building the same model in CP-SAT would need
integer scaling of every time and gains nothing for a pure LP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from swapsched.env.floors import analytic_floor, joint_floor
from swapsched.hardware import Hardware
from swapsched.trace import Trace

__all__ = ["Bound", "lower_bound"]


@dataclass(frozen=True)
class Bound:
    """``bound_s``: no plan's simulated step is shorter. ``status``: ``"lp"`` (the relaxation
    solved), ``"floor"`` (the R8 floor alone: nothing over budget, or the LP stopped at its time
    limit without a proven value). ``gaps``/``variables``: the model's size."""

    bound_s: float
    floor_s: float
    status: str
    solve_s: float
    gaps: int
    variables: int


def _spread(idx: np.ndarray, m: int) -> np.ndarray:
    """At most ``m`` of ``idx``, evenly spread (all of them where there are no more than ``m``:
    ``m`` points over fewer indices round onto each of them)."""
    return idx[np.unique(np.linspace(0, idx.size - 1, m).round().astype(np.int64))] if idx.size else idx


def lower_bound(trace: Trace, budget: int, hardware: Hardware, *, time_limit_s: float = 30.0,
                max_gaps: int = 60, windows: int = 12, integer: bool = True, recompute: bool = True) -> Bound:
    """The relaxation's optimum (see the module docstring), or the floor where it says more.
    ``recompute``: bound every plan, recomputing ones included (R9); False: swap-only plans."""
    t0 = time.perf_counter()
    segments = trace.segments if recompute else ()
    floor = (joint_floor if segments else analytic_floor)(trace, budget, hardware)
    n = trace.n_events
    demand = trace.static_bytes + trace.other_bytes + trace.resident_bytes_no_swap
    must = demand - budget
    gaps = trace.gaps + (hardware.hook_cost_s if not segments and must.max(initial=0) > 0 else 0.0)
    G = np.concatenate(([0.0], np.cumsum(gaps)))  # G[j] = ideal start of gap j; G[n] = end of the last
    # R4: the bytes of the tensor first packed at event j are allocated before gap j starts; those
    # instants are where memory is checked against the budget (swap-in buffers are checked too, at
    # times the model does not know, so they are left out: fewer constraints, still a bound)
    first_pack_gap = np.zeros(n, dtype=bool)
    first_pack_gap[trace.first_pack[trace.first_pack >= 0]] = True
    over = np.flatnonzero((must > 0) & first_pack_gap)  # none: no pair below, and the bound is the floor
    # the gaps most over budget, then an even spread of the rest
    top = over[np.argsort(-must[over], kind="stable")[: max_gaps // 2]]
    checked = np.unique(np.concatenate((top, _spread(over, max_gaps - top.size))))
    fp, fu, rel = trace.first_pack, trace.first_unpack, trace.release
    b = trace.tensor_bytes.astype(np.float64)
    d = hardware.copy_latency_s + b / hardware.link_bytes_per_s("d2h")
    h = hardware.copy_latency_s + b / hardware.link_bytes_per_s("h2d")

    # variables: S_0..S_n, then e[k, j] for the eligible pairs, then r_s and q_s per block (R9)
    pairs = [(int(k), int(j)) for j in checked for k in np.flatnonzero((rel < j) & (fu >= j) & (fp < j))]
    if not pairs:  # nothing can be away at a checked gap (nor recomputed: members absent there are pairs too)
        return Bound(floor, floor, "floor", time.perf_counter() - t0, int(checked.size), 0)
    nS = n + 1
    nR = nS + len(pairs)
    nQ = nR + len(segments)  # then q_s per block: recomputed selectively (its cheap members only)
    nv = nQ + len(segments)
    # bytes of block s absent during gap j if it is recomputed: members from their release to at_s
    # (whole: r_s), or its cheap members only (selectively: q_s)
    absent: dict[int, list[tuple[int, float]]] = {}
    for sg in segments:
        for j in checked:
            for col, ks in ((nR + sg.index, sg.members), (nQ + sg.index, sg.cheap)):
                gone = sum(float(b[k]) for k in ks if rel[k] < j <= sg.at)
                absent.setdefault(int(j), []).append((col, gone))  # 0 where none is absent: a zero coefficient
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []

    def row(entries: list[tuple[int, float]], bound: float) -> None:
        r = len(rhs)
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        rhs.append(bound)

    for i in range(n):  # S non-decreasing: S_i - S_{i+1} <= 0
        row([(i, 1.0), (i + 1, -1.0)], 0.0)
    by_gap: dict[int, list[tuple[int, int]]] = {}
    for v, (k, j) in enumerate(pairs):
        col = nS + v
        by_gap.setdefault(j, []).append((k, col))
        c_out = d[k] - (G[j] - G[fp[k] + 1])
        if c_out > 0:  # c_out e - S_j + S_fp <= 0
            row([(col, c_out), (j, -1.0), (int(fp[k]), 1.0)], 0.0)
        c_in = h[k] - (G[fu[k] + 1] - G[j])
        if c_in > 0:  # c_in e - S_{fu+1} + S_j <= 0
            row([(col, c_in), (int(fu[k]) + 1, -1.0), (j, 1.0)], 0.0)
    for sg in segments:  # the recompute's own compute at its event: S_at - S_{at+1} + forward r + cheap q <= 0
        row([(int(sg.at), 1.0), (int(sg.at) + 1, -1.0), (nR + sg.index, sg.forward_s),
             (nQ + sg.index, sg.cheap_forward_s)], 0.0)
    block_of = {int(k): sg.index for sg in segments for k in sg.members}
    # a member is never also evicted (R9): e + r + q <= 1. This also keeps a block from being
    # recomputed whole and selectively at once wherever that could matter: a member absent at a
    # checked gap is eligible to be away there, so it has a pair and this row
    for v, (k, _) in enumerate(pairs):
        if k in block_of:
            row([(nS + v, 1.0), (nR + block_of[k], 1.0), (nQ + block_of[k], 1.0)], 1.0)
    for j, members in by_gap.items():
        gap_ks = np.array([k for k, _ in members])
        cs = [c for _, c in members]
        # memory: sum b e + sum absent r >= must_j. Every gap with absent members has pairs: a member
        # absent at j (release < j <= at <= its first unpack) is eligible to be away there too
        row([(c, -b[k]) for k, c in members] + [(c, -gone) for c, gone in absent.get(j, [])], -float(must[j]))
        for q in _spread(np.unique(fp[gap_ks]), windows):  # d2h capacity in [end of gap q, start of gap j]
            sel = [(c, d[k]) for k, c in zip(gap_ks, cs, strict=True) if fp[k] >= q]
            row([*sel, (j, -1.0), (int(q), 1.0)], float(G[j] - G[q + 1]))
        for r in _spread(np.unique(fu[gap_ks]), windows):  # h2d capacity in [start of gap j, event r]
            sel = [(c, h[k]) for k, c in zip(gap_ks, cs, strict=True) if fu[k] <= r]
            row([*sel, (int(r) + 1, -1.0), (j, 1.0)], float(G[r + 1] - G[j]))
    a = sparse.csr_matrix((vals, (rows, cols)), shape=(len(rhs), nv))
    cost = np.zeros(nv)
    cost[n] = 1.0
    lo = np.zeros(nv)
    hi = np.concatenate(([0.0], np.full(n, np.inf), np.ones(len(pairs) + 2 * len(segments))))
    integral = np.concatenate((np.zeros(nS), np.ones(len(pairs) + 2 * len(segments)))) if integer else np.zeros(nv)
    left = max(time_limit_s - (time.perf_counter() - t0), 0.5)
    res = milp(cost, constraints=LinearConstraint(a, -np.inf, np.array(rhs)), integrality=integral,
               bounds=Bounds(lo, hi), options={"time_limit": left, "presolve": True})
    solve_s = time.perf_counter() - t0
    # what is proven: the MILP's dual bound (at the time limit too), or the LP optimum
    proven = getattr(res, "mip_dual_bound", None) if integer else (res.fun if res.status == 0 else None)
    if proven is None or not np.isfinite(proven):
        return Bound(floor, floor, "floor", solve_s, int(checked.size), nv)
    # a tiny relative slack covers the solver's feasibility tolerance
    lp = float(G[n] + trace.tail_compute_s + proven) * (1.0 - 1e-7)
    status = ("milp" if res.status == 0 else "milp-time-limit") if integer else "lp"
    return Bound(max(lp, floor), floor, status if lp > floor else "floor", solve_s, int(checked.size), nv)
