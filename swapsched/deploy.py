"""``swapsched.SwapRuntime``: the runtime as users deploy it, with policies given by name.

The runtime proper (``swapsched.runtime.swapper.PolicyRuntime``) takes a policy object and knows no
names; this is the one place where a name (``"default"``, ``"min"``, ``"learned:PATH.zip"``) becomes
a policy for it.
"""

from __future__ import annotations

from typing import Any

from swapsched.agents.learned import LearnedPolicy
from swapsched.agents.registry import get_policy
from swapsched.hardware import Hardware
from swapsched.policy import Policy
from swapsched.runtime import swapper

__all__ = ["SwapRuntime", "CompileBackend", "resolve_policy", "RECOMPUTE_ONLY"]

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
        resolved = resolve_policy(policy)
        if isinstance(resolved, LearnedPolicy) and resolved.mode == "search" and "quick_policy" not in kwargs:
            # a new shape starts on the learned parts' own plan (milliseconds, on the loop's thread)
            # where it beats the borrowed one; the search then improves it in the background
            kwargs["quick_policy"] = LearnedPolicy(resolved.checkpoint, mode="greedy")
        super().__init__(budget, resolved, *args, **kwargs)


class CompileBackend:
    """A ``torch.compile`` backend that plans what each compiled graph offloads and recomputes
    (DESIGN.md, R10)::

        backend = swapsched.CompileBackend(budget="60%", policy="default", hardware="h100-pcie5")
        model = torch.compile(model, backend=backend)   # or block.compile(backend=backend) per block
        ...train as usual...
        print(backend.report())

    ``budget``, ``policy`` and ``hardware`` mean what they mean for :class:`SwapRuntime`; without
    ``hardware`` the plan is made for the default profile of the machine's device. ``inner`` is
    the compiler that compiles the lowered graphs: ``"inductor"`` (default) or ``"aot_eager"``.
    With a learned search policy (``default``), a graph of more than 500 saved tensors is planned
    by its learned parts alone (the report's "planned by" says so), keeping a compile's planning
    to a few seconds.
    A bad policy, budget or hardware fails here, before any step."""

    def __init__(self, budget: str | int = "60%", policy: str | Policy = "default", hardware: str | Hardware | None = None,
                 *, inner: str = "inductor"):
        import torch

        from swapsched.compiled.backend import PlannedBackend
        from swapsched.hardware import default_hardware, load_hardware

        hw = load_hardware(hardware if hardware is not None else default_hardware("cuda" if torch.cuda.is_available() else "cpu"))
        resolved = resolve_policy(policy)
        assert resolved is not None
        # a learned search policy gives its own greedy plan to the graphs its search would be slow on
        quick = (LearnedPolicy(resolved.checkpoint, mode="greedy")
                 if isinstance(resolved, LearnedPolicy) and resolved.mode == "search" else None)
        self._backend = PlannedBackend(budget, resolved, hw, inner=inner, quick_policy=quick)

    @classmethod
    def for_integration(cls, budget: str | int, policy: str | Policy | None, options: dict[str, Any], *, compiled: str,
                        otherwise: str, inner: str = "inductor") -> CompileBackend:
        """The backend an integration uses where the user compiles the model (HF ``Trainer``,
        Lightning): ``options`` are the runtime options the user gave, of which only ``hardware``
        and ``inner`` mean something to a compiled graph; ``compiled`` says what is compiled,
        ``otherwise`` how to get the hook runtime instead (both for the error)."""
        from swapsched.errors import UserError

        unknown = sorted(set(options) - {"hardware", "inner"})
        if unknown or policy is None:
            raise UserError(f"{compiled}, so swapsched plans its compiled graphs, which take "
                            f"{'a policy' if policy is None else 'no ' + ', '.join(unknown)}: pass a policy and only "
                            f"hardware= and inner=, or {otherwise} for the hook runtime")
        return cls(budget, policy, options.get("hardware"), inner=options.get("inner", inner))

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        return self._backend(gm, example_inputs)

    def report(self) -> Any:
        """A :class:`swapsched.compiled.backend.CompileReport`: one row per compiled graph."""
        return self._backend.report()
