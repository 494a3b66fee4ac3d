"""A scripted llama.vim session against `specdecode serve` and llama.cpp's own llama-server, one
after the other on the same GGUF (issue 60, keystrokes): a first request on line 41 of an 80-line
file no one here wrote (the standard library's textwrap), ten keystrokes typing a line, the ring of
extra context (three 64-line chunks of the standard library's json/decoder.py) dropping its oldest
chunk for a new one after the seventh, then Enter. Each server starts fresh; each request's
``timings.prompt_n`` (prompt tokens evaluated), ``tokens_cached`` and milliseconds are printed side
by side. llama-server runs with ``--cache-reuse 256`` (its FIM presets' value); specdecode with its
default (``--cache-reuse 256`` for /infill).

    python benchmarks/llama_vim_session.py [--target NAME] [--ctx-size N] [--llama-server PATH] [--json]

Build llama-server first: bash benchmarks/build_llama_server.sh (or skip it: --no-llama-server).
"""

from __future__ import annotations

import argparse
import inspect
import json
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

from specdecode.assembly import registry
from specdecode.bench.llama_server import LlamaServer, default_binary
from specdecode.bench.tools import cpu_name, free_port, serve_process, stop_server
from specdecode.bench.vim_session import chunks_of, session


def steps():
    import json.decoder

    lines = inspect.getsource(textwrap).splitlines()[:80]
    chunks = chunks_of(inspect.getsource(json.decoder), "json/decoder.py")
    return session(lines, 40, "        width = 70", chunks[:3], chunks[3])


def drive(url: str) -> list[dict]:
    out = []
    with httpx.Client(base_url=url, timeout=600) as http:
        for what, body in steps():
            t0 = time.perf_counter()
            r = http.post("/infill", json=body)
            ms = (time.perf_counter() - t0) * 1000
            r.raise_for_status()
            data = r.json()
            t = data.get("timings") or {}
            out.append({"what": what, "prompt_n": t.get("prompt_n"), "tokens_cached": data.get("tokens_cached"),
                        "ms": round(ms)})
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--llama-server", default=None, help="its binary (default: the one build_llama_server.sh built)")
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    results = {}
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "serve.log"
    opts = ["--target", args.target, "--ctx-size", str(args.ctx_size)] + \
        (["--threads", str(args.threads)] if args.threads else [])
    server = serve_process(opts, port, log)
    try:
        results["specdecode"] = drive(f"http://127.0.0.1:{port}")
    finally:
        stop_server(server)
    if not args.no_llama_server:
        binary = Path(args.llama_server) if args.llama_server else default_binary()
        import os

        threads = args.threads or len(os.sched_getaffinity(0))
        with LlamaServer(binary, registry.resolve(args.target), args.ctx_size, threads, ["--cache-reuse", "256"]) as ls:
            results["llama-server"] = drive(f"http://127.0.0.1:{ls.port}")
    if args.json:
        print(json.dumps({"cpu": cpu_name(), "target": args.target, **results}))
        return
    print(f"{cpu_name()}, {args.target}, --ctx-size {args.ctx_size}: prompt tokens evaluated / cached / ms")
    names = list(results)
    print(f"{'request':12}" + "".join(f"{n:>30}" for n in names))
    for i, row in enumerate(results[names[0]]):
        cells = [results[n][i] for n in names]
        print(f"{row['what']:12}" + "".join(f"{c['prompt_n']!s:>10} {c['tokens_cached']!s:>9} {c['ms']:>8}" for c in cells))


if __name__ == "__main__":
    main()
