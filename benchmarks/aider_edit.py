"""An editor, measured as it calls: aider editing a small repository through `specdecode serve`.

aider (https://aider.chat) talks to any OpenAI-compatible server. This script makes a small
repository (one 30-line Python file: the function of examples/edit_function_prediction.py), starts `specdecode
serve` once (the default pair and settings unless told otherwise), and runs the same aider
edit again and again, alternating speculation on (the server's default) and off (the request
field ``speculative.draft = "none"``, sent through aider's model settings ``extra_params``),
in aider's whole-file and search/replace (``diff``) formats. Each run starts from the original
file; the edit applied when the file afterwards has the new name and not the old one.

aider lives in its own virtual environment (its pins differ from this project's):

    python -m venv .aider-venv && .aider-venv/bin/pip install aider-chat
    python benchmarks/aider_edit.py --aider .aider-venv/bin/aider --rounds 3

Prints, per format, the median wall time of aider's run (model time and aider's own work) with
and without speculation, their ratio, the server's decode tokens/s, and whether each edit
applied.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "examples" / "edit_function_prediction.py"
MESSAGE = "Rename the parameter `data` to `records` everywhere in summarize_orders. Change nothing else."
OLD, NEW = "data", "records"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdecode", "serve", "--target", args.target, "--port", str(port),
           "--ctx-size", str(args.ctx_size)]
    if args.draft:
        cmd += ["--draft", args.draft]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            sys.exit("the server exited:\n" + log.read_text())
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            sys.exit("the server did not start:\n" + log.read_text())
        time.sleep(0.5)


def decode_rate(before: str, after: str) -> float | None:
    """Generated tokens per second after the first token, between two /metrics reads."""
    def total(text: str, name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))
    tokens = total(after, "specdecode:generation_tokens_total") - total(before, "specdecode:generation_tokens_total")
    seconds = (total(after, "specdecode:e2e_request_latency_seconds_sum")
               - total(before, "specdecode:e2e_request_latency_seconds_sum")
               - total(after, "specdecode:time_to_first_token_seconds_sum")
               + total(before, "specdecode:time_to_first_token_seconds_sum"))
    return tokens / seconds if tokens and seconds > 0 else None


def run_aider(args, port: int, fmt: str, speculate: bool, work: Path) -> dict:
    repo = work / f"repo-{fmt}-{'spec' if speculate else 'plain'}"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    target = repo / "orders.py"
    code = SOURCE.read_text().split("```python\n", 1)[1].rsplit("```", 1)[0]  # the file the fences hold
    target.write_text(code)
    settings = repo / "model-settings.yml"
    extra = {"temperature": 0, "max_tokens": args.max_tokens}
    if not speculate:
        extra["extra_body"] = {"speculative": {"draft": "none"}}
    settings.write_text(f"- name: openai/{args.target}\n  edit_format: {fmt}\n  use_temperature: true\n"
                        f"  extra_params: {json.dumps(extra)}\n")
    env = {**os.environ, "OPENAI_API_BASE": f"http://127.0.0.1:{port}/v1", "OPENAI_API_KEY": "none",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "AIDER_CHECK_UPDATE": "false", "AIDER_ANALYTICS": "false"}
    cmd = [args.aider, "--model", f"openai/{args.target}", "--model-settings-file", str(settings),
           "--edit-format", fmt, "--no-git", "--yes-always", "--no-auto-commits", "--map-tokens", "0",
           "--no-show-model-warnings", "--no-check-update", "--no-analytics", "--no-stream", "--no-pretty",
           "--no-fancy-input", "--message", MESSAGE, str(target)]
    base = f"http://127.0.0.1:{port}"
    before = httpx.get(base + "/metrics", timeout=10).text
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    after = httpx.get(base + "/metrics", timeout=10).text
    text = target.read_text()
    applied = f"def summarize_orders({NEW}" in text and f"in {NEW}:" in text and f"({OLD}," not in text
    (work / f"aider-{fmt}-{'spec' if speculate else 'plain'}.log").write_text(out.stdout + out.stderr)
    return {"wall_s": wall, "applied": applied, "rate": decode_rate(before, after), "rc": out.returncode}


def main() -> None:
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
    args = ap.parse_args()
    if not Path(args.aider).exists():
        sys.exit(f"aider not found at {args.aider}: python -m venv .aider-venv && .aider-venv/bin/pip install "
                 "aider-chat")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="aider-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = start_server(args, port, work / "serve.log")
    results: dict = {}
    try:
        for r in range(args.rounds):
            for fmt in args.formats.split(","):
                order = (True, False) if r % 2 == 0 else (False, True)  # alternate which goes first
                for speculate in order:
                    res = run_aider(args, port, fmt, speculate, work)
                    results.setdefault((fmt, speculate), []).append(res)
                    print(f"round {r + 1} {fmt} {'spec ' if speculate else 'plain'}: {res['wall_s']:.1f} s, applied "
                          f"{res['applied']}, decode {res['rate'] or 0:.1f} tok/s", flush=True)
    finally:
        server.terminate()
        server.wait(60)
    print(f"\naider {args.formats} edits of examples/edit_function_prediction.py through specdecode serve "
          f"({args.target}, draft {args.draft or 'default'}), {args.rounds} rounds alternating; {cpu_name()}, "
          f"{os.cpu_count()} CPUs")
    print("| format | speculation s | plain s | ratio | decode tok/s spec / plain | applied spec / plain |")
    print("|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        spec, plain = results[(fmt, True)], results[(fmt, False)]
        ws, wp = statistics.median(x["wall_s"] for x in spec), statistics.median(x["wall_s"] for x in plain)
        rs = statistics.median(x["rate"] or 0 for x in spec)
        rp = statistics.median(x["rate"] or 0 for x in plain)
        print(f"| {fmt} | {ws:.1f} | {wp:.1f} | {wp / ws:.2f}x | {rs:.1f} / {rp:.1f} | "
              f"{sum(x['applied'] for x in spec)}/{len(spec)} / {sum(x['applied'] for x in plain)}/{len(plain)} |")
    print(f"logs: {work}")


if __name__ == "__main__":
    main()
