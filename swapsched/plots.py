"""Pictures people compare: memory over time with the three streams, and overheads per policy."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swapsched._paths import atomic_path

if TYPE_CHECKING:
    from swapsched.agents.evaluate import CaseResult

__all__ = ["plot_timelines", "timelines_figure", "plot_compare", "plot_runs", "plot_fit"]


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
    """:func:`timelines_figure` written to ``path``."""
    plt = _pyplot()
    fig = timelines_figure(results, budget, title)
    p = Path(path)
    with atomic_path(p) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return p


def timelines_figure(results: Sequence[tuple[str, Any]], budget: int, title: str = "") -> Any:
    """One panel pair per (label, SimResult with a timeline) that fits: device memory against the
    budget above, the compute (recompute in purple), device->host and host->device streams (and
    stalls; the state's copies, the host's steps and the disk's reads and writes where the plan
    moves state) below. Every panel shares one time axis and one memory axis, so that lengths and
    heights compare at a glance; a policy that does not fit is a line of text under them, not
    empty axes."""
    from swapsched.budget import format_bytes

    plt = _pyplot()
    drawn = [(label, r) for label, r in results if r.timeline is not None and not r.oom]
    refused = [(label, r) for label, r in results if r.timeline is None or r.oom]
    n = max(len(drawn), 1)
    state = any(r.timeline.state_d2h or r.timeline.host_steps or r.timeline.disk_reads for _, r in drawn)
    rows_h = 2.2 if state else 1.2
    notes = 0.35 * len(refused)
    fig = plt.figure(figsize=(10, (1.9 + rows_h) * n + notes + 0.6), layout="constrained")
    grid = fig.add_gridspec(2 * n + (1 if refused else 0), 1,
                            height_ratios=[*([3, rows_h] * n), *([max(notes, 0.3)] if refused else [])])
    peak = max([budget] + [m for _, r in drawn for _, m in r.timeline.memory])
    div, unit = _bytes_unit(peak)
    end = max([r.iteration_s for _, r in drawn] + [b for _, r in drawn for _, b in r.timeline.compute]
              + [span[1] for _, r in drawn for spans in (r.timeline.d2h, r.timeline.h2d, r.timeline.state_d2h,
                                                         r.timeline.state_h2d, r.timeline.host_steps,
                                                         r.timeline.disk_reads, r.timeline.disk_writes)
                 for span in spans] or [1.0])
    first_m = None
    for j, (label, res) in enumerate(drawn):
        tl = res.timeline
        ax_m = fig.add_subplot(grid[2 * j], sharex=first_m, sharey=first_m)
        first_m = first_m or ax_m
        ax_s = fig.add_subplot(grid[2 * j + 1], sharex=first_m)
        ax_m.step([t for t, _ in tl.memory], [m / div for _, m in tl.memory], where="post", label="device memory")
        ax_m.axhline(budget / div, color="red", linestyle="--", label=f"budget {format_bytes(budget)}")
        status = f"{1e3 * res.iteration_s:.3f} ms, overhead {res.overhead:+.1%}" + (
            f", recompute {res.recompute_s / res.ideal_s:.1%}" if res.recompute_s else "")
        ax_m.set_title(f"{label}: {status}", fontsize=9, loc="left")
        ax_m.set_ylabel(unit)
        ax_m.legend(loc="upper right", fontsize=7)
        rows = [("compute", [(a, b) for a, b in tl.compute], "tab:blue"),
                ("d2h", [(a, b) for a, b, _ in tl.d2h], "tab:orange"),
                ("h2d", [(a, b) for a, b, _ in tl.h2d], "tab:green"),
                ("stall", [(a, b) for a, b, _ in tl.stalls], "tab:red")]
        if state:  # R13-R16, R19: the state on rows of its own
            rows += [("state d2h", [(a, b) for a, b, _ in tl.state_d2h], "tab:brown"),
                     ("state h2d", [(a, b) for a, b, _ in tl.state_h2d], "tab:olive"),
                     ("host step", [(a, b) for a, b, _ in tl.host_steps], "tab:gray"),
                     ("disk read", [(a, b) for a, b, _ in tl.disk_reads], "tab:cyan"),
                     ("disk write", [(a, b) for a, b, _ in tl.disk_writes], "tab:pink")]
        for y, (_, spans, color) in enumerate(rows):
            ax_s.broken_barh([(a, b - a) for a, b in spans], (y - 0.4, 0.8), color=color)
        # R9: recompute runs on the compute stream, drawn there in its own colour
        ax_s.broken_barh([(a, b - a) for a, b, _ in tl.recompute], (-0.4, 0.8), color="tab:purple",
                         label="recompute" if tl.recompute else None)
        if tl.recompute:
            ax_s.legend(loc="upper right", fontsize=7)
        ax_s.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
        ax_s.set_xlabel("time (s)" if j == len(drawn) - 1 else "")
    if first_m is not None:
        first_m.set_xlim(0, end * 1.01)
        first_m.set_ylim(0, peak / div * 1.08)
    if refused:
        ax_t = fig.add_subplot(grid[-1])
        ax_t.axis("off")
        lines = [f"{label}: does not fit {format_bytes(budget)}" + (f" (out of memory at event {r.oom_event})"
                                                                  if r.oom and r.oom_event is not None else "")
                 for label, r in refused]
        ax_t.text(0.0, 1.0, "\n".join(lines), va="top", ha="left", fontsize=9, transform=ax_t.transAxes)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


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

    from swapsched.budget import format_bytes

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
    fig, axes = plt.subplots(1, len(budgets), squeeze=False, sharey=True, layout="constrained",
                             figsize=(max(4.0, 0.55 * len(policies) + 1.5) * len(budgets) + 2.5, 2.2 + 0.17 * len(lines)))
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
        ax.set_title(f"budget {format_bytes(int(budget)) if budget.isdigit() else budget}", fontsize=9)
        if k == 0:
            ax.set_yticks(range(len(lines)), [f"{t} ({h})" for t, h in lines], fontsize=6)
    if image is not None:
        bar = fig.colorbar(image, ax=axes[0].tolist(), fraction=0.04, pad=0.02)
        bar.set_label("% over the floor (log)")
        bar.ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{100 * v:g}"))
    fig.suptitle("simulated step over the case's analytic floor (R8), % more", fontsize=10)
    fig.supxlabel("cells: % over the floor; - = the budget is below the smallest feasible; OOM = the plan does not fit",
                  fontsize=8)
    p = Path(path)
    with atomic_path(p) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return p


def plot_runs(results: Sequence[Any], path: str | Path, title: str = "", budget_bytes: int | None = None) -> Path:
    """``swapsched run``: median step time and peak device memory per method, against the budget
    (rows of ``run --compare`` or ``RunResult``s). A method over the budget is drawn hatched in
    grey on both panels; one that was refused (no step) is a word where its bars would be."""
    import math

    from swapsched.budget import format_bytes

    plt = _pyplot()
    names = [r.method for r in results]
    peaks_b = [getattr(r, "peak_bytes", None) or getattr(r, "peak_device_bytes", None) or 0 for r in results]
    steps = [1e3 * r.step_s_median for r in results]
    refused = [not math.isfinite(t) for t in steps]
    fits = [getattr(r, "fits", None) if getattr(r, "fits", None) is not None else
            (budget_bytes is None or p <= budget_bytes) for r, p in zip(results, peaks_b, strict=True)]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(names) * 2), 4.2), layout="constrained")
    div, unit = _bytes_unit(max([*peaks_b, budget_bytes or 0, 1]))
    for ax, values, color in ((ax_t, steps, "tab:blue"), (ax_m, [p / div for p in peaks_b], "tab:orange")):
        for k, (v, ok, gone) in enumerate(zip(values, fits, refused, strict=True)):
            if gone:
                ax.text(k, 0.03, "refused", rotation=90, ha="center", va="bottom", fontsize=9, color="dimgray",
                        transform=ax.get_xaxis_transform())
                continue
            ax.bar(k, v, color=color if ok else "lightgray", hatch=None if ok else "//", edgecolor="dimgray" if not ok else None)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(names) - 0.4)
    ax_t.set_ylabel("median step (ms)")
    from matplotlib.patches import Patch

    handles = []
    if budget_bytes:
        handles.append(ax_m.axhline(budget_bytes / div, color="red", linestyle="--", label=f"budget {format_bytes(budget_bytes)}"))
    if not all(fits):
        handles.append(Patch(facecolor="lightgray", hatch="//", edgecolor="dimgray", label="over the budget"))
    if handles:
        ax_m.legend(handles=handles, fontsize=8)
    ax_m.set_ylabel(f"peak device memory ({unit})")
    if title:
        fig.suptitle(title)
    p = Path(path)
    with atomic_path(p) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return p


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
