"""The probe scripts of benchmarks/ stay runnable: each imports (running nothing), builds its
argument parser in ``build_parser()`` and answers ``--help``; each reaches the package only
through its public names (no ``sys.path`` edits, no ``_private`` module or name, every
name it imports exists, those imported inside functions included); none writes under src/;
benchmarks/README.md indexes every script, and no page cites a script that is gone."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
SHELL = sorted(BENCHMARKS.glob("*.sh"))
CITED = re.compile(r"benchmarks/([A-Za-z0-9_]+\.(?:py|sh))\b")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) >= 10 and (BENCHMARKS / "README.md").exists()


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_script_imports_and_answers_help(path, capsys):
    module = _load(path)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
    parser = module.build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_importing_a_script_runs_nothing(path):
    """At the top level only imports, definitions, constants and the __main__ guard."""
    tree = ast.parse(path.read_text())
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Expr):
            assert i == 0 and isinstance(node.value, ast.Constant), f"{path.name}:{node.lineno} runs a statement"
        elif isinstance(node, ast.If):
            assert ast.unparse(node.test) == "__name__ == '__main__'", f"{path.name}:{node.lineno}"
        else:
            assert isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign,
                                     ast.AnnAssign)), f"{path.name}:{node.lineno}: {type(node).__name__} at import"


def _package_imports(tree: ast.Module):
    """(line, module, name or None) of every import of specdecode, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "specdecode":
            for a in node.names:
                yield node.lineno, node.module, a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "specdecode":
                    yield node.lineno, a.name, None


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_script_uses_only_the_public_api(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        assert not (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"), f"{path.name}:{node.lineno} edits sys.path"
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            pytest.fail(f"{path.name}:{node.lineno} reaches a private member .{node.attr}")
    for line, module, name in _package_imports(tree):
        where = f"{path.name}:{line}"
        assert not any(part.startswith("_") for part in module.split(".")), f"{where}: private module {module}"
        assert name is None or not name.startswith("_"), f"{where}: private name {name}"
        mod = importlib.import_module(module)
        if name is not None:  # a name of the module, or a submodule of a package
            found = hasattr(mod, name) or (hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}"))
            assert found, f"{where}: {module}.{name} is gone"


@pytest.mark.parametrize("path", SCRIPTS + SHELL, ids=lambda p: p.name)
def test_no_script_writes_into_the_package(path):
    text = path.read_text()
    assert not re.search(r"""["'/]src["'/]""", text), f"{path.name} names src/: results go under bench-out/ or --out"


def test_the_index_names_every_script_and_no_page_cites_a_gone_one():
    index = (BENCHMARKS / "README.md").read_text()
    for path in SCRIPTS + SHELL:
        assert f"`{path.name}`" in index or f"benchmarks/{path.name}" in index, f"README.md does not index {path.name}"
    pages = [ROOT / "README.md", BENCHMARKS / "README.md", *(ROOT / "docs").glob("*.md"), *SCRIPTS, *SHELL,
             *(ROOT / "src" / "specdecode").rglob("*.py")]
    for page in pages:
        for name in CITED.findall(page.read_text()):
            assert (BENCHMARKS / name).exists(), f"{page.relative_to(ROOT)} cites benchmarks/{name}, which is gone"
