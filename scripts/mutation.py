#!/usr/bin/env python
"""Mutation testing of the core modules: does each module's own test file fail on a realistic bug?

Each mutant is one small change to one line (a comparison or arithmetic operator swapped, a
constant moved by one, ``floor`` for ``ceil``, an argument dropped from ``max``/``min``, a statement
or a loop removed, two adjacent loops run in the other order, ``and`` for ``or``). It is applied
alone to a copy of the repository, and the module's own tests run on the copy (``-x``, hypothesis
derandomized). A mutant is *killed* if they fail (or time out), *survives* if they pass. The score
is killed / all. Survivors are listed with their line; each is either a missing test or an
equivalent change, which ``docs/RESULTS.md`` says.

    python scripts/mutation.py [--modules simulator,budget,plan,bound] [--jobs 2] [--out bench_results/mutation.json]
    python scripts/mutation.py --list --modules budget     # the mutants, without running them
    python scripts/mutation.py --named                      # the six bugs issue 23 found surviving, each alone
    python scripts/mutation.py --modules simulator --survivors-of bench_results/mutation_sim.json   # after adding tests

Not a test: it takes tens of minutes (a few seconds of tests per mutant). Run it alone.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: module -> (source file, its own tests)
TARGETS = {
    "simulator": ("swapsched/env/simulator.py", ["tests/env/test_simulator.py", "tests/env/test_swap_env.py"]),
    "floors": ("swapsched/env/floors.py", ["tests/env/test_floors.py"]),
    "budget": ("swapsched/budget.py", ["tests/swapsched/test_budget.py"]),
    "plan": ("swapsched/plan.py", ["tests/swapsched/test_plan.py"]),
    "bound": ("swapsched/agents/bound.py", [f"tests/agents/test_bound.py::{t}" for t in (
        "test_latency_makes_the_bound_tighter_than_the_floor",
        "test_a_swap_in_must_fit_between_its_gap_and_its_first_unpack",
        "test_two_swap_ins_share_the_host_to_device_engine_after_one_gap",
        "test_two_swap_outs_share_the_device_to_host_engine_before_one_gap",
        "test_hooks_tail_static_and_workspace_enter_the_bound",
        "test_nothing_over_budget_no_events_or_a_floor_above_the_relaxation_return_the_floor",
        "test_two_blocks_each_with_its_own_recompute_variable",
        "test_one_byte_over_budget_puts_a_whole_tensor_away",
        "test_a_tensor_the_program_still_holds_cannot_be_away",
        "test_max_gaps_checks_the_most_over_gaps_first",
        "test_spread_picks_evenly_and_keeps_short_lists",
        "test_a_block_member_the_program_still_holds_is_not_freed_by_recomputing",
        "test_where_the_solver_proves_nothing_the_bound_is_the_floor",
        "test_the_solver_gets_what_is_left_of_the_time_limit_and_at_least_half_a_second",
        "test_a_recomputed_member_is_not_also_counted_away_by_a_swap",
        "test_a_member_of_a_later_block_is_not_also_counted_away_by_a_swap",
        "test_a_selective_recompute_has_its_own_variable",
        "test_two_selective_blocks_each_with_their_own_variables",
        "test_a_block_is_not_recomputed_whole_and_selectively_at_once",
        # the pinned cases alone: each asserts the bound's exact value, so a mutant that lowers or
        # raises it there fails. The soundness properties (bound <= every plan, over random cases)
        # run in the suite but would make a run take hours here: the score is a lower bound
        "test_recompute_tightens_nothing_it_cannot_prove")]),
}

#: Bugs found by hand that the suite once let through (issue 23): (what, file, text, replacement, tests).
#: ``None`` text: R5 (d) run before (c), made by moving the block.
NAMED = [
    ("R6: a swap-in starts before its own swap-out ends", "swapsched/env/simulator.py",
     "start = max(at, self.h2d_free, self.out_done[k])", "start = max(at, self.h2d_free)", ["tests/env"]),
    ("R5: prefetches at an event issued before its swap-outs", "swapsched/env/simulator.py", None, None, ["tests/env"]),
    ("a percentage budget rounds up", "swapsched/budget.py", "math.floor(above * number / 100.0)",
     "math.ceil(above * number / 100.0)", ["tests/swapsched/test_budget.py"]),
    ("the bound loses its d2h capacity rows", "swapsched/agents/bound.py",
     "            row([*sel, (j, -1.0), (int(q), 1.0)], float(G[j] - G[q + 1]))\n", "", ["tests/agents/test_bound.py"]),
    ("copy latency paid once per busy engine", "swapsched/env/simulator.py", "end = start + self.lat + b * self.inv_d2h",
     "end = start + (self.lat if self.t > self.d2h_free else 0.0) + b * self.inv_d2h", ["tests/env"]),
    ("freed at the first unpack", "swapsched/env/simulator.py",
     "zip(trace.first_pack.tolist(), trace.last_unpack.tolist(), strict=False)):",
     "zip(trace.first_pack.tolist(), trace.first_unpack.tolist(), strict=False)):", ["tests/env"]),
]


def _named_source(path: Path, old: str | None, new: str | None) -> str:
    src = path.read_text()
    if old is None:  # R5: move (d) before (c)
        i0, i1 = src.index("            # -- (c) swap-outs planned at i"), src.index("            # -- (d) prefetches planned at i")
        i2 = src.index("            self.next_event = i + 1")
        return src[:i0] + src[i1:i2] + src[i0:i1] + src[i2:]
    if old not in src:
        raise SystemExit(f"{path}: the code a named mutant changes is gone ({old[:60]!r}); update NAMED")
    return src.replace(old, new or "", 1)


_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div}
_NAMES = {"floor": "ceil", "ceil": "floor"}


@dataclass(frozen=True)
class Mutant:
    module: str
    line: int
    kind: str
    before: str
    after: str


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    killed: bool
    seconds: float
    detail: str


def _skip_lines(tree: ast.Module) -> set[int]:
    """Lines not worth mutating: docstrings, ``__all__``, assert messages, error messages
    (f-strings), and ``if self.record:`` blocks (the timeline for plots, not the result)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str):
            d = node.body[0]
            skip.update(range(d.lineno, (d.end_lineno or d.lineno) + 1))
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if isinstance(node, ast.Raise):
            skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if isinstance(node, ast.If) and ast.unparse(node.test) == "self.record":
            skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return skip


