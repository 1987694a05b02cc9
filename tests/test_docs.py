"""README.md and docs/: every Python block runs as written, the README's command-line example
runs, and docs/cli.md is what the parsers say.

A plain extractor rather than a plugin (pytest-markdown-docs, phmdoctest): the blocks are whole
programs, not doctests, and one runner that execs each in a fresh namespace needs no
dependency. A block whose first line is ``# gpu`` runs only in the ``gpu`` tests.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for k, m in enumerate(m for m in FENCE.finditer(page.read_text()) if m.group(1) == lang):
            out.append((f"{page.relative_to(ROOT)}#{k}", m.group(2)))
    return out


PYTHON = blocks("python")


def test_there_are_examples_to_run():
    assert len(PYTHON) >= 7 and any(name.startswith("README.md") for name, _ in PYTHON)


@pytest.mark.parametrize(("name", "code"), [pytest.param(n, c, marks=[pytest.mark.gpu] if c.startswith("# gpu") else [],
                                                         id=n) for n, c in PYTHON])
def test_every_python_block_runs(name, code, tmp_path, monkeypatch):
    if code.startswith("# gpu") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    torch._dynamo.reset()
    exec(compile(code, name, "exec"), {"__name__": "__docs__"})  # noqa: S102 - our own documentation


def test_the_readmes_command_line_example_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## From the command line", 1)[1]
    commands = [line for line in FENCE.search(section).group(2).splitlines() if line.strip()]
    assert len(commands) >= 3
    exe = shutil.which("swapsched")
    for line in commands:
        args = shlex.split(line)
        assert args[0] == "swapsched"
        cmd = [exe, *args[1:]] if exe else [sys.executable, "-m", "swapsched.cli", *args[1:]]
        r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{line}\n{r.stderr}"


def test_the_cli_reference_is_current():
    from swapsched.cli.reference import cli_reference

    assert (ROOT / "docs" / "cli.md").read_text() == cli_reference(), (
        "docs/cli.md is stale: python -m swapsched.cli.reference > docs/cli.md")


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
