"""Where the shipped data lives: ``configs/``, ``checkpoints/`` and the trace corpus ``env/traces/``.

All three sit inside the package (``swapsched/configs``, ``swapsched/checkpoints``,
``swapsched/env/traces``) and are installed with it as package data.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["config_dir", "checkpoint_dir", "corpus_dir"]

_ROOT = Path(__file__).resolve().parent


def config_dir() -> Path:
    return _ROOT / "configs"


def checkpoint_dir() -> Path:
    return _ROOT / "checkpoints"


def corpus_dir() -> Path:
    return _ROOT / "env" / "traces"
