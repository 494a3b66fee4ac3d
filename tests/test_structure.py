"""The shape of the package: no import circle, and no source file that holds several jobs.

Imports are read with ``ast`` (nothing is imported), including those inside functions: a
lazy import still makes a circle a reader must untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "specdecode"
MAX_LINES = 450


def _modules() -> dict[str, tuple[ast.Module, bool, Path]]:
    mods = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        is_pkg = path.name == "__init__.py"
        if is_pkg:
            name = name[: -len(".__init__")]
        mods[name] = (ast.parse(path.read_text(encoding="utf-8")), is_pkg, path)
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (a package's __init__ counts as the package;
    importing a submodule does not count as importing its own parent package)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, (tree, is_pkg, _) in mods.items():
        pkg = m if is_pkg else m.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                cands = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            edges[m].update(c for c in cands if c in mods and c != m and not m.startswith(c + "."))
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(u: str, stack: list[str]) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif not state.get(v):
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(edges):
        if not state.get(m):
            visit(m, [])
    return cycles


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_relative_and_lazy_imports():
    edges = import_graph()
    assert "specdecode.verify" in edges["specdecode.engine"]  # from .verify import ... at module level
    assert "specdecode.api" in edges["specdecode.options"]  # from .api import Decoder inside a function


def test_the_package_has_no_import_circle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_the_cli_back():
    edges = import_graph()
    users = sorted(m for m, deps in edges.items() if "specdecode.cli" in deps and m != "specdecode.__main__")
    assert users == [], users


def test_no_source_file_is_over_the_size_limit():
    big = {str(p.relative_to(PKG)): n for _, _, p in _modules().values()
           if (n := p.read_text(encoding="utf-8").count("\n")) > MAX_LINES}
    assert not big, big
