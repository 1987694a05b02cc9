"""``swapsched.SwapRuntime``: the runtime as users deploy it, with policies given by name.

The runtime proper (``swapsched.runtime.swapper.SwapRuntime``) takes a policy object and knows no
names; this is the one place where a name (``"default"``, ``"min"``, ``"learned:PATH.zip"``) becomes
a policy for it.
"""

from __future__ import annotations

from typing import Any

from swapsched.agents.registry import get_policy
from swapsched.policy import Policy
from swapsched.runtime import swapper

__all__ = ["SwapRuntime", "resolve_policy"]


def resolve_policy(policy: str | Policy | None, **options: Any) -> Policy | None:
    """A policy object from a registry name or checkpoint path; objects and ``None`` pass through."""
    return get_policy(policy, **options) if isinstance(policy, str) else policy


class SwapRuntime(swapper.SwapRuntime):
    """:class:`swapsched.runtime.swapper.SwapRuntime` whose ``policy`` may also be a name
    (default ``"default"``, the shipped learned planner) or a checkpoint path."""

    def __init__(self, budget: str | int = "60%", policy: str | Policy | None = "default", *args: Any, **kwargs: Any):
        super().__init__(budget, resolve_policy(policy), *args, **kwargs)
