"""The one signature every planner has: ``plan(trace, budget, hardware) -> SwapPlan``.

It lives with the nouns (not with the agents) so that the runtime, which executes plans, and the
agents, which make them, both depend on it and never on each other.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from swapsched.hardware import Hardware
from swapsched.plan import SwapPlan
from swapsched.trace import Trace

__all__ = ["Policy"]


@runtime_checkable
class Policy(Protocol):
    """A planner. ``budget`` is in bytes of saved activations on the device (after ``parse_budget``)."""

    @property
    def name(self) -> str:
        """What reports call it (a dataclass field or attribute satisfies this)."""
        ...

    def plan(self, trace: Trace, budget: int, hardware: Hardware) -> SwapPlan: ...