class _Sites(ast.NodeVisitor):
    """Every mutation site: (node id path, kind, a function that mutates the node in place)."""

    def __init__(self, skip: set[int]):
        self.skip = skip
        self.sites: list[tuple[ast.AST, str]] = []

    def generic_visit(self, node: ast.AST) -> None:
        line = getattr(node, "lineno", None)
        if line is None or line not in self.skip:
            if isinstance(node, ast.Compare) and type(node.ops[0]) in _CMP:
                self.sites.append((node, "compare"))
            elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _BIN:
                self.sites.append((node, "arith"))
            elif isinstance(node, ast.BoolOp):
                self.sites.append((node, "boolop"))
            elif isinstance(node, ast.Constant) and type(node.value) is int and not isinstance(node.value, bool):
                self.sites.append((node, "const"))
            elif isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name in ("max", "min") and len(node.args) >= 2:
                    for i in range(len(node.args)):
                        self.sites.append((node, f"drop-arg-{i}"))
            elif isinstance(node, (ast.Name, ast.Attribute)) and (node.id if isinstance(node, ast.Name) else node.attr) \
                    in ("floor", "ceil") and isinstance(getattr(node, "ctx", None), ast.Load):
                self.sites.append((node, "name"))
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                self.sites.append((node, "not"))
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and all(isinstance(s, ast.stmt) for s in block):
                for i, stmt in enumerate(block):
                    if stmt.lineno in self.skip or isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.Return, ast.Raise,
                                                                      ast.Import, ast.ImportFrom)):
                        continue
                    if isinstance(stmt, (ast.Expr, ast.Assign, ast.AugAssign, ast.For, ast.If, ast.While)) \
                            and not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
                        self.sites.append((node, f"delete-{field}-{i}"))
                    if i + 1 < len(block) and isinstance(stmt, (ast.For, ast.If)) and isinstance(block[i + 1], (ast.For, ast.If)):
                        self.sites.append((node, f"swap-{field}-{i}"))
        super().generic_visit(node)


def _apply(node: ast.AST, kind: str) -> None:
    if kind == "compare":
        node.ops[0] = _CMP[type(node.ops[0])]()
    elif kind == "arith":
        node.op = _BIN[type(node.op)]()
    elif kind == "boolop":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "const":
        node.value = node.value + 1 if node.value != 1 else 0
    elif kind.startswith("drop-arg-"):
        del node.args[int(kind.rsplit("-", 1)[1])]
        if len(node.args) == 1:  # max(a) would be a TypeError, not a bug: max(a, a) is a
            node.args.append(node.args[0])
    elif kind == "name":
        if isinstance(node, ast.Name):
            node.id = _NAMES[node.id]
        else:
            node.attr = _NAMES[node.attr]
    elif kind == "not":
        raise AssertionError("handled by the transformer")
    elif kind.startswith("delete-"):
        _, field, i = kind.split("-")
        block = getattr(node, field)
        block[int(i)] = ast.Pass()
    elif kind.startswith("swap-"):
        _, field, i = kind.split("-")
        block = getattr(node, field)
        j = int(i)
        block[j], block[j + 1] = block[j + 1], block[j]


