"""The simulator (pure numpy, R1-R8), the gymnasium environment over it, and the trace corpus.

``SwapEnv`` is imported lazily so that using the simulator never imports gymnasium. Importing
``swapsched.env.swap_env`` registers ``swapsched/Swap-v0``; ``gymnasium.make`` also accepts
``"swapsched.env.swap_env:swapsched/Swap-v0"``, which imports it for you.
"""

from typing import Any

from swapsched.env.corpus import corpus_index, load_corpus
from swapsched.env.floors import analytic_floor
from swapsched.env.result import SimResult
from swapsched.env.simulator import Simulation, simulate

__all__ = ["SimResult", "Simulation", "simulate", "analytic_floor", "SwapEnv", "corpus_index", "load_corpus"]


def __getattr__(name: str) -> Any:
    if name == "SwapEnv":
        from swapsched.env.swap_env import SwapEnv

        return SwapEnv
    raise AttributeError(name)
