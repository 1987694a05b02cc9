"""Where files live and how they are written.

The shipped data: ``configs/``, ``checkpoints/`` and the trace corpus ``env/traces/``, all inside
the package (``swapsched/configs``, ``swapsched/checkpoints``, ``swapsched/env/traces``) and
installed with it as package data. Every file swapsched writes goes through :func:`atomic_path`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["config_dir", "checkpoint_dir", "corpus_dir", "atomic_path"]

_ROOT = Path(__file__).resolve().parent


def config_dir() -> Path:
    return _ROOT / "configs"


def checkpoint_dir() -> Path:
    return _ROOT / "checkpoints"


def corpus_dir() -> Path:
    return _ROOT / "env" / "traces"


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to, renamed over ``path`` only when the block
    completes: an interrupted write (Ctrl-C, SIGTERM, a crash, a full disk) never leaves half a
    file where a good one was. The temporary name keeps the last suffix, which ``savefig``,
    ``np.savez`` and SB3's ``save`` read the format from."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.partial{p.suffix}")
    try:
        yield tmp
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