def _changed_lines(path: str, rev: str) -> set[int]:
    """Lines of ``path`` (as it is now) added or changed since ``rev``, from ``git diff -U0``."""
    diff = subprocess.run(["git", "diff", "-U0", rev, "--", path], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    out: set[int] = set()
    for line in diff.splitlines():
        if line.startswith("@@"):
            new = line.split("+", 1)[1].split(" ", 1)[0]  # "@@ -a,b +c,d @@": lines c .. c+d-1
            start, _, count = new.partition(",")
            out.update(range(int(start), int(start) + (int(count) if count else 1)))
    return out


def mutants(module: str) -> list[tuple[Mutant, str]]:
    """Every mutant of ``module``, with the mutated source."""
    path = ROOT / TARGETS[module][0]
    source = path.read_text()
    n_sites = len(_site_list(ast.parse(source)))
    out = []
    for idx in range(n_sites):
        tree = ast.parse(source)
        node, kind = _site_list(tree)[idx]
        shown = node
        if kind.startswith(("delete-", "swap-")):
            field, i = kind.split("-")[1:]
            shown = getattr(node, field)[int(i)]
        line = getattr(shown, "lineno", 0)
        before = _short(shown)
        if kind == "not":
            tree = _Unnot(node).visit(tree)
            after = _short(node.operand)
        else:
            _apply(node, kind)
            after = {"delete": "pass", "swap": "(run after the next statement)"}.get(kind.split("-")[0]) or _short(node)
        ast.fix_missing_locations(tree)
        try:
            mutated = ast.unparse(tree)
            compile(mutated, str(path), "exec")
        except (SyntaxError, ValueError):
            continue
        out.append((Mutant(module, line, kind.split("-")[0] if kind.startswith(("delete", "swap", "drop")) else kind,
                           before, after), mutated))
    return out


def _short(node: ast.AST) -> str:
    return ast.unparse(node).splitlines()[0][:100]


def _site_list(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    v = _Sites(_skip_lines(tree))
    v.visit(tree)
    return v.sites


class _Unnot(ast.NodeTransformer):
    def __init__(self, target: ast.AST):
        self.target = target

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        if node is self.target:
            return node.operand
        return self.generic_visit(node)


def _run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--hypothesis-seed=0",
           "-m", "not slow and not gpu", *tests]
    try:
        r = subprocess.run(cmd, cwd=copy, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return True, "timeout"
    tail = (r.stdout.strip().splitlines() or [""])[-1]
    return r.returncode != 0, tail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}")
    ap.add_argument("--jobs", type=int, default=2, help="mutants run at once, each in its own copy")
    ap.add_argument("--list", action="store_true", help="print the mutants and stop")
    ap.add_argument("--named", action="store_true", help="run only the bugs in NAMED, each against its module's tests")
    ap.add_argument("--out", default="bench_results/mutation.json")
    ap.add_argument("--survivors-of", metavar="JSON",
                    help="run again only the mutants that survived (or timed out) in this earlier run's output, "
                         "whose source files are unchanged since: tests only added cannot revive a killed mutant")
    ap.add_argument("--changed-since", metavar="REV",
                    help="run only the mutants on lines changed since this git revision (git diff -U0): the "
                         "rest were measured on that revision, and its run's figures stand for them")
    args = ap.parse_args()
    modules = [m.strip() for m in args.modules.split(",") if m.strip()]
    bad = [m for m in modules if m not in TARGETS]
    if bad:
        ap.error(f"unknown module(s) {bad}; choose from {', '.join(TARGETS)}")
    from tqdm import tqdm

    from swapsched.report import format_grid

    if args.named:
        return _run_named()
    work = [(m, mut, src) for m in modules for mut, src in mutants(m)]
    if args.changed_since:
        changed = {m: _changed_lines(TARGETS[m][0], args.changed_since) for m in modules}
        work = [(m, mut, src) for m, mut, src in work if mut.line in changed[m]]
    earlier: dict[str, int] = {}  # module -> mutants killed in the earlier run and not run again
    if args.survivors_of:
        data = json.loads(Path(args.survivors_of).read_text())
        prev = data["outcomes"]
        again = {(o["module"], o["line"], o["kind"], o["before"], o["after"]) for o in prev
                 if not o["killed"] or o.get("detail") == "timeout"}
        root = data
        while root.get("rerun_of"):  # a rerun holds only its survivors' outcomes: the full run has them all
            root = json.loads(Path(root["rerun_of"]).read_text())
        # a rerun may take a subset of the earlier run's modules
        known = {(o["module"], o["line"], o["kind"], o["before"], o["after"]) for o in root["outcomes"]
                 if o["module"] in modules}
        mine = work
        # the same mutants, line for line, or the source changed since and the earlier kills say nothing
        if {(mut.module, mut.line, mut.kind, mut.before, mut.after) for _, mut, _ in mine} != known:
            raise SystemExit(f"{args.survivors_of}: its mutants are not this code's (the source changed since): run all")
        work = [(m, mut, src) for m, mut, src in mine if (mut.module, mut.line, mut.kind, mut.before, mut.after) in again]
        for m in modules:
            earlier[m] = sum(1 for _, mut, _ in mine if mut.module == m) - sum(1 for _, mut, _ in work if mut.module == m)
    if args.list:
        for _, mut, _ in work:
            print(f"{mut.module}:{mut.line} {mut.kind}: {mut.before}  ->  {mut.after}")
        print(f"{len(work)} mutants")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="swapsched-mutation-"))
    copies = []
    for j in range(max(args.jobs, 1)):
        dst = tmp / f"copy{j}"
        shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", "bench_results", "__pycache__", "*.egg-info"))
        copies.append(dst)
    # the clean copy's own test time sets each module's timeout
    timeouts = {}
    for m in modules:
        t0 = time.perf_counter()
        failed, tail = _run_tests(copies[0], TARGETS[m][1], timeout=900)
        if failed:
            print(f"the unmutated tests of {m} fail ({tail}); fix them first", file=sys.stderr)
            return 1
        timeouts[m] = 3 * (time.perf_counter() - t0) + 20
    free = list(copies)
    outcomes: list[Outcome] = []

    def one(item: tuple[str, Mutant, str]) -> Outcome:
        m, mut, src = item
        copy = free.pop()
        target = copy / TARGETS[m][0]
        original = target.read_text()
        try:
            target.write_text(src)
            t0 = time.perf_counter()
            killed, detail = _run_tests(copy, TARGETS[m][1], timeouts[m])
            return Outcome(mut, killed, time.perf_counter() - t0, detail)
        finally:
            target.write_text(original)
            free.append(copy)

    with ThreadPoolExecutor(max_workers=len(copies)) as pool:
        for o in tqdm(pool.map(one, work), total=len(work), desc="mutants"):
            outcomes.append(o)
    shutil.rmtree(tmp, ignore_errors=True)
    rows, summary = [], {}
    for m in modules:
        mine = [o for o in outcomes if o.mutant.module == m]
        killed = sum(o.killed for o in mine) + earlier.get(m, 0)
        total = len(mine) + earlier.get(m, 0)
        summary[m] = {"mutants": total, "killed": killed, "score": killed / total if total else None,
                      "killed_in_earlier_run": earlier.get(m, 0)}
        rows.append([m, TARGETS[m][0], str(total), str(killed), f"{100 * killed / max(total, 1):.1f}%"])
    total = len(outcomes) + sum(earlier.values())
    killed = sum(o.killed for o in outcomes) + sum(earlier.values())
    rows.append(["all", "", str(total), str(killed), f"{100 * killed / max(total, 1):.1f}%"])
    print(format_grid(["module", "file", "mutants", "killed", "score"], rows))
    survivors = [o for o in outcomes if not o.killed]
    for o in survivors:
        print(f"survived {o.mutant.module}:{o.mutant.line} {o.mutant.kind}: {o.mutant.before}  ->  {o.mutant.after}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "rerun_of": args.survivors_of, "changed_since": args.changed_since,
                               "survivors": [asdict(o.mutant) for o in survivors],
                               "outcomes": [{**asdict(o.mutant), "killed": o.killed, "seconds": round(o.seconds, 2),
                                             "detail": o.detail} for o in outcomes]}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _run_named() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="swapsched-named-"))
    copy = tmp / "copy"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "bench_results", "__pycache__", "*.egg-info"))
    survived = 0
    for what, rel, old, new, tests in NAMED:
        target = copy / rel
        original = target.read_text()
        target.write_text(_named_source(ROOT / rel, old, new))
        killed, detail = _run_tests(copy, tests, timeout=900)
        target.write_text(original)
        survived += not killed
        print(f"{'killed  ' if killed else 'SURVIVED'} {what} ({rel}; {detail})", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
