"""The package's import graph has no circle, counting every import: function-local ones (the CLI's
and the lazy top-level names) and ``TYPE_CHECKING`` ones, which ``lint-imports``' layer contracts
see only in part. A module's import of a package above it (how Python loads a submodule) is not an
edge."""

from __future__ import annotations

import ast
from pathlib import Path

import swapsched

ROOT = Path(swapsched.__file__).parent


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body."""
    mods = {}
    for p in root.rglob("*.py"):
        name = ".".join(("swapsched", *p.relative_to(root).with_suffix("").parts))
        mods[name.removesuffix(".__init__")] = p

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names if a.name.startswith("swapsched")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("swapsched"):
                targets = [resolve(f"{node.module}.{a.name}") for a in node.names]
            else:
                continue
            graph[m] |= {t for t in targets if t and t != m and not m.startswith(t + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_closes_a_circle():
    graph = import_graph()
    assert len(graph) > 50 and "swapsched.runtime.plans" in graph["swapsched.runtime.swapper"]
    assert circles(graph) == []


def test_a_circle_is_found(tmp_path):
    # the check itself: two modules that import each other, one of them inside a function
    pkg = tmp_path / "swapsched"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from swapsched.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from swapsched import a\n")
    (pkg / "c.py").write_text("import swapsched.a\n")
    assert circles(import_graph(pkg)) == [["swapsched.a", "swapsched.b"]]
