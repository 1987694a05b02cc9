"""Pictures people compare: memory over time with the three streams, and overheads per policy."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swapsched._paths import atomic_path

if TYPE_CHECKING:
    from swapsched.agents.evaluate import CaseResult

__all__ = ["plot_timelines", "plot_compare", "plot_runs", "plot_fit"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path, title: str = "") -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    p = Path(path)
    with atomic_path(p) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return p


def plot_timelines(results: Sequence[tuple[str, Any]], budget: int, path: str | Path, title: str = "") -> Path:
    """One panel per (label, SimResult with a timeline): device memory against the budget above,
    the compute (recompute in purple), device->host and host->device streams (and stalls) below."""
    plt = _pyplot()
    n = len(results)
    # R13-R16: three more rows (the state's copies, the host's steps) where a plan moves state
    rows_h = 2.0 if any(r.timeline and (r.timeline.state_d2h or r.timeline.host_steps) for _, r in results) else 1.2
    fig, axes = plt.subplots(2 * n, 1, figsize=(10, (1.9 + rows_h) * n), squeeze=False,
                             gridspec_kw={"height_ratios": [3, rows_h] * n})
    div, unit = _bytes_unit(max([budget] + [m for _, r in results if r.timeline for _, m in r.timeline.memory]))
    for j, (label, res) in enumerate(results):
        tl = res.timeline
        ax_m, ax_s = axes[2 * j][0], axes[2 * j + 1][0]
        if tl is None:
            ax_m.set_title(f"{label}: no timeline")
            continue
        ts = [t for t, _ in tl.memory]
        ms = [m / div for _, m in tl.memory]
        ax_m.step(ts, ms, where="post", label="device memory")
        ax_m.axhline(budget / div, color="red", linestyle="--", label="budget")
        status = "OOM" if res.oom else f"overhead {res.overhead:+.1%}" + (f", recompute {res.recompute_s / res.ideal_s:.1%}"
                                                                            if res.recompute_s else "")
        ax_m.set_title(f"{label}: {status}")
        ax_m.set_ylabel(unit)
        ax_m.legend(loc="upper right", fontsize=8)
        rows = [("compute", [(a, b) for a, b in tl.compute], "tab:blue"),
                ("d2h", [(a, b) for a, b, _ in tl.d2h], "tab:orange"),
                ("h2d", [(a, b) for a, b, _ in tl.h2d], "tab:green"),
                ("stall", [(a, b) for a, b, _ in tl.stalls], "tab:red")]
        if tl.state_d2h or tl.state_h2d or tl.host_steps:  # R13-R16: the state on rows of its own
            rows += [("state d2h", [(a, b) for a, b, _ in tl.state_d2h], "tab:brown"),
                     ("state h2d", [(a, b) for a, b, _ in tl.state_h2d], "tab:olive"),
                     ("host step", [(a, b) for a, b, _ in tl.host_steps], "tab:gray")]
        for y, (_, spans, color) in enumerate(rows):
            ax_s.broken_barh([(a, b - a) for a, b in spans], (y - 0.4, 0.8), color=color)
        # R9: recompute runs on the compute stream, drawn there in its own colour
        ax_s.broken_barh([(a, b - a) for a, b, _ in tl.recompute], (-0.4, 0.8), color="tab:purple",
                         label="recompute" if tl.recompute else None)
        if tl.recompute:
            ax_s.legend(loc="upper right", fontsize=7)
        ax_s.set_yticks(range(len(rows)), [r[0] for r in rows])
        ax_s.set_xlabel("time (s)")
        end = max([ts[-1]] + [b for _, spans, _ in rows for _, b in spans] or [1.0])
        ax_m.set_xlim(0, end)
        ax_s.set_xlim(0, end)
    return _save(plt, fig, path, title)


def _bytes_unit(peak: float) -> tuple[float, str]:
    """The divisor and unit that fit ``peak`` bytes (so small traces do not read 0.010 GiB)."""
    for div, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if peak >= div:
            return float(div), unit
    return 1.0, "B"


def plot_compare(rows: Sequence[CaseResult], policies: Sequence[str], path: str | Path) -> Path:
    """A heat map per budget: one row per trace (with the hardware it is simulated on), one column
    per policy, the colour each step's excess over the case's analytic floor (R8) on a log scale,
    which spans decades over a corpus. OOM and skipped cells are marked, not coloured. Scales to
    the whole corpus: about a sixth of an inch per row."""
    import math

    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    budgets = list(dict.fromkeys(r.budget for r in rows))
    lines = list(dict.fromkeys((r.trace, r.hardware) for r in rows))
    by = {(r.trace, r.hardware, r.budget, r.policy): r for r in rows}
    excess = []
    for r in rows:
        if r.result is not None and not r.result.oom and r.floor_s and math.isfinite(r.result.iteration_s):
            excess.append(max(r.result.iteration_s / r.floor_s - 1.0, 1e-4))
    lo, hi = (min(excess), max(excess)) if excess else (1e-4, 1.0)
    norm = LogNorm(vmin=max(lo, 1e-4), vmax=max(hi, lo * 10, 1e-3))
    annotate = len(lines) * len(policies) <= 240
    fig, axes = plt.subplots(1, len(budgets), squeeze=False, sharey=True,
                             figsize=(max(4.0, 0.55 * len(policies) + 1.5) * len(budgets) + 2.5, 1.5 + 0.17 * len(lines)))
    image = None
    for k, budget in enumerate(budgets):
        ax = axes[0][k]
        grid = np.full((len(lines), len(policies)), np.nan)
        for i, (trace, hw) in enumerate(lines):
            for j, pol in enumerate(policies):
                r = by.get((trace, hw, budget, pol))
                mark = None
                if r is None or r.skipped:
                    mark = "-"
                elif r.result is None or r.result.oom:
                    mark = "OOM"
                elif r.floor_s:
                    grid[i, j] = max(r.result.iteration_s / r.floor_s - 1.0, 1e-4)
                    if annotate:
                        mark = f"{100 * grid[i, j]:.0f}" if grid[i, j] >= 0.01 else f"{100 * grid[i, j]:.1f}"
                if mark:
                    bright = mark in ("-", "OOM") or norm(grid[i, j]) > 0.6  # dark text on light cells
                    ax.text(j, i, mark, ha="center", va="center", fontsize=6, color="black" if bright else "white")
        image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis", norm=norm, interpolation="nearest")
        ax.set_facecolor("#dddddd")  # skipped and OOM cells
        ax.set_xticks(range(len(policies)), policies, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"budget {budget}", fontsize=9)
        if k == 0:
            ax.set_yticks(range(len(lines)), [f"{t} ({h})" for t, h in lines], fontsize=6)
    if image is not None:
        bar = fig.colorbar(image, ax=axes[0].tolist(), fraction=0.04, pad=0.02)
        bar.set_label("step over the analytic floor, %  (log)")
        bar.ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{100 * v:g}"))
    fig.suptitle("simulated step time over the R8 floor; - = budget below the smallest feasible, OOM = plan does "
                 "not fit", fontsize=8)
    p = Path(path)
    with atomic_path(p) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return p


def plot_runs(results: Sequence[Any], path: str | Path, title: str = "", budget_bytes: int | None = None) -> Path:
    """``swapsched run``: median step time and peak device memory per method, against the budget
    (rows of ``run --compare`` or ``RunResult``s)."""
    plt = _pyplot()
    names = [r.method for r in results]
    peaks_b = [getattr(r, "peak_bytes", None) or getattr(r, "peak_device_bytes", None) or 0 for r in results]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(names) * 2), 4))
    ax_t.bar(names, [1e3 * r.step_s_median for r in results], color="tab:blue")
    ax_t.set_ylabel("median step (ms)")
    div, unit = _bytes_unit(max([*peaks_b, budget_bytes or 0, 1]))
    ax_m.bar(names, [p / div for p in peaks_b], color="tab:orange")
    if budget_bytes:
        ax_m.axhline(budget_bytes / div, color="red", linestyle="--", label="budget")
        ax_m.legend()
    ax_m.set_ylabel(f"peak device memory ({unit})")
    for ax in (ax_t, ax_m):
        ax.tick_params(axis="x", rotation=45)
    return _save(plt, fig, path, title)


def plot_fit(curves: dict[str, list[tuple[int, float | None]]], device_memory: int, path: str | Path,
             title: str = "") -> Path:
    """``swapsched fit --plot``: each option's step against the device memory it is given (one
    line per option; a point is missing where it does not fit), the hardware's memory marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    top = max((b for pts in curves.values() for b, _ in pts), default=device_memory)
    div, unit = _bytes_unit(max(top, device_memory))
    for option, points in curves.items():
        xs = [b / div for b, s in points if s is not None]
        ys = [s for _, s in points if s is not None]
        if xs:
            ax.plot(xs, ys, marker="o", label=option)
        else:
            ax.plot([], [], label=f"{option} (fits nowhere here)")
    ax.axvline(device_memory / div, color="grey", linestyle="--", label="this device")
    ax.set_xlabel(f"device memory ({unit})")
    ax.set_ylabel("step (s)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path, title)
