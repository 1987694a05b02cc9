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

__all__ = ["SwapRuntime", "resolve_policy", "RUNTIME_FORM", "RUNTIME_POLICIES_LEFT_OUT"]

#: The runtime executes swap plans; recompute (R9) is planned and simulated, not yet executed live.
#: A name whose planner recomputes is deployed as its swap-only form.
RUNTIME_FORM = {"default": "default-swap", "capuchin": "capuchin-swap"}
#: Names with no swap-only form: what they plan is measured live by ``run --compare``'s
#: ``checkpoint`` peer (torch.utils.checkpoint around each block) instead.
RUNTIME_POLICIES_LEFT_OUT = ("checkpoint-all",)


def resolve_policy(policy: str | Policy | None, **options: Any) -> Policy | None:
    """A policy object from a registry name or checkpoint path, in the form the runtime executes
    (``RUNTIME_FORM``); objects and ``None`` pass through."""
    if not isinstance(policy, str):
        return policy
    if policy in RUNTIME_POLICIES_LEFT_OUT:
        from swapsched.errors import UserError

        raise UserError(f"policy {policy!r} only recomputes, which the runtime does not execute yet; wrap your blocks "
                        "in torch.utils.checkpoint instead, or deploy a swap policy such as 'default'")
    return get_policy(RUNTIME_FORM.get(policy, policy), **options)


class SwapRuntime(swapper.SwapRuntime):
    """:class:`swapsched.runtime.swapper.SwapRuntime` whose ``policy`` may also be a name
    (default ``"default"``, the shipped learned planner, deployed in its swap-only form
    ``default-swap``: see ``RUNTIME_FORM``) or a checkpoint path."""

    def __init__(self, budget: str | int = "60%", policy: str | Policy | None = "default", *args: Any, **kwargs: Any):
        super().__init__(budget, resolve_policy(policy), *args, **kwargs)
