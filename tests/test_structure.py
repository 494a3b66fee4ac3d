"""The shape of the package, checked against the map in docs/architecture.md: every module
sits in one layer of the page's table, nothing imports a layer above its own, no import
circle, no source file that holds several jobs, no function a reader cannot take in at once,
a top level that holds only the core and the interfaces.

Imports are read with ``ast`` (nothing is imported), including those inside functions and
under TYPE_CHECKING: a lazy import still makes a dependency a reader must untangle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "specdecode"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_LINES = 450
MAX_FUNCTION_LINES = 80
MAX_TOP_LEVEL_MODULES = 18


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
    assert "specdecode.verify" in edges["specdecode.engine.core"]  # from ..verify import ... at module level
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


def layers_from_page(text: str) -> list[tuple[str, list[str]]]:
    """The "## Layers" table of the architecture page, lowest first: (layer, [module or
    package paths named in its "where" cell, e.g. "engine.py", "drafters/"])."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-", " "}:
            continue
        rows.append((cells[0], re.findall(r"`([\w./]+)`", cells[1])))
    return rows


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The index of the layer whose "where" names this module's file or a package folder above it."""
    rel = module.split(".")[1:]  # specdecode.drafters.base -> [drafters, base]
    candidates = set()
    if rel:
        candidates.add("/".join(rel) + ".py")
        candidates.update("/".join(rel[:i]) + "/" for i in range(1, len(rel) + 1))
    else:
        candidates.add("__init__.py")
    for i, (_, where) in enumerate(layers):
        if candidates & set(where):
            return i
    return None


def test_the_layer_reader_reads_a_crafted_page():
    page = ("# x\n## Layers\n\n| layer | where | owns |\n|---|---|---|\n| base | `errors.py`, `limits.py` | a |\n"
            "| models | `backends/` | b |\n| top | `api.py`, `__init__.py` | c |\n\n## Next\n| a | `x.py` | b |\n")
    layers = layers_from_page(page)
    assert [name for name, _ in layers] == ["base", "models", "top"]
    assert layer_of("specdecode.backends.base", layers) == 1
    assert layer_of("specdecode", layers) == 2
    assert layer_of("specdecode.x", layers) is None


def test_every_module_is_on_the_architecture_page():
    layers = layers_from_page(ARCHITECTURE.read_text(encoding="utf-8"))
    missing = sorted(m for m in import_graph() if layer_of(m, layers) is None)
    assert not missing, f"modules missing from the layer table of docs/architecture.md: {missing}"


def test_each_folder_is_one_layer():
    """A file's folder says what it may import: each package folder is named by one row of the
    layer table, and no row names a file inside another row's folder."""
    layers = layers_from_page(ARCHITECTURE.read_text(encoding="utf-8"))
    folders = sorted(p.parent.relative_to(PKG).as_posix() + "/" for p in PKG.rglob("__init__.py") if p.parent != PKG)
    for folder in folders:
        rows = [name for name, where in layers if any(w == folder or w.startswith(folder) for w in where)]
        assert len(rows) == 1, f"{folder} is named by the rows {rows} of docs/architecture.md's layer table"


def upward_imports(edges: dict[str, set[str]], layers: list[tuple[str, list[str]]]) -> list[str]:
    """Each import of a module from a layer above its own, as a line naming both layers."""
    upward = []
    for m, deps in edges.items():
        here = layer_of(m, layers)
        for d in deps:
            there = layer_of(d, layers)
            if here is not None and there is not None and there > here:
                upward.append(f"{m} ({layers[here][0]}) imports {d} ({layers[there][0]})")
    return sorted(upward)


def test_no_module_imports_a_layer_above_its_own():
    upward = upward_imports(import_graph(), layers_from_page(ARCHITECTURE.read_text(encoding="utf-8")))
    assert not upward, "imports against the layer order of docs/architecture.md:\n" + "\n".join(upward)


def test_the_layer_check_catches_a_planted_upward_import():
    layers = [("low", ["errors.py"]), ("mid", ["drafters/"]), ("high", ["assembly/"])]
    edges = {"specdecode.drafters.heads": {"specdecode.assembly.registry", "specdecode.errors"},
             "specdecode.assembly.registry": {"specdecode.errors"}, "specdecode.errors": set()}
    assert upward_imports(edges, layers) == ["specdecode.drafters.heads (mid) imports specdecode.assembly.registry (high)"]


def test_no_function_is_over_the_length_limit():
    long = []
    for _, _, path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_the_top_level_holds_only_the_core_and_the_interfaces():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
