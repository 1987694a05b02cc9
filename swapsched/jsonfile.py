"""JSON files as the project reads and writes them (traces, plans, reports, benchmarks): strict
JSON, gzip where the name says so, and reading that fails with an error naming the file, the field
and the value."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from swapsched._paths import atomic_path

__all__ = ["open_json", "plain_json", "write_json", "Fields"]


def open_json(path: str | Path, error: type[ValueError]) -> Any:
    """Read JSON or gzip'd JSON, turning I/O and syntax problems into ``error`` naming the file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise error(f"{p}: no such file") from None
    except OSError as exc:
        raise error(f"{p}: cannot read ({exc.strerror})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:  # EOFError: a truncated stream
            raise error(f"{p}: not valid gzip ({exc})") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{p}: not valid JSON ({exc})") from None


def plain_json(x: Any) -> Any:
    """``x`` as strict JSON values: NaN and infinities become null, numpy scalars and arrays plain."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: plain_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain_json(v) for v in x]
    if isinstance(x, np.ndarray):
        return plain_json(x.tolist())
    if isinstance(x, np.generic):
        return plain_json(x.item())
    return x


def write_json(data: Any, path: str | Path, indent: int | None = None) -> Path:
    """The one JSON writer (traces, plans, reports, benchmarks): strict JSON (``plain_json``),
    compact unless ``indent`` is given, gzip-compressed for a ``.gz`` path."""
    p = Path(path)
    text = json.dumps(plain_json(data), indent=indent, allow_nan=False,
                      separators=None if indent is not None else (",", ":"))
    if indent is not None:
        text += "\n"
    with atomic_path(p) as tmp:
        # mtime=0 so that rebuilding the corpus gives byte-identical files
        tmp.write_bytes(gzip.compress(text.encode(), mtime=0) if p.name.endswith(".gz") else text.encode())
    return p


class Fields:
    """Typed field access that raises ``error`` naming the source, the field and the value."""

    def __init__(self, source: str, error: type[ValueError]):
        self.source, self.error = source, error

    def fail(self, where: str, msg: str) -> None:
        raise self.error(f"{self.source}: field {where}: {msg}")

    def get(self, obj: Any, key: str, where: str, types: type | tuple[type, ...], *, optional: bool = False) -> Any:
        if not isinstance(obj, dict):
            self.fail(where.rsplit(".", 1)[0] or where, f"expected an object, got {type(obj).__name__}")
        if key not in obj:
            if optional:
                return None
            self.fail(where, "missing")
        value = obj[key]
        if value is None and optional:
            return None
        # bool is an int subclass; never accept it for a number
        if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            self.fail(where, f"expected {_tname(types)}, got {value!r}")
        if not isinstance(value, types):
            self.fail(where, f"expected {_tname(types)}, got {value!r}")
        return value

    def number(self, obj: Any, key: str, where: str, *, optional: bool = False, integer: bool = False) -> Any:
        types: tuple[type, ...] = (int,) if integer else (int, float)
        v = self.get(obj, key, where, types, optional=optional)
        if v is None:
            return None
        if isinstance(v, float) and not math.isfinite(v):
            self.fail(where, f"must be finite, got {v!r}")
        if v < 0:
            self.fail(where, f"must be >= 0, got {v!r}")
        return v


def _tname(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    names = {"int": "an integer", "float": "a number", "str": "a string", "list": "a list", "dict": "an object"}
    return " or ".join(dict.fromkeys(names.get(t.__name__, t.__name__) for t in ts))
