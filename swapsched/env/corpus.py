"""The shipped corpus of measured and roofline traces (``env/traces/``), with its index.

Splits: ``train`` and ``test`` (the zoo's families and sizes, some held out), and ``generated``
(random architectures of ``swapsched/generated.py``, which the search's learned parts also train on).
"""

from __future__ import annotations

import json
from typing import Any

from swapsched._paths import corpus_dir
from swapsched.errors import UserError
from swapsched.trace import Trace
from swapsched.trace_file import load_trace

__all__ = ["corpus_index", "load_corpus", "CorpusError"]


class CorpusError(UserError):
    """The corpus is missing, or a requested trace is not in it."""


def corpus_index() -> list[dict[str, Any]]:
    """Rows of ``env/traces/index.json``: file, name, family, size, timing, device, split."""
    path = corpus_dir() / "index.json"
    if not path.is_file():
        raise CorpusError(f"no trace corpus at {corpus_dir()}; build it with: python scripts/build_traces.py")
    return json.loads(path.read_text())["traces"]


def load_corpus(split: str | None = None, names: list[str] | None = None) -> list[Trace]:
    """Traces of the corpus, optionally one split (``train``/``test``/``generated``) or a list of names."""
    rows = corpus_index()
    if split is not None:
        rows = [r for r in rows if r["split"] == split]
    if names is not None:
        known = {r["name"] for r in rows}
        missing = [n for n in names if n not in known]
        if missing:
            raise CorpusError(f"not in the corpus: {', '.join(missing)}; see env/traces/index.json")
        rows = [r for r in rows if r["name"] in names]
    return [load_trace(corpus_dir() / r["file"]) for r in rows]
