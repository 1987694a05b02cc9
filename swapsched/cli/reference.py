"""``docs/cli.md``, generated from the argparse parsers so it cannot drift from them.

``python -m swapsched.cli.reference > docs/cli.md`` writes it; ``tests/test_docs.py`` fails when
the file differs from what the parsers say.
"""

from __future__ import annotations

import argparse

__all__ = ["cli_reference"]


def _usage(p: argparse.ArgumentParser) -> str:
    return " ".join(p.format_usage().split())


def cli_reference() -> str:
    """Every command with its usage and each option's help, as Markdown."""
    from swapsched.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = ["# Command reference", "",
             "Generated from the parsers by `python -m swapsched.cli.reference > docs/cli.md` "
             "(a test checks it is current). Every command has `--help`; bad input exits 2 with one line.", ""]
    for name, p in sub.choices.items():
        lines += [f"## `swapsched {name}`", "", p.description or "", "", "```", _usage(p), "```", ""]
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags = ", ".join(f"`{f}`" for f in action.option_strings) or f"`{action.dest}`"
            text = (action.help or "").replace("%%", "%")
            if action.choices and not isinstance(action, argparse._SubParsersAction):
                text += f" (one of: {', '.join(map(str, action.choices))})"
            lines.append(f"- {flags}: {text}".rstrip())
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(cli_reference(), end="")
