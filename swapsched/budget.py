"""Budgets: "6GiB", "6e9" (whole-device bytes) or "60%" of the activation peak (DESIGN.md)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from swapsched.errors import UserError

if TYPE_CHECKING:
    from swapsched.trace import Trace

__all__ = ["BudgetError", "parse_budget", "check_budget", "smallest_feasible", "relative_scale", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_RE = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z%]*)\s*$")


class BudgetError(UserError):
    """A budget string is malformed, out of range, or below what any plan can meet.
    ``smallest_bytes``: where the refusal found it, the smallest budget at which a plan fits."""

    def __init__(self, message: str, smallest_bytes: int | None = None):
        super().__init__(message)
        self.smallest_bytes = smallest_bytes


def parse_budget(spec: str | int | float, trace: Trace | None = None, *, check_feasible: bool = True) -> int:
    """Device-memory budget in bytes.

    ``"60%"`` is ``static_bytes`` + 60% of the no-swap peak above ``static_bytes`` (needs ``trace``);
    ``"100%"`` is exactly the no-swap peak. Both count the gradients the step makes as static
    (:func:`relative_scale`, R3), as if it began with them. With ``trace`` and ``check_feasible``, a budget below
    the smallest any plan can meet raises :class:`BudgetError` stating that smallest budget; for a
    trace that records its state (R13), the smallest with the state movable, and the host memory
    that needs.
    """
    number, unit = _split(spec)
    if unit == "%":
        if trace is None:
            raise BudgetError(f"budget {spec!r} is relative and needs a trace to resolve against")
        base, peak = relative_scale(trace)  # R3: the gradients counted static, whenever they are born
        out = int(base + math.floor((peak - base) * number / 100.0))
    else:
        out = int(number * _UNITS[unit])
    if trace is not None and check_feasible and out < trace.min_feasible_bytes_movable:
        need, pct = smallest_feasible(trace)
        if trace.state:
            host = sum(g.bytes for g in trace.state)
            raise BudgetError(
                f"budget {spec!r} = {format_bytes(out)} is below what any plan can meet for {trace.name!r}, even moving "
                f"its parameters, gradients and optimizer state: no plan meets less than "
                f"{format_bytes(trace.min_feasible_bytes_movable)} ({trace.min_feasible_bytes_movable} bytes) with "
                f"{format_bytes(host)} of host memory for the state (a bound: fetching a group ahead of its use needs "
                f"more, and a budget above it that no placement fits is refused with the smallest one does); "
                f"the smallest feasible budget with the state kept is {format_bytes(need)}"
            )
        raise BudgetError(
            f"budget {spec!r} = {format_bytes(out)} is below what any plan can meet for {trace.name!r}: "
            f"the smallest feasible budget is {format_bytes(need)} ({need} bytes, {pct:.1f}%)"
        )
    return out


def smallest_feasible(trace: Trace) -> tuple[int, float]:
    """The smallest budget any plan can meet, in bytes and as the percentage a relative budget
    would give it."""
    need = trace.min_feasible_bytes
    base, peak = relative_scale(trace)
    return need, (100.0 * (need - base) / (peak - base) if peak > base else 100.0)


def relative_scale(trace: Trace) -> tuple[int, int]:
    """``(base, peak)`` of which a relative budget is a share (``"60%"``: base + 60% of peak -
    base): the static bytes and the no-swap peak, with the gradients born in the step counted
    static (R3), so that a percentage means the same bytes whenever they are born."""
    born = trace.gradients_born_so_far  # in the other bytes; where the trace records the state, in its static bytes
    if trace.n_events == 0 or not (born.any() or trace.state_gradients_born):
        return int(trace.static_bytes), trace.peak_bytes_no_swap
    base = int(trace.static_bytes + born[-1])
    rest = trace.other_bytes - born + trace.resident_bytes_no_swap + trace.unsharded_in_use_bytes
    return base, int(base + max(int(rest.max()), 0))


def check_budget(spec: str | int | float) -> str | int | float:
    """``spec`` if it is a well-formed budget (checked where it is given, before any trace exists)."""
    _split(spec)
    return spec


def _split(spec: str | int | float) -> tuple[float, str]:
    """The number and unit of a budget, checked for form and range (not against a trace)."""
    if isinstance(spec, bool):
        raise BudgetError(f"budget must be bytes or a percentage, got {spec!r}")
    if isinstance(spec, (int, float)):
        number, unit = float(spec), ""
    else:
        m = _RE.match(str(spec))
        if not m:
            raise BudgetError(f"budget {spec!r} not understood; use bytes like '6GiB' or '6e9', or a percentage like '60%'")
        number, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(number) or number <= 0:
        raise BudgetError(f"budget {spec!r} must be a positive amount")
    if unit == "%":
        if number > 100:
            raise BudgetError(f"budget {spec!r} is over 100%; 100% is already the no-swap peak")
    elif unit not in _UNITS:
        raise BudgetError(f"budget {spec!r}: unknown unit {unit!r}; use B, KB, MB, GB, KiB, MiB, GiB or %")
    elif number * _UNITS[unit] < 1:
        raise BudgetError(f"budget {spec!r} is less than one byte")
    elif number * _UNITS[unit] > 2**63:
        raise BudgetError(f"budget {spec!r} is more bytes than any device has")
    return number, unit


def format_bytes(n: float) -> str:
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
