"""The base of every user-facing error: its message says what is wrong and what to do.

The CLI prints such an error as one line and exits 2. Internal invariants are apart from them:
``internal_assert`` raises :class:`InternalError` (a bug of swapsched's, "please report"), and,
unlike a bare ``assert``, still checks under ``python -O`` (as ``torch._utils_internal`` and
``torch.utils.checkpoint`` keep their internal checks apart from the errors they raise to users).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml

__all__ = ["UserError", "InternalError", "internal_assert", "present", "read_yaml"]

T = TypeVar("T")



class UserError(ValueError):
    """Bad input from the user: a file, a name, a number. Never a bug in swapsched."""


class InternalError(RuntimeError):
    """An invariant of swapsched's own code broke: a bug of ours, never the user's input."""


def internal_assert(condition: bool, what: str) -> None:
    """Raise :class:`InternalError` saying ``what`` should have held, unless it does."""
    if not condition:
        raise InternalError(f"internal error in swapsched: {what}. This is a bug of swapsched's, not of "
                            "your program; please report it with the traceback")


def present(value: T | None, what: str) -> T:
    """``value``, which the caller's state guarantees is set (``what`` names it), else :class:`InternalError`."""
    internal_assert(value is not None, f"{what} is not set")
    return value  # type: ignore[return-value]


def read_yaml(path: str | Path, error: type[UserError]) -> Any:
    """Read a YAML file, turning I/O, encoding and syntax problems into one line of ``error``
    naming the file (and the line, for a syntax error)."""
    p = Path(path)
    try:
        return yaml.safe_load(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{p}: no such file") from None
    except OSError as exc:
        raise error(f"{p}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise error(f"{p}: not a text file (not UTF-8)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise error(f"{p}: not valid YAML{where}: {' '.join(str(problem).split())}") from None
