"""Where the shipped data lives: configs/, checkpoints/ and the trace corpus env/traces/.

The folders sit at the repository's top level (the design card's layout) and are installed as
data packages ``swapsched.configs``, ``swapsched.checkpoints`` and ``swapsched.env``.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

__all__ = ["config_dir", "checkpoint_dir", "corpus_dir"]


@lru_cache(maxsize=None)
def _package_dir(name: str, fallback: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if Path(loc).is_dir():
                return Path(loc)
    # running from a source checkout without installing
    return Path(__file__).resolve().parents[1] / fallback


def config_dir() -> Path:
    return _package_dir("swapsched.configs", "configs")


def checkpoint_dir() -> Path:
    return _package_dir("swapsched.checkpoints", "checkpoints")


def corpus_dir() -> Path:
    return _package_dir("swapsched.env", "env") / "traces"
