"""Write the built-in suite's editor categories: the prompts editors and agents really send.

The edit formats are aider's (https://aider.chat, Apache-2.0), as aider 0.86.2 sent them to
`specdecode serve` (captured from its requests; the platform and date lines fixed): its
system prompt, worked examples, the file message and the reminder after the request, in
`editor_formats/aider_{whole,diff,udiff}.json` with `{path}`, `{code}` and `{request}` where
the file and the edit go. Categories:

- ``edit_whole``: the whole file back (aider's ``whole`` format);
- ``edit_search_replace``: SEARCH/REPLACE blocks (aider's ``diff`` format);
- ``edit_udiff``: a unified diff (aider's ``udiff`` format);
- ``agent_tool_result``: an agent's answer after an OpenAI-style tool call, the result in a
  ``tool`` message and the tools presented by the chat template (``tools``), as agent SDKs
  send them.

Each prompt carries the file (for the agent, the tool's result) as its ``prediction``, the
text an editor would send, so that ``specdecode bench`` also runs it with the prediction.
The files are the suite's other code prompts' originals; the edits differ from theirs, so a
bench over several categories does not find one category's answers in another's history.

    python benchmarks/editor_suite.py --out bench-out/bench_suite.jsonl

reads the package's suite, rewrites those categories and writes the whole suite to ``--out``
(never into the package: a benchmark writes nothing under src/). To change the suite the
package ships, review the file and copy it over ``src/specdecode/data/bench_suite.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.bench.suite import rewrite_parser, rewrite_suite

FORMATS = Path(__file__).resolve().parent / "editor_formats"
CATEGORIES = ("edit_whole", "edit_search_replace", "edit_udiff", "agent_tool_result")
MAX_TOKENS = {"edit_whole": 448, "edit_search_replace": 256, "edit_udiff": 256, "agent_tool_result": 160}

# category -> [(source prompt id whose original file is edited, file name, request)]
EDITS = {
    "edit_whole": [
        ("predicted_edits-01", "paginate.py", "Make page_links raise ValueError when page is not between 1 and pages."),
        ("predicted_edits-02", "inventory.py", "Add a method `restock(self, sku, quantity)` to Inventory that raises "
         "KeyError for an unknown sku and otherwise adds quantity to that item."),
        ("predicted_edits-06", "config.js", "In validateConfig, also push \"host missing\" when config.host is empty."),
        ("code_editing-06", "tasks.py", "Add a function `done_count(tasks)` at the end that returns how many tasks "
         "are done."),
    ],
    "edit_search_replace": [
        ("code_editing-01", "sales.py", "In load_sales, skip rows whose amount is empty."),
        ("predicted_edits-03", "access_log.py", "Make top_paths ignore entries whose status is 404 or higher."),
        ("code_editing-05", "fetch.py", "Change the default number of retries in fetch_json from 3 to 5 and the "
         "urlopen timeout from 10 to 20 seconds."),
        ("code_editing-07", "api.js", "Make createUser trim the name and lowercase the email before posting them."),
    ],
    "edit_udiff": [
        ("code_editing-03", "stats/moving.go", "Return an error \"empty input\" when xs is empty, before the other "
         "checks."),
        ("code_editing-08", "stats.py", "Make zscores return a list of zeros when the standard deviation is 0."),
        ("code_editing-02", "util.js", "Make formatBytes use 2 decimals when `decimals` is not given."),
        ("code_editing-04", "top_customers.sql", "Exclude orders whose status is 'refunded' as well as the "
         "cancelled ones."),
    ],
}

_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
_SEARCH = {"type": "function", "function": {
    "name": "search_docs", "description": "Search the project's documentation; returns the best passages.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
_READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
_SQL = {"type": "function", "function": {
    "name": "run_sql", "description": "Run a read-only SQL query on the sales database; returns rows as JSON.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}

# (question, tools, the call made, the tool's result)
AGENT = [
    ("What's the weather in Oslo right now? Tell me every figure you get.",
     [_WEATHER], ("get_weather", {"city": "Oslo", "unit": "celsius"}),
     json.dumps({"city": "Oslo", "temperature": -3.2, "unit": "celsius", "conditions": "snow showers",
                 "wind_kmh": 31, "humidity": 0.87, "observed_at": "2026-12-01T08:50:00Z"})),
    ("How do I make the server listen on every interface? Quote the documentation word for word.",
     [_SEARCH, _READ], ("search_docs", {"query": "listen on all interfaces host"}),
     json.dumps([{"page": "docs/server.md", "section": "Who may call it",
                  "text": "By default the server listens on 127.0.0.1 only. Start it with --host 0.0.0.0 to listen "
                          "on every interface, and name the hosts that may call it with --allowed-hosts."},
                 {"page": "docs/cli.md", "section": "serve",
                  "text": "--host ADDRESS: the address to listen on (default 127.0.0.1). --port N: the port "
                          "(default 8000)."}])),
    ("What does parse_line return for a line that does not match? Show me the whole function, then explain.",
     [_READ, _SEARCH], ("read_file", {"path": "access_log.py"}),
     None),  # the result: access_log.py (predicted_edits-03's original)
    ("Which three regions sold the most in November? Give the totals exactly.",
     [_SQL], ("run_sql", {"query": "SELECT region, SUM(amount) AS total FROM sales WHERE month = '2026-11' "
                                   "GROUP BY region ORDER BY total DESC LIMIT 3"}),
     json.dumps([{"region": "Nordics", "total": 184230.75}, {"region": "Iberia", "total": 151902.10},
                 {"region": "Benelux", "total": 98341.00}])),
]


def original_code(suite: list[dict], pid: str) -> str:
    """The original file of a suite prompt: its prediction without the fences."""
    text = next(r for r in suite if r["id"] == pid)["prediction"]
    if text.startswith("```"):
        text = text.split("\n", 1)[1].rsplit("```", 1)[0]
    return text if text.endswith("\n") else text + "\n"


def edit_entries(suite: list[dict]) -> list[dict]:
    out = []
    for cat, fmt in (("edit_whole", "whole"), ("edit_search_replace", "diff"), ("edit_udiff", "udiff")):
        template = json.loads((FORMATS / f"aider_{fmt}.json").read_text())
        for i, (pid, path, request) in enumerate(EDITS[cat], 1):
            code = original_code(suite, pid)
            messages = [{"role": m["role"], "content": m["content"].replace("{path}", path).replace("{code}", code)
                         .replace("{request}", request)} for m in template]
            out.append({"id": f"{cat}-{i:02d}", "category": cat, "messages": messages,
                        "max_tokens": MAX_TOKENS[cat], "prediction": code})
    return out


def agent_entries(suite: list[dict]) -> list[dict]:
    out = []
    for i, (question, tools, (name, args), result) in enumerate(AGENT, 1):
        result = result if result is not None else original_code(suite, "predicted_edits-03")
        call = {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        messages = [{"role": "system", "content": "You are a helpful assistant with tools. Once a tool's result is "
                                                  "in the conversation, do not call the tool again: answer the user "
                                                  "in plain sentences, quoting the result's values exactly."},
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": result}]
        out.append({"id": f"agent_tool_result-{i:02d}", "category": "agent_tool_result", "messages": messages,
                    "tools": tools, "max_tokens": MAX_TOKENS["agent_tool_result"], "prediction": result})
    return out


def build_parser() -> argparse.ArgumentParser:
    return rewrite_parser(__doc__.split("\n\n")[0])


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    rewrite_suite(args.out, CATEGORIES, lambda kept: edit_entries(kept) + agent_entries(kept))


if __name__ == "__main__":
    main()
