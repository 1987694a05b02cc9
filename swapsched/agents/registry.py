"""Every policy by name. A policy is anything with ``plan(trace, budget, hardware) -> SwapPlan``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from swapsched.agents.heuristics import VDNN, Belady, Capuchin, NoSwap, SwapAll
from swapsched.agents.joint import LocalSearch
from swapsched.agents.learned import LearnedPolicy
from swapsched.agents.optimal import Optimal
from swapsched.agents.recompute import CheckpointAll, CheckpointOffload, CheckpointSelective
from swapsched.agents.search import SwapAdvisor
from swapsched.agents.state_search import PEERS
from swapsched.errors import UserError
from swapsched.policy import Policy

__all__ = ["Policy", "get_policy", "policy_names", "expand_policies", "PolicyError"]


class PolicyError(UserError):
    """Unknown policy name."""


def _factories() -> dict[str, Callable[..., Policy]]:
    return {
        "no-swap": lambda **kw: NoSwap(),
        "swap-all": lambda **kw: SwapAll(),
        "vdnn-all": lambda **kw: VDNN(conv_only=False),
        "vdnn-conv": lambda **kw: VDNN(conv_only=True),
        "min": lambda **kw: Belady(),
        "capuchin": lambda **kw: Capuchin(),
        "capuchin-swap": lambda **kw: Capuchin(recompute=False, name="capuchin-swap"),
        "checkpoint-all": lambda **kw: CheckpointAll(),
        "checkpoint-selective": lambda **kw: CheckpointSelective(),
        "checkpoint-offload": lambda **kw: CheckpointOffload(),
        "local-search": lambda seed=0, **kw: LocalSearch(seed=seed),
        "swapadvisor": lambda seed=0, search_seconds=10.0, **kw: SwapAdvisor(seed=seed, search_seconds=search_seconds),
        "optimal": lambda seed=0, **kw: Optimal(seed=seed),
        "default": lambda seed=0, **kw: LearnedPolicy("default", mode="search", seed=seed),
        "default-swap": lambda seed=0, **kw: LearnedPolicy("default", mode="search", seed=seed, recompute=False),
        "default-greedy": lambda **kw: LearnedPolicy("default", mode="greedy"),
        "default-greedy-guarded": lambda **kw: LearnedPolicy("default", mode="guarded"),
        "default-ppo": lambda **kw: LearnedPolicy("default", mode="ppo"),
        # R13-R16: the state offloaders users run (agents/state_search.py); on a trace without
        # its state they place nothing and checkpoint every block
        **{name: (lambda peer=peer, **kw: peer) for name, peer in PEERS.items()},
    }


def policy_names() -> list[str]:
    return list(_factories())


def get_policy(name: str, **options: Any) -> Policy:
    """A policy by registry name, or a learned policy from a checkpoint path (``*.zip``).

    ``options`` (``seed``, ``search_seconds``) reach the policies that take them."""
    facts = _factories()
    if name in facts:
        return facts[name](**options)
    if name.startswith("optimal:"):  # optimal:60s, a time limit

        spec = name.removeprefix("optimal:").removesuffix("s")
        try:
            limit = float(spec)
        except ValueError:
            limit = -1.0
        if not limit > 0:
            raise PolicyError(f"{name!r}: the time limit must be positive seconds, like optimal:60s")
        return Optimal(time_limit_s=limit, seed=options.get("seed", 0))
    for prefix, mode in (("learned-greedy:", "greedy"), ("learned-ppo:", "ppo")):
        if name.startswith(prefix):
            return LearnedPolicy(name.removeprefix(prefix), mode=mode)
    if name.endswith(".zip") or Path(name).is_file() or name.startswith("learned:"):
        return LearnedPolicy(name.removeprefix("learned:"), mode="search", seed=options.get("seed", 0))
    raise PolicyError(f"unknown policy {name!r}; known: {', '.join(facts)}, learned:PATH.zip, learned-greedy:PATH.zip, learned-ppo:PATH.zip or optimal:SECONDSs")


def expand_policies(spec: str) -> list[str]:
    """``all`` or a comma list, checked against the registry."""
    names = policy_names() if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise PolicyError("no policies given; use 'all' or a comma list like 'capuchin,min'")
    for n in names:
        if n not in policy_names() and not (n.endswith(".zip") or n.startswith(("learned:", "learned-greedy:", "learned-ppo:", "optimal:"))):
            raise PolicyError(f"unknown policy {n!r}; known: {', '.join(policy_names())}, or a checkpoint .zip")
    return names
