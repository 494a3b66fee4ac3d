"""An agent, measured as it works: Codex CLI's `codex exec` on a small repository through `specdecode serve`.

Codex CLI (https://github.com/openai/codex) speaks the Responses API. This script installs
it from its npm package into a scratch folder (or takes ``--codex PATH``), makes a small git
repository (``calc.py`` with ``add``; ``test_calc.py`` testing ``add`` and a ``multiply``
that is not written yet), and for each side (speculation: the server's default ``--draft``
or ``--draft``; plain: ``--draft none``) starts ``specdecode serve`` on the target, writes a
``CODEX_HOME/config.toml`` whose provider points at it, and runs

    codex exec --json --skip-git-repo-check --sandbox workspace-write "<TASK>"

in a fresh copy of the repository. Codex runs unchanged: the config names only the provider
(and a longer stream idle timeout, since a CPU's prefill of Codex's ~6,300-token first prompt
takes minutes). Reported per side: whether the turn completed (Codex's ``turn.completed``
event, not ``turn.failed`` or an ``error``), the tool calls it made (its ``command_execution``
and ``file_change`` items: the command, its exit code), whether the tests pass afterwards, the
wall time, the server's requests and tokens (``/metrics``) and any 4xx the server logged.

    python benchmarks/codex_exec.py --target qwen2.5-coder-0.5b-instruct --ctx-size 16384

needs node and npm (for the install) and prints the runs, then one table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx

from specdecode.bench.tools import (TASK, add_agent_options, agent_outcome, agent_setup, json_lines, cpu_name, free_port, make_repo, run_agent,
                                    serve_process, stop_server)

def write_config(home: Path, model: str, port: int, idle_timeout_s: int) -> None:
    """A CODEX_HOME whose one provider is the server on port."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "specdecode"\n\n[model_providers.specdecode]\nname = "specdecode"\n'
        f'base_url = "http://127.0.0.1:{port}/v1"\nwire_api = "responses"\n'
        f"stream_idle_timeout_ms = {idle_timeout_s * 1000}\n")


def read_events(text: str) -> dict:
    """What Codex's ``--json`` events say: completed (a turn.completed and no turn.failed),
    the tool calls (command and exit code, or a file change's paths), the errors, the last
    agent message."""
    calls, errors, message, completed, failed = [], [], None, False, False
    for event in json_lines(text):
        kind = event.get("type")
        item = event.get("item") or {}
        completed |= kind == "turn.completed"
        failed |= kind == "turn.failed"
        if kind in ("error", "turn.failed"):
            errors.append(event.get("message") or (event.get("error") or {}).get("message") or json.dumps(event))
        if kind != "item.completed":
            continue
        if item.get("type") == "command_execution":
            calls.append(f"{item.get('command')} -> {item.get('exit_code')}")
        elif item.get("type") == "file_change":
            calls.append("file_change " + ",".join(c.get("path", "?") for c in item.get("changes") or []))
        elif item.get("type") == "agent_message":
            message = item.get("text")
        elif item.get("type") == "error":
            errors.append(item.get("message"))
    return {"completed": completed and not failed, "calls": calls, "errors": errors, "message": message}


def run_side(args, codex: Path, work: Path, speculate: bool) -> dict:
    """One side: its server started, codex exec run on a fresh repository, the server stopped."""
    side = "spec" if speculate else "plain"
    port, repo, home, log = free_port(), work / f"repo-{side}", work / f"codex-home-{side}", work / f"serve-{side}.log"
    options = ["--ctx-size", str(args.ctx_size)] + (["--target", args.target] if args.target else [])
    options += ["--draft", args.draft] if speculate and args.draft else [] if speculate else ["--draft", "none"]
    make_repo(repo)
    server = serve_process(options, port, log)
    try:
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
        write_config(home, model, port, args.idle_timeout)
        before = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        env = {**os.environ, "CODEX_HOME": str(home)}
        cmd = [str(codex), "exec", "--json", "--skip-git-repo-check", "--sandbox", args.sandbox, args.task]
        stdout, stderr, rc, wall = run_agent(cmd, repo, env, args.timeout)
        after = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    finally:
        stop_server(server)
    (work / f"codex-{side}.jsonl").write_text(stdout)
    (work / f"codex-{side}.stderr").write_text(stderr)
    return {"side": side, "model": model, "rc": rc, "wall_s": wall, **agent_outcome(repo, before, after, log),
            **read_events(stdout)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_agent_options(ap, "codex", "@openai/codex", "latest", 16384)
    ap.add_argument("--sides", default="spec,plain", help="which runs, in order: spec, plain (default: %(default)s)")
    ap.add_argument("--task", default=TASK, help="the prompt codex exec gets")
    ap.add_argument("--sandbox", default="workspace-write", help="codex exec --sandbox (default: %(default)s)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds one codex exec may take (default: %(default)s)")
    ap.add_argument("--idle-timeout", type=int, default=1800,
                    help="the provider's stream_idle_timeout_ms, in seconds (default: %(default)s)")
    ap.add_argument("--keep", default=None, help="folder for the repositories, configs and logs (default: a temp one)")
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    work, codex, version = agent_setup(args, "codex", "@openai/codex")
    results = []
    for side in args.sides.split(","):
        if side not in ("spec", "plain"):
            sys.exit(f"--sides takes spec and plain, got {side!r}")
        res = run_side(args, codex, work, side == "spec")
        results.append(res)
        print(json.dumps(res, indent=1), flush=True)
    print(f"\n{version}, codex exec on a two-file repository through specdecode serve "
          f"({results[0]['model'] if results else '?'}, --ctx-size {args.ctx_size}); {cpu_name()}, {os.cpu_count()} CPUs")
    print("| side | turn completed | tool calls | tests pass | wall s | requests | prompt / generated tokens | 4xx |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['side']} | {r['completed']} | {len(r['calls'])}: {'; '.join(r['calls'])} | {r['tests_pass']} | "
              f"{r['wall_s']:.0f} | {r['requests']} | {r['prompt_tokens']} / {r['generated_tokens']} | "
              f"{len(r['rejected'])} |")
    print(f"logs: {work}")


if __name__ == "__main__":
    main()
