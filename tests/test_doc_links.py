"""Every pointer to a docs section resolves: markdown links (``[x](server.md#codex-cli)``),
``docs/X.md#anchor`` in docstrings and ``--help`` text, and sections named in quotes after a
file (``[server.md](server.md), "Strict mode"``, ``docs/server.md ("Code completion: ...")``),
from the README, docs/, benchmarks/ and the package's source. Issue 61: five sections of
docs/server.md vanished in one commit while the README, docs/python.md and docstrings still
pointed to them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
           *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "src" / "specdecode").rglob("*.py"))]

LINK = re.compile(r"\]\(([^)\s#]*\.md)?(#[^)\s]+)?\)")
ANCHORED = re.compile(r"(?<![\w/(])((?:docs/)?[a-z_]+\.md)#([a-z0-9_-]+)")
QUOTED = re.compile(r"((?:\.\./)?(?:docs/)?[a-zA-Z_]+\.md)\)?\)?,? \(?\"([^\"\n]{3,100})\"")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped,
    spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The headings outside code fences (a fence: a line of 3+ backticks and an info string
    without backticks, closed by as many or more; ```` ```json ```` in a line is inline code)."""
    out, fence = [], ""
    for line in path.read_text().splitlines():
        if fence:
            if re.fullmatch(r" {0,3}`{%d,}\s*" % len(fence), line):
                fence = ""
        elif m := re.fullmatch(r" {0,3}(`{3,})[^`]*", line):
            fence = m.group(1)
        elif m := re.match(r"#{1,6} (.+)", line):
            out.append(m.group(1).strip())
    return out


def leads(path: Path) -> list[str]:
    """The bold leads of paragraphs and list items (``**The built-in suite**, ...``), which
    the docs name as sections too."""
    return [m.group(1) for m in re.finditer(r"^(?:- )?\*\*([^*\n]+)\*\*", path.read_text(), re.M)]


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(path):
        s = slug(h)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def target(source: Path, name: str | None) -> Path:
    """The markdown file a pointer in ``source`` names (None: the source itself)."""
    if name is None:
        return source
    if source.suffix == ".md":
        return (source.parent / name).resolve()
    name = name if name.startswith("docs/") or name == "README.md" else f"docs/{name}"
    return ROOT / name


def pointers() -> list[tuple[str, Path, str, str]]:
    """(where, the file pointed to, "anchor" or "section", the anchor or the section's name)."""
    out = []
    for src in SOURCES:
        text = src.read_text()
        for i, line in enumerate(text.splitlines(), 1):
            where = f"{src.relative_to(ROOT)}:{i}"
            if src.suffix == ".md":
                for m in LINK.finditer(line):
                    if m.group(2):
                        out.append((where, target(src, m.group(1)), "anchor", m.group(2)[1:]))
            else:
                for m in ANCHORED.finditer(line):
                    out.append((where, target(src, m.group(1)), "anchor", m.group(2)))
            for m in QUOTED.finditer(line):
                out.append((where, target(src, m.group(1)), "section", m.group(2)))
    return out


def plain(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", "")).strip().lower()


def test_the_pointers_are_found():
    """The scan finds the kinds of pointers it checks (a negative control for the patterns)."""
    kinds = {(p[2], p[1].name) for p in pointers()}
    assert ("anchor", "server.md") in kinds and ("section", "server.md") in kinds and ("section", "measured.md") in kinds
    assert slug("Code completion: `/infill`, keystrokes and `--cache-reuse`") == \
        "code-completion-infill-keystrokes-and---cache-reuse"


@pytest.mark.parametrize("where,path,kind,name", pointers(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_pointer_to_a_docs_section_resolves(where, path, kind, name):
    assert path.exists(), f"{where}: {path.relative_to(ROOT)} does not exist"
    if kind == "anchor":
        assert name in anchors(path), f"{where}: no section #{name} in {path.relative_to(ROOT)}"
    else:
        names = [plain(h) for h in headings(path) + leads(path)]
        assert any(h.startswith(plain(name)) for h in names), \
            f'{where}: no section "{name}" in {path.relative_to(ROOT)}'
