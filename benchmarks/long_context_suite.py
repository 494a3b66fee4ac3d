"""Write the built-in suite's long-context categories: an edit in a large file and an agent's turn
after long tool outputs, at about 2k, 4k and 8k tokens of prompt (issue 47).

Editors and agents send the file being edited or what tools returned, thousands of tokens of it,
and the output copies from it. The files are this project's own modules (Apache-2.0), as they were
when the suite was written (each prompt a different file, so that a bench over several categories
does not find one prompt's answer in another's history):

- ``edit_large_2k``, ``edit_large_4k``, ``edit_large_8k``: aider's whole-file format
  (``editor_formats/aider_whole.json``, as in ``edit_whole``) with a rename in the file: the answer
  is the file again, changed wherever the name occurs; the 8k file is two modules in one;
- ``agent_long_2k``, ``agent_long_4k``, ``agent_long_8k``: a question, the agent's ``read_file``
  call(s) in one turn and their results in ``tool`` messages (two files at 8k), the tools presented
  by the chat template, and the answer (quoting a function, then explaining it). (With the two calls
  in two turns, the default target answered the 8k prompt with nothing: its first token ended it.)

Each prompt carries the file(s) as its ``prediction``, as ``edit_whole`` and ``agent_tool_result``
do. Prompt sizes in the default target's tokens: about 2.4k, 4.0k and 7.9k (edits), 2.1k, 4.0k
and 8.0k (agent).

    python benchmarks/long_context_suite.py --out bench-out/bench_suite.jsonl

reads the package's suite, rewrites those categories and writes the whole suite to ``--out``
(never into the package). To change the suite the package ships, review the file and copy it
over ``src/specdecode/data/bench_suite.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import specdecode
from specdecode.bench.suite import rewrite_parser, rewrite_suite

PACKAGE_ROOT = Path(specdecode.__file__).resolve().parent.parent  # where "specdecode/..." paths are read
FORMATS = Path(__file__).resolve().parent / "editor_formats"
CATEGORIES = ("edit_large_2k", "edit_large_4k", "edit_large_8k", "agent_long_2k", "agent_long_4k", "agent_long_8k")
MAX_TOKENS = {"edit_large": 448, "agent_long": 256}

# category -> (files joined into the one edited, the name it has, the request)
EDITS = {
    "edit_large_2k": (["specdecode/textstream.py"], "textstream.py",
                      "Rename the class StopMatcher to StopSequenceMatcher everywhere in the file."),
    "edit_large_4k": (["specdecode/verify.py"], "verify.py",
                      "Rename the function committed_tokens to accepted_and_bonus_tokens everywhere in the file."),
    "edit_large_8k": (["specdecode/control/costmodel.py", "specdecode/control/costcache.py"], "costs.py",
                      "Rename the function expected_tokens to expected_committed everywhere in the file (also "
                      "where it is named in docstrings)."),
}
# category -> (question, files read, one read_file call each)
AGENT = {
    "agent_long_2k": ("What does NgramDrafter.propose do when there is no match? Show me the whole method, then "
                      "explain it.", ["specdecode/drafters/ngram.py"]),
    "agent_long_4k": ("How does OutputAccumulator decide how many tokens remain? Show me the whole method, then "
                      "explain it.", ["specdecode/output.py"]),
    "agent_long_8k": ("When does the worker stop, and how does Sampler.draw pick a token? Show me both methods "
                      "whole, then explain them.", ["specdecode/server/worker.py", "specdecode/sampling.py"]),
}


def read(paths: list[str]) -> str:
    return "\n\n".join((PACKAGE_ROOT / p).read_text(encoding="utf-8").rstrip("\n") for p in paths) + "\n"


def edit_entries() -> list[dict]:
    template = json.loads((FORMATS / "aider_whole.json").read_text())
    out = []
    for cat, (paths, name, request) in EDITS.items():
        code = read(paths)
        messages = [{"role": m["role"], "content": m["content"].replace("{path}", name).replace("{code}", code)
                     .replace("{request}", request)} for m in template]
        out.append({"id": f"{cat}-01", "category": cat, "messages": messages, "max_tokens": MAX_TOKENS["edit_large"],
                    "prediction": code})
    return out


def agent_entries() -> list[dict]:
    out = []
    for cat, (question, paths) in AGENT.items():
        messages = [{"role": "system", "content": "You are a coding assistant with tools. Once a tool's result is in "
                                                  "the conversation, do not call the tool again: answer the user, "
                                                  "quoting code exactly as the tool returned it."},
                    {"role": "user", "content": question}]
        calls = [{"id": f"call_{i}", "type": "function",
                  "function": {"name": "read_file", "arguments": json.dumps({"path": p})}}
                 for i, p in enumerate(paths, 1)]
        results = [read([p]) for p in paths]
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})  # the calls in one turn, as agents make them
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, results)]
        out.append({"id": f"{cat}-01", "category": cat, "messages": messages, "tools": [_READ],
                    "max_tokens": MAX_TOKENS["agent_long"], "prediction": "\n".join(results)})
    return out


_READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


def build_parser() -> argparse.ArgumentParser:
    return rewrite_parser(__doc__.split("\n\n")[0])


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    rewrite_suite(args.out, CATEGORIES, lambda kept: edit_entries() + agent_entries())


if __name__ == "__main__":
    main()
