"""swapsched: decide which saved activations to evict to host memory, and when to prefetch them.

Data flows one way: profile -> Trace -> policy -> SwapPlan -> simulator or runtime.
"""

from swapsched.budget import BudgetError, parse_budget
from swapsched.errors import UserError
from swapsched.hardware import Hardware, HardwareError, load_hardware
from swapsched.plan import Eviction, PlanError, SwapPlan, load_plan
from swapsched.trace import Event, TensorInfo, Trace, TraceError
from swapsched.trace_file import load_trace, save_trace

__version__ = "0.1.0"

__all__ = [
    "Trace", "TensorInfo", "Event", "TraceError", "load_trace", "save_trace",
    "SwapPlan", "Eviction", "PlanError", "load_plan",
    "Hardware", "HardwareError", "load_hardware",
    "parse_budget", "BudgetError", "UserError",
    "simulate", "get_policy", "profile", "build_model", "SwapRuntime", "CompileBackend", "fully_shard",
]


def __getattr__(name: str):  # heavy parts (torch, the policies) load on first use
    if name == "simulate":
        from swapsched.env.simulator import simulate

        return simulate
    if name == "get_policy":
        from swapsched.agents.registry import get_policy

        return get_policy
    if name == "profile":
        from swapsched.runtime.profiler import profile

        return profile
    if name == "build_model":
        from swapsched.zoo import build_model

        return build_model
    if name == "SwapRuntime":
        from swapsched.deploy import SwapRuntime

        return SwapRuntime
    if name == "CompileBackend":
        from swapsched.deploy import CompileBackend

        return CompileBackend
    if name == "fully_shard":
        from swapsched.fsdp import fully_shard

        return fully_shard
    raise AttributeError(f"module 'swapsched' has no attribute {name!r}")
