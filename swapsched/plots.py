"""Pictures people compare: memory over time with the three streams, and overheads per policy."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swapsched._paths import atomic_path

if TYPE_CHECKING:
    from swapsched.agents.evaluate import CaseResult

__all__ = ["plot_timelines", "plot_compare", "plot_runs"]


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
    the compute, device->host and host->device streams (and stalls) below."""
    plt = _pyplot()
    n = len(results)
    fig, axes = plt.subplots(2 * n, 1, figsize=(10, 3.2 * n), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.2] * n})
    gib = 2**30
    for j, (label, res) in enumerate(results):
        tl = res.timeline
        ax_m, ax_s = axes[2 * j][0], axes[2 * j + 1][0]
        if tl is None:
            ax_m.set_title(f"{label}: no timeline")
            continue
        ts = [t for t, _ in tl.memory]
        ms = [m / gib for _, m in tl.memory]
        ax_m.step(ts, ms, where="post", label="device memory")
        ax_m.axhline(budget / gib, color="red", linestyle="--", label="budget")
        status = "OOM" if res.oom else f"overhead {res.overhead:+.1%}"
        ax_m.set_title(f"{label}: {status}")
        ax_m.set_ylabel("GiB")
        ax_m.legend(loc="upper right", fontsize=8)
        rows = [("compute", [(a, b) for a, b in tl.compute], "tab:blue"),
                ("d2h", [(a, b) for a, b, _ in tl.d2h], "tab:orange"),
                ("h2d", [(a, b) for a, b, _ in tl.h2d], "tab:green"),
                ("stall", [(a, b) for a, b, _ in tl.stalls], "tab:red")]
        for y, (_, spans, color) in enumerate(rows):
            ax_s.broken_barh([(a, b - a) for a, b in spans], (y - 0.4, 0.8), color=color)
        ax_s.set_yticks(range(len(rows)), [r[0] for r in rows])
        ax_s.set_xlabel("time (s)")
        end = max([ts[-1]] + [b for _, spans, _ in rows for _, b in spans] or [1.0])
        ax_m.set_xlim(0, end)
        ax_s.set_xlim(0, end)
    return _save(plt, fig, path, title)


def plot_compare(rows: Sequence[CaseResult], policies: Sequence[str], path: str | Path) -> Path:
    """Grouped bars: overhead per case (trace x budget x hardware) and policy; OOM drawn as an x."""
    plt = _pyplot()
    cases = list(dict.fromkeys(r.case for r in rows))
    by = {(*r.case, r.policy): r for r in rows}
    width = 0.8 / max(len(policies), 1)
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(cases) * max(1, len(policies) / 3)), 4.5))
    ymax = 0.0
    for j, pol in enumerate(policies):
        xs, ys, oom_x = [], [], []
        for i, c in enumerate(cases):
            r = by.get((*c, pol))
            if r is None or r.skipped:
                continue
            x = i + (j - (len(policies) - 1) / 2) * width
            if r.overhead is None:
                oom_x.append(x)
            else:
                xs.append(x)
                ys.append(100 * r.overhead)
        bars = ax.bar(xs, ys, width, label=pol)
        ymax = max([ymax, *ys])
        if oom_x:
            ax.scatter(oom_x, [0] * len(oom_x), marker="x", color=bars.patches[0].get_facecolor() if bars.patches else "k")
    ax.set_xticks(range(len(cases)), [f"{t}\n{b} {h}" for t, b, h in cases], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("overhead over ideal step (%)   (x = OOM)")
    ax.set_ylim(0, ymax * 1.1 + 1)
    ax.legend(fontsize=7, ncol=3)
    return _save(plt, fig, path)


def plot_runs(results: Sequence[Any], path: str | Path, title: str = "") -> Path:
    """``swapsched run --compare``: median step time and peak device memory (against the budget)."""
    plt = _pyplot()
    names = [r.method for r in results]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(names) * 2), 4))
    ax_t.bar(names, [1e3 * r.step_s_median for r in results], color="tab:blue")
    ax_t.set_ylabel("median step (ms)")
    peaks = [(r.peak_device_bytes or 0) / 2**20 for r in results]
    ax_m.bar(names, peaks, color="tab:orange")
    budgets = [r.budget_bytes for r in results if r.budget_bytes]
    if budgets:
        ax_m.axhline(budgets[0] / 2**20, color="red", linestyle="--", label="budget")
        ax_m.legend()
    ax_m.set_ylabel("peak device memory (MiB; 0 = not measurable here)")
    for ax in (ax_t, ax_m):
        ax.tick_params(axis="x", rotation=45)
    return _save(plt, fig, path, title)
