"""Policies: heuristics from the literature, genetic search, the exact reference and the learned policy.

Every policy has one signature, ``plan(trace, budget, hardware) -> SwapPlan``.
"""

from swapsched.agents.heuristics import VDNN, Belady, Capuchin, NoSwap, SwapAll
from swapsched.agents.joint import LocalSearch
from swapsched.agents.learned import LearnedPolicy
from swapsched.agents.optimal import Optimal
from swapsched.agents.registry import Policy, PolicyError, expand_policies, get_policy, policy_names
from swapsched.agents.search import SwapAdvisor

__all__ = [
    "Policy", "PolicyError", "get_policy", "policy_names", "expand_policies",
    "NoSwap", "SwapAll", "VDNN", "Belady", "Capuchin", "SwapAdvisor", "LocalSearch", "Optimal", "LearnedPolicy",
]
