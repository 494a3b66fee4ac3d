"""An editor, measured as it calls: aider editing a small repository through `specdecode serve`.

aider (https://aider.chat) talks to any OpenAI-compatible server. This script makes a small
repository (one 30-line Python file: the function of examples/edit_function_prediction.py) and
starts two servers on the same target: one with speculation (the default pair and settings
unless told otherwise) and one with ``--draft none``. Each round asks aider for a different
edit of the original file (EDITS), through each server in turn (which goes first
alternates), in aider's whole-file and search/replace (``diff``) formats. Each server sees
each prompt once, so neither gets the other's prompt cache, and the speculating one has only
earlier, different edits in its history, as in an editing session. The edit applied when the
file afterwards passes the edit's check.

aider lives in its own virtual environment (its pins differ from this project's):

    python -m venv .aider-venv && .aider-venv/bin/pip install aider-chat
    python benchmarks/aider_edit.py --aider .aider-venv/bin/aider --rounds 5

Prints each run, then per format the median wall time of aider's run (model time and
aider's own start-up and work) with and without speculation, their ratio, the same for the
seconds the requests spent in the server, the server's decode tokens/s, and whether each edit
applied.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specdecode.bench import cpu_name, free_port, serve_process

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "examples" / "edit_function_prediction.py"
# (the request, a check that the edited file passes): different edits, one per round.
EDITS = [
    ("Rename the parameter `data` to `records` everywhere in summarize_orders. Change nothing else.",
     lambda t: "def summarize_orders(records," in t and "in records:" in t and "(data," not in t),
    ("Change the default currency from \"EUR\" to \"USD\". Change nothing else.",
     lambda t: 'currency="USD"' in t and '"EUR"' not in t),
    ("Round the average to 1 decimal place instead of 2. Change nothing else.",
     lambda t: "round(average, 1)" in t and "round(average, 2)" not in t),
    ("Rename the parameter `min_total` to `threshold` everywhere in summarize_orders. Change nothing else.",
     lambda t: "threshold" in t and "min_total" not in t),
    ("Add a one-line docstring to summarize_orders saying what it returns. Change nothing else.",
     lambda t: '"""' in t and "grand_total" in t),
    ("Sort the rows by customer name instead of by total. Change nothing else.",
     lambda t: 'row["customer"]' in t and 'key=lambda row: row["total"]' not in t),
]


def start_server(args, port: int, log: Path, draft: str | None) -> subprocess.Popen:
    """``specdecode serve`` on the target (and ``--draft`` draft, if any) on ``port``, once it answers."""
    return serve_process(["--target", args.target, "--ctx-size", str(args.ctx_size)]
                         + (["--draft", draft] if draft else []), port, log)


def _total(text: str, name: str) -> float:
    """The sum of one /metrics series over its labels."""
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def _delta(before: str, after: str, name: str) -> float:
    """How much one /metrics series grew between two reads."""
    return _total(after, "specdecode:" + name) - _total(before, "specdecode:" + name)


def server_work(before: str, after: str) -> dict:
    """What the server did between two /metrics reads: requests, prompt and generated tokens,
    and the seconds requests spent in the server (their end-to-end latencies summed)."""
    return {"requests": int(_delta(before, after, "e2e_request_latency_seconds_count")),
            "prompt_tokens": int(_delta(before, after, "prompt_tokens_total")),
            "generated_tokens": int(_delta(before, after, "generation_tokens_total")),
            "model_s": _delta(before, after, "e2e_request_latency_seconds_sum")}


def decode_rate(before: str, after: str) -> float | None:
    """Generated tokens per second after the first token, between two /metrics reads."""
    tokens = _delta(before, after, "generation_tokens_total")
    seconds = (_delta(before, after, "e2e_request_latency_seconds_sum")
               - _delta(before, after, "time_to_first_token_seconds_sum"))
    return tokens / seconds if tokens and seconds > 0 else None


