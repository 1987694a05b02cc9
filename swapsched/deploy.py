"""``swapsched.SwapRuntime``: the runtime as users deploy it, with policies given by name.

The runtime proper (``swapsched.runtime.swapper.PolicyRuntime``) takes a policy object and knows no
names; this is the one place where a name (``"default"``, ``"min"``, ``"learned:PATH.zip"``) becomes
a policy for it.
"""

from __future__ import annotations

from typing import Any

from swapsched.agents.registry import get_policy
from swapsched.policy import Policy
from swapsched.runtime import swapper

__all__ = ["SwapRuntime", "resolve_policy", "RECOMPUTE_ONLY"]

#: Names whose plans only recompute (R9): the runtime runs them with the model's blocks under
#: ``torch.utils.checkpoint``, so it needs the model.
RECOMPUTE_ONLY = ("checkpoint-all", "checkpoint-selective")


def resolve_policy(policy: str | Policy | None, **options: Any) -> Policy | None:
    """A policy object from a registry name or checkpoint path; objects and ``None`` pass through."""
    if not isinstance(policy, str):
        return policy
    return get_policy(policy, **options)


class SwapRuntime(swapper.PolicyRuntime):
    """:class:`swapsched.runtime.swapper.PolicyRuntime` whose ``policy`` may also be a name
    (default ``"default"``, the shipped learned planner of keep / swap / recompute: it recomputes
    blocks only when given the ``model``, whose modules it records and checkpoints) or a
    checkpoint path."""

    def __init__(self, budget: str | int = "60%", policy: str | Policy | None = "default", *args: Any, **kwargs: Any):
        if policy in RECOMPUTE_ONLY and kwargs.get("model") is None:
            from swapsched.errors import UserError

            raise UserError(f"policy {policy!r} recomputes blocks, which the runtime runs under torch.utils.checkpoint "
                            "on the model's own modules: give it the model (SwapRuntime(..., model=model))")
        super().__init__(budget, resolve_policy(policy), *args, **kwargs)
