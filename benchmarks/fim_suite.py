"""Write the built-in suite's ``fim`` category: fill-in-the-middle completions cut from real
source files, as an editor sends them (the code above the cursor, the code below it, and for
one of them another open file).

Each entry is cut from a file of the CPython 3.11.7 standard library (Python Software Foundation
License) or from matplotlib 3.11.2's ``backends/web_backend/js/mpl.js`` (the Matplotlib
License, BSD-style), as installed on the machine the suite was made on; its ``source`` names
the file and the lines, and ``middle`` keeps the text the cut took out (the model writes its own
middle: the bench times what the model writes, up to its end token or ``max_tokens``).
``repeats`` says where the middle's code is found again: ``prefix`` (a method mirroring the one
above it, a test case like the one above, a literal continued), ``suffix`` (the functions below
share its body), ``extra`` (the same method in another open file, sent as repository context),
or ``none``.

    python benchmarks/fim_suite.py --out bench-out/bench_suite.jsonl

reads the package's suite, replaces its ``fim`` entries with these and writes the whole suite
to ``--out`` (never into the package: review it, then copy it over
``src/specdecode/data/bench_suite.jsonl``). A cut whose cursor line is not the expected text
(another version of the file) stops the script with the entry's id.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from importlib import resources
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
MPL_JS = Path(sysconfig.get_paths()["purelib"]) / "matplotlib/backends/web_backend/js/mpl.js"
MAX_TOKENS = 128  # a middle of a few lines: the model's end token normally comes first

# id, file, repeats, first prefix line, cursor line (the middle starts there), its expected start,
# first suffix line, last suffix line (1-based, inclusive), extra files (name, file, first, last)
CUTS = [
    ("fim-datetime-timedelta-ge", STDLIB / "datetime.py", "prefix", 760, 855,
     "        if isinstance(other, timedelta):", 866, 895, ()),
    ("fim-argparse-store-false", STDLIB / "argparse.py", "prefix", 900, 1001,
     "    def __init__(self,", 1014, 1055, ()),
    ("fim-test-colorsys-yiq-roundtrip", STDLIB / "test/test_colorsys.py", "prefix", 1, 83,
     "        for r in frange(0.0, 1.0, 0.2):", 91, 110, ()),
    ("fim-stat-filemode-table", STDLIB / "stat.py", "prefix", 82, 143,
     "    ((S_IRGRP,         \"r\"),),", 154, 172, ()),
    ("fim-mpl-js-rubberband", MPL_JS, "prefix", 400, 463,
     "    var x1 = msg['x1'] / fig.ratio;", 469, 510, ()),
    ("fim-mpl-js-modifiers", MPL_JS, "prefix", 559, 635,
     "    if (event.shiftKey) {", 641, 680, ()),
    ("fim-statistics-median", STDLIB / "statistics.py", "suffix", 490, 562,
     "    data = sorted(data)", 571, 613, ()),
    ("fim-asyncio-proactor-write-to-self", STDLIB / "asyncio/proactor_events.py", "extra", 740, 818,
     "        # This may be called from a different thread, possibly after", 834, 870,
     (("asyncio/selector_events.py", STDLIB / "asyncio/selector_events.py", 43, 145),)),
    ("fim-textwrap-dedent", STDLIB / "textwrap.py", "none", 380, 437,
     "    for indent in indents:", 458, 490, ()),
    ("fim-shlex-quote", STDLIB / "shlex.py", "none", 250, 327,
     "    if not s:", 335, 350, ()),
    ("fim-heapq-siftdown", STDLIB / "heapq.py", "none", 150, 208,
     "    newitem = heap[pos]", 220, 258, ()),
    ("fim-mpl-js-key-event", MPL_JS, "none", 620, 687,
     "    // Prevent repeat events", 699, 725, ()),
]


def _lines(path: Path, first: int, last: int) -> str:
    """Lines first..last (1-based, inclusive) of the file, newlines kept."""
    return "".join(path.read_text(encoding="utf-8").splitlines(keepends=True)[first - 1:last])


def _where(path: Path) -> str:
    """The file as its project names it: Lib/... for the standard library, else its package path."""
    if path == MPL_JS:
        return "matplotlib 3.11.2 lib/matplotlib/backends/web_backend/js/mpl.js"
    return "CPython 3.11.7 Lib/" + str(path.relative_to(STDLIB))


def entry(cut: tuple) -> dict:
    """One ``fim`` line of the suite. Raises SystemExit naming the cut when its cursor line differs."""
    id_, path, repeats, first, cursor, expected, suffix_at, last, extra = cut
    text = path.read_text(encoding="utf-8").splitlines()
    if not text[cursor - 1].startswith(expected):
        raise SystemExit(f"{id_}: line {cursor} of {path} is {text[cursor - 1]!r}, expected {expected!r}")
    out = {"id": id_, "category": "fim", "prefix": _lines(path, first, cursor - 1),
           "suffix": _lines(path, suffix_at, last), "max_tokens": MAX_TOKENS, "repeats": repeats,
           "middle": _lines(path, cursor, suffix_at - 1),
           "source": f"{_where(path)}, lines {first}-{last} (the middle {cursor}-{suffix_at - 1})"}
    if extra:
        out["extra"] = [{"filename": name, "text": _lines(p, a, b)} for name, p, a, b in extra]
        out["source"] += "; extra: " + ", ".join(f"{_where(p)}, lines {a}-{b}" for _, p, a, b in extra)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where to write the whole suite (JSON Lines)")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    suite = resources.files("specdecode").joinpath("data/bench_suite.jsonl").read_text(encoding="utf-8")
    kept = [line for line in suite.splitlines() if line.strip() and json.loads(line)["category"] != "fim"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(kept + [json.dumps(entry(c)) for c in CUTS]) + "\n", encoding="utf-8")
    print(f"wrote {len(kept)} entries and {len(CUTS)} fim entries to {args.out}")


if __name__ == "__main__":
    main()
