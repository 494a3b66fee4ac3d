"""An agent, measured as it works: Claude Code's ``claude -p`` on a small repository through `specdecode serve`.

Claude Code (npm ``@anthropic-ai/claude-code``) speaks only Anthropic's Messages API
(``POST /v1/messages?beta=true``, the key in ``x-api-key``). This script installs it into a
scratch folder (or takes ``--claude PATH``), makes a small git repository (``calc.py`` with
``add``; ``test_calc.py`` testing ``add`` and a ``multiply`` that is not written yet), starts
``specdecode serve`` on the target with its default settings and ``--api-key``, and runs

    claude -p "<TASK>" --output-format stream-json --verbose --permission-mode acceptEdits \\
        --allowedTools Bash,Edit,Write,Read,Glob,Grep,LS

in the repository with ``ANTHROPIC_BASE_URL`` pointing at the server, ``ANTHROPIC_API_KEY``
the key, and ``ANTHROPIC_MODEL`` / ``ANTHROPIC_DEFAULT_HAIKU_MODEL`` the served model's name
(Claude Code unchanged otherwise; ``API_TIMEOUT_MS`` and ``CLAUDE_STREAM_IDLE_TIMEOUT_MS``
longer, since a CPU's prefill of its first prompt takes minutes, and Claude Code drops a stream
that brings no content for 5 minutes and sends the request again; a scratch ``HOME`` so that
no user setting leaks in). Reported:
whether the turn completed (its ``result`` event, subtype success, no error), the tool calls it
made (their names and inputs) and whether the tests pass afterwards, the wall time, the
server's requests, prompt tokens, cached prompt tokens (reused from a slot, not read again),
generated tokens and the drafted and accepted ones (``/metrics``), and any 4xx the server logged.

    python benchmarks/claude_code.py --target qwen2.5-coder-1.5b-instruct --ctx-size 32768

needs node and npm (for the install) and prints the run as JSON, then one table.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import httpx

from specdecode.bench.tools import (TASK, add_agent_options, agent_outcome, agent_setup, json_lines, cpu_name, free_port, make_repo, run_agent,
                                    serve_process, stop_server)

KEY = "sk-claude-code-bench"
TOOLS = "Bash,Edit,Write,Read,Glob,Grep,LS"


def read_events(text: str) -> dict:
    """What ``--output-format stream-json`` says: completed (a result event of subtype success,
    not an error), the tool calls (name and input), the errors, the final result text."""
    calls, errors, result, completed = [], [], None, False
    for event in json_lines(text):
        kind = event.get("type")
        if kind == "assistant":
            for block in (event.get("message") or {}).get("content") or []:
                if block.get("type") == "tool_use":
                    calls.append(f"{block.get('name')} {json.dumps(block.get('input'))[:120]}")
        elif kind == "result":
            completed = event.get("subtype") == "success" and not event.get("is_error")
            result = event.get("result")
            if not completed:
                errors.append(json.dumps(event)[:400])
    return {"completed": completed, "calls": calls, "errors": errors, "result": result}


def run(args, claude: Path, work: Path) -> dict:
    port, repo, home, log = free_port(), work / "repo", work / "home", work / "serve.log"
    options = ["--ctx-size", str(args.ctx_size), "--api-key", KEY] + (["--target", args.target] if args.target else [])
    options += ["--draft", args.draft] if args.draft else []
    make_repo(repo)
    home.mkdir(parents=True, exist_ok=True)
    server = serve_process(options, port, log)
    try:
        headers = {"x-api-key": KEY}
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        before = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
               "ANTHROPIC_API_KEY": KEY, "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
               "ANTHROPIC_SMALL_FAST_MODEL": model, "API_TIMEOUT_MS": str(args.timeout * 1000),
               # a stream without content events for 5 minutes (a CPU's prefill) is dropped and sent again
               "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(args.timeout * 1000),
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
        cmd = [str(claude), "-p", args.task, "--output-format", "stream-json", "--verbose", "--permission-mode",
               "acceptEdits", "--allowedTools", TOOLS, "--max-turns", str(args.max_turns)]
        cmd += ["--tools", args.tools] if args.tools else []
        stdout, stderr, rc, wall = run_agent(cmd, repo, env, args.timeout)
        after = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    finally:
        stop_server(server)
    (work / "claude.jsonl").write_text(stdout)
    (work / "claude.stderr").write_text(stderr)
    return {"model": model, "rc": rc, "wall_s": wall, **agent_outcome(repo, before, after, log), **read_events(stdout)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_agent_options(ap, "claude", "@anthropic-ai/claude-code", "2.1", 32768)
    ap.add_argument("--task", default=TASK, help="the prompt claude -p gets")
    ap.add_argument("--tools", default=None, help="claude -p --tools: the built-in tools it offers, e.g. "
                    "Bash,Edit,Read (default: its own set, about 26)")
    ap.add_argument("--max-turns", type=int, default=8, help="claude -p --max-turns (default: %(default)s)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds claude -p may take (default: %(default)s)")
    ap.add_argument("--keep", default=None, help="folder for the repository, home and logs (default: a temp one)")
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    work, claude, version = agent_setup(args, "claude", "@anthropic-ai/claude-code")
    r = run(args, claude, work)
    print(json.dumps(r, indent=1), flush=True)
    print(f"\n{version}, claude -p on a two-file repository through specdecode serve --api-key ({r['model']}, "
          f"--ctx-size {args.ctx_size}); {cpu_name()}, {os.cpu_count()} CPUs")
    print("| turn completed | tool calls | tests pass | wall s | requests | prompt / cached / generated tokens | "
          "drafted / accepted | 4xx |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {r['completed']} | {len(r['calls'])}: {'; '.join(r['calls'])} | {r['tests_pass']} | {r['wall_s']:.0f} | "
          f"{r['requests']} | {r['prompt_tokens']} / {r['cached_tokens']} / {r['generated_tokens']} | "
          f"{r['drafted_tokens']} / {r['accepted_tokens']} | {len(r['rejected'])} |")
    print(f"logs: {work}")


if __name__ == "__main__":
    main()