def run_aider(args, port: int, fmt: str, speculate: bool, work: Path, edit: int) -> dict:
    message, check = EDITS[edit % len(EDITS)]
    repo = work / f"repo-{fmt}-{'spec' if speculate else 'plain'}"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    target = repo / "orders.py"
    code = SOURCE.read_text().split("```python\n", 1)[1].rsplit("```", 1)[0]  # the file the fences hold
    target.write_text(code)
    settings = repo / "model-settings.yml"
    extra = {"temperature": 0, "max_tokens": args.max_tokens}
    settings.write_text(f"- name: openai/{args.target}\n  edit_format: {fmt}\n  use_temperature: true\n"
                        f"  extra_params: {json.dumps(extra)}\n")
    env = {**os.environ, "OPENAI_API_BASE": f"http://127.0.0.1:{port}/v1", "OPENAI_API_KEY": "none",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "AIDER_CHECK_UPDATE": "false", "AIDER_ANALYTICS": "false"}
    cmd = [args.aider, "--model", f"openai/{args.target}", "--model-settings-file", str(settings),
           "--edit-format", fmt, "--no-git", "--yes-always", "--no-auto-commits", "--map-tokens", "0",
           "--no-show-model-warnings", "--no-check-update", "--no-analytics", "--no-stream", "--no-pretty",
           "--no-fancy-input", "--message", message, str(target)]
    base = f"http://127.0.0.1:{port}"
    before = httpx.get(base + "/metrics", timeout=10).text
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    after = httpx.get(base + "/metrics", timeout=10).text
    text = target.read_text()
    applied = check(text)
    (work / f"aider-{fmt}-{'spec' if speculate else 'plain'}-{edit}.log").write_text(out.stdout + out.stderr)
    return {"wall_s": wall, "applied": applied, "rate": decode_rate(before, after), "rc": out.returncode,
            **server_work(before, after)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aider", default=str(ROOT / ".aider-venv" / "bin" / "aider"))
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default=None, help="the server's --draft (default: its default, auto)")
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--formats", default="whole,diff")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=1024, help="the cap aider's requests get (default: %(default)s)")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--keep", default=None, help="folder for the repositories and aider's logs (default: a temp one)")
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if not Path(args.aider).exists():
        sys.exit(f"aider not found at {args.aider}: python -m venv .aider-venv && .aider-venv/bin/pip install "
                 "aider-chat")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="aider-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ports = {True: free_port(), False: free_port()}
    servers = {}
    results: dict = {}
    try:
        for speculate in (True, False):
            servers[speculate] = start_server(args, ports[speculate], work / f"serve-{'spec' if speculate else 'plain'}.log",
                                              args.draft if speculate else "none")
        for speculate in (True, False):  # untimed: the first request's one-off work (the cost curve's check)
            httpx.post(f"http://127.0.0.1:{ports[speculate]}/v1/chat/completions", timeout=900,
                       json={"model": args.target, "max_tokens": 8,
                             "messages": [{"role": "user", "content": "Say hello."}]}).raise_for_status()
        for r in range(args.rounds):
            for fmt in args.formats.split(","):
                order = (True, False) if r % 2 == 0 else (False, True)  # alternate which goes first
                for speculate in order:
                    res = run_aider(args, ports[speculate], fmt, speculate, work, r)
                    results.setdefault((fmt, speculate), []).append(res)
                    print(f"round {r + 1} edit {r % len(EDITS) + 1} {fmt} {'spec ' if speculate else 'plain'}: "
                          f"{res['wall_s']:.1f} s, applied {res['applied']}, decode {res['rate'] or 0:.1f} tok/s; "
                          f"{res['requests']} requests, {res['prompt_tokens']} prompt + {res['generated_tokens']} "
                          f"generated tokens, {res['model_s']:.1f} s in the server", flush=True)
    finally:
        for server in servers.values():
            server.terminate()
            server.wait(60)
    print(f"\naider {args.formats} edits of examples/edit_function_prediction.py through specdecode serve "
          f"({args.target}; speculation: draft {args.draft or 'default'}, against a --draft none server), "
          f"{args.rounds} rounds, a different edit each, alternating; {cpu_name()}, {os.cpu_count()} CPUs")
    print("| format | speculation s | plain s | ratio | in the server: spec / plain s, ratio | "
          "decode tok/s spec / plain | applied spec / plain |")
    print("|---|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        spec, plain = results[(fmt, True)], results[(fmt, False)]
        med = lambda rs, key: statistics.median(x[key] or 0 for x in rs)  # noqa: E731
        ws, wp = med(spec, "wall_s"), med(plain, "wall_s")
        ms, mp = med(spec, "model_s"), med(plain, "model_s")
        print(f"| {fmt} | {ws:.1f} | {wp:.1f} | {wp / ws:.2f}x | {ms:.1f} / {mp:.1f}, {mp / ms:.2f}x | "
              f"{med(spec, 'rate'):.1f} / {med(plain, 'rate'):.1f} | "
              f"{sum(x['applied'] for x in spec)}/{len(spec)} / {sum(x['applied'] for x in plain)}/{len(plain)} |")
    print(f"logs: {work}")


if __name__ == "__main__":
    main()
