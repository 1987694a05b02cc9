"""swapsched/plots.py: the compare heat map scales to a corpus; byte units fit the sizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swapsched.agents.evaluate import CaseResult
from swapsched.plots import _bytes_unit, plot_compare


def _rows(n_traces: int) -> list[CaseResult]:
    rows = []
    for t in range(n_traces):
        for b in ("30%", "70%"):
            for k, pol in enumerate(("swap-all", "min", "default")):
                step = 1.0 + 10.0 ** (-(t % 5)) * (k + 1)  # excesses over the floor across five decades
                res = SimpleNamespace(iteration_s=step, oom=(t == 3 and pol == "swap-all"), overhead=step - 1)
                rows.append(CaseResult(f"trace-{t}", b, "h100-pcie5", pol, result=res, floor_s=1.0,
                                       skipped="below the smallest feasible" if t == 4 and b == "30%" else None))
    return rows


@pytest.mark.parametrize("n", [6, 120])
def test_the_heat_map_grows_a_row_per_trace_and_stays_a_readable_width(tmp_path, n):
    from PIL import Image

    out = plot_compare(_rows(n), ["swap-all", "min", "default"], tmp_path / "c.png")
    w, h = Image.open(out).size
    assert w < 1400  # two budget panels of three policies, whatever the number of traces
    assert (h < 600) if n == 6 else (2000 < h < 3000)  # about a sixth of an inch (18 px) per trace


def test_byte_units_fit_the_size():
    assert _bytes_unit(10 * 2**20) == (2**20, "MiB") and _bytes_unit(3 * 2**30) == (2**30, "GiB")
    assert _bytes_unit(500) == (1.0, "B") and _bytes_unit(2048) == (1024, "KiB")


def test_timelines_share_one_time_and_memory_axis_and_a_policy_that_does_not_fit_is_a_line(tmp_path):
    from swapsched.agents.registry import get_policy
    from swapsched.env.simulator import simulate
    from swapsched.plots import timelines_figure
    from tests.conftest import make_hw, make_trace

    t = make_trace([100, 100], [("pack", 0, 1.0), ("pack", 1, 1.0), ("unpack", 1, 2.0), ("unpack", 0, 1.0)])
    hw = make_hw()
    fast = simulate(t, get_policy("no-swap").plan(t, 200, hw), hw, 200, record=True)
    slow = simulate(t, get_policy("swap-all").plan(t, 200, hw), hw, 200, record=True)
    oom = simulate(t, get_policy("no-swap").plan(t, 150, hw), hw, 150, record=True)
    assert oom.oom and slow.iteration_s > fast.iteration_s
    fig = timelines_figure([("keep", fast), ("swap", slow), ("too big", oom)], 150, "t")
    panels = [ax for ax in fig.axes if ax.axison]
    assert len(panels) == 4  # memory and streams of the two that ran; no axes for the one that did not fit
    assert len({ax.get_xlim() for ax in panels}) == 1 and panels[0].get_xlim()[1] >= slow.iteration_s
    assert panels[0].get_ylim() == panels[2].get_ylim()
    (note,) = [ax for ax in fig.axes if not ax.axison]
    assert "too big: does not fit 150 B" in note.texts[0].get_text()
