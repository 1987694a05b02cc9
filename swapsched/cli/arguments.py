"""The ``swapsched`` command's argument types: each checks its value where it is given, so that a
bad argument is one line and exit 2 (``Parser``), before any work is done."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swapsched.errors import UserError

__all__ = ["Parser", "csv_list", "budgets", "host_budget", "disk_budget", "ranks", "budget", "out_file", "out_dir", "in_file", "in_dir",
           "policy_list", "positive", "positive_int", "positive_float", "override"]


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (no usage dump) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def csv_list(value: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def budgets(value: str) -> list[str]:
    """A comma list of budgets, each checked for form where it is given."""
    from swapsched.budget import BudgetError, check_budget

    items = csv_list(value)
    for item in items:
        try:
            check_budget(item)
        except BudgetError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return items


def host_budget(value: str, what: str = "host budget", example: str = "'64GiB' (pinned host memory for this rank)") -> int:
    """A host budget (R11): bytes, like '64GiB' (a percentage has nothing to be a share of)."""
    from swapsched.budget import BudgetError, parse_budget

    if value.strip().endswith("%"):
        raise argparse.ArgumentTypeError(f"{what} {value!r}: give bytes, like {example}")
    try:
        return parse_budget(value)
    except BudgetError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("budget", what, 1)) from None


def disk_budget(value: str) -> int:
    """A disk budget (R19): bytes, like '1TiB'."""
    return host_budget(value, "disk budget", "'1TiB' (what this rank's state may rest on the drive)")


def override(value: str) -> tuple[str, str]:
    """A ``hf:`` config field to set, ``KEY=VALUE`` (the field is checked once the config is read)."""
    key, sep, val = value.partition("=")
    if not sep or not key.strip() or not val.strip():
        raise argparse.ArgumentTypeError(f"override {value!r}: give KEY=VALUE, like num_hidden_layers=4")
    return key.strip(), val.strip()


def ranks(value: str) -> list[int]:
    """A comma list of ranks per host, each a positive integer."""
    out = []
    for item in csv_list(value):
        if not item.isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(f"ranks per host must be positive integers, got {item!r}")
        out.append(int(item))
    return out


def budget(value: str) -> str:
    """One budget, checked for form where it is given."""
    from swapsched.budget import BudgetError, check_budget

    try:
        return str(check_budget(value))
    except BudgetError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _writable(path: Path) -> None:
    """Make ``path``'s folder and prove a file can be written in it, before any work is done."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".swapsched-probe-"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write in {path}: {exc.strerror or exc}") from None


def out_file(value: str) -> str:
    """An argparse type: a file path the command can write (checked now, written at the end)."""
    _writable(Path(value).parent)
    return value


def out_dir(value: str) -> str:
    """An argparse type: a folder the command can write files in."""
    _writable(Path(value))
    return value


def in_dir(value: str) -> str:
    """An argparse type: a directory that exists."""
    if not Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"{value}: no such directory")
    return value


def in_file(value: str) -> str:
    """An argparse type: a file that exists."""
    if not Path(value).is_file():
        raise argparse.ArgumentTypeError(f"{value}: no such file")
    return value


def policy_list(value: str) -> list[str]:
    """A comma list of policy names, each checked against the registry where it is given."""
    from swapsched.agents.registry import expand_policies

    try:
        return expand_policies(value)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive(cast: type) -> Callable[[str], Any]:
    """An argparse type: a positive int or float, or one clear line."""
    kind = "integer" if cast is int else "number"

    def parse(value: str) -> Any:
        try:
            v = cast(value)
        except ValueError:
            v = None
        if v is None or not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind}, got {value!r}")
        return v

    parse.__name__ = f"positive {kind}"
    return parse


positive_int = positive(int)
positive_float = positive(float)
