"""The base of every user-facing error: its message says what is wrong and what to do.

The CLI prints such an error as one line and exits 2. Internal invariants use ``assert`` instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["UserError", "read_yaml"]


class UserError(ValueError):
    """Bad input from the user: a file, a name, a number. Never a bug in swapsched."""


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
