"""``specdecode bench-serve``: a load benchmark of the OpenAI-compatible server.

C concurrent clients (for each C in the list) send the suite's prompts to a server, each
client one request at a time, streaming; per request the time to first token (TTFT,
send to first text chunk), the time per output token (TPOT, (last - first chunk) /
(completion tokens - 1)), the gaps between its text chunks as they arrived (the inter-token
gap, ITL: a speculative step brings several tokens in one chunk, so a gap is what a reader
waits), the completion tokens and the speculation statistics are
recorded. Per C: aggregate decode tokens/s (all completion tokens / wall time from the
first send to the last end), TTFT and TPOT p50/p95, the largest TTFT (no request starved),
ITL p50/p99/max over every gap of every request, and acceptance. Self-started servers are measured side by side in one run: the one-slot
server (the baseline) and the batched one (``--parallel``); a running server is measured
at ``--url``. Greedy outputs of the batched server are compared with the one-slot
server's (which runs each request alone at any concurrency): equal, or first different
where the solo run's two most likely tokens are within NEAR_TIE_GAP (a batch's kernels
differ from a lone sequence's), else divergent.
"""

from __future__ import annotations

import itertools
import json
import queue
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import SpecDecodeError
from ..limits import MAX_PARALLEL
from ..parity import NEAR_TIE_GAP
from .suite import BenchPrompt, load_prompts, select_prompts

DEFAULT_CONCURRENCY = (1, 8)
SERVE_CATEGORIES = ("code_editing", "extraction", "qa_passages", "translation", "math", "chat", "multi_turn", "repeat")


@dataclass
class ServeBenchConfig:
    """What bench-serve runs. url: a running server (None: start one per slot count in
    ``slots``, in this process). concurrency: client counts. requests: requests per
    concurrency level (default: every selected prompt once, at least C)."""

    url: str | None = None
    api_key: str | None = None
    model: str | None = None  # the id a running server expects (default: from its /v1/models)
    target: str = "qwen2.5-coder-1.5b-instruct"
    draft: str = "auto"
    num_speculative_tokens: int | str = "auto"
    n_ctx: int | None = None  # None: the Decoder's default (the trained context within memory)
    n_threads: int | None = None
    slots: tuple[int, ...] = (1, 8)
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    requests: int | None = None
    prompts: str | None = None
    categories: tuple[str, ...] | None = SERVE_CATEGORIES
    per_category: int | None = 2
    max_tokens: int = 64
    long_prompt_tokens: int = 0  # > 0: one more client sends prompts of about this many tokens meanwhile
    progress: bool = True
    extra: dict = field(default_factory=dict)  # further Decoder options for self-started servers
    llama_server: str | None = None  # also load llama.cpp's own llama-server (its path; "": the built one)


def check_config(cfg: ServeBenchConfig) -> None:
    """Range checks before anything loads. Raises SpecDecodeError naming the option."""
    if not cfg.concurrency or any(c < 1 for c in cfg.concurrency):
        raise SpecDecodeError(f"--concurrency {','.join(map(str, cfg.concurrency))} is out of range: "
                              f"expected positive integers", param="--concurrency")
    if cfg.url is None and any(not 1 <= s <= MAX_PARALLEL for s in cfg.slots):
        raise SpecDecodeError(f"--parallel {max(cfg.slots)} is out of range: expected 1..{MAX_PARALLEL}",
                              param="--parallel")
    if cfg.requests is not None and cfg.requests < 1:
        raise SpecDecodeError(f"--requests {cfg.requests} is out of range: expected >= 1", param="--requests")
    if cfg.long_prompt_tokens < 0:
        raise SpecDecodeError(f"--long-prompts {cfg.long_prompt_tokens} is out of range: expected >= 0 tokens",
                              param="--long-prompts")
    if cfg.max_tokens < 1:
        raise SpecDecodeError(f"--max-tokens {cfg.max_tokens} is out of range: expected >= 1", param="--max-tokens")


@dataclass
class RequestRecord:
    """One request as a client saw it (seconds from time.perf_counter())."""

    prompt_id: str
    sent: float
    first: float | None
    end: float
    completion_tokens: int
    tokens: list[str]
    top2_gaps: list[float | None]
    speculation: dict
    error: str | None = None
    arrivals: list[float] = field(default_factory=list)  # when each text chunk arrived

    @property
    def gaps_s(self) -> list[float]:
        """Seconds between consecutive text chunks (the inter-token gaps this client waited)."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def _body(p: BenchPrompt, model: str, max_tokens: int) -> tuple[str, dict]:
    """The endpoint and the greedy, streamed request body of a suite prompt (logprobs on, for
    the parity check)."""
    common = {"model": model, "max_tokens": p.max_tokens if p.max_tokens < max_tokens else max_tokens,
              "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if p.messages is not None:
        return "/v1/chat/completions", {**common, "messages": p.messages, "logprobs": True, "top_logprobs": 2}
    fim = {"suffix": p.suffix} if p.fim else {}  # OpenAI's insertion field; its extra files are left out before
    return "/v1/completions", {**common, "prompt": p.prompt, **fim, "logprobs": 2}


def _gap(tops: list[float]) -> float | None:
    tops = sorted(tops, reverse=True)
    return tops[0] - tops[1] if len(tops) > 1 else None


def _send(client, p: BenchPrompt, model: str, max_tokens: int) -> RequestRecord:
    """One streamed request; parses the server-sent events as they arrive."""
    import httpx

    path, body = _body(p, model, max_tokens)
    sent = time.perf_counter()
    first, tokens, gaps, usage, spec, arrivals = None, [], [], {}, {}, []
    try:
        with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                return RequestRecord(p.id, sent, None, time.perf_counter(), 0, [], [], {},
                                     error=f"HTTP {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                spec = chunk.get("speculation") or spec
                for ch in chunk.get("choices", []):
                    text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if text:
                        arrivals.append(time.perf_counter())
                        first = arrivals[0]
                    lp = ch.get("logprobs") or {}
                    if "content" in lp:  # chat
                        for e in lp["content"] or []:
                            tokens.append(e["token"])
                            gaps.append(_gap([t["logprob"] for t in e["top_logprobs"]]))
                    elif lp.get("tokens"):
                        tokens += lp["tokens"]
                        gaps += [_gap(list(t.values())) for t in lp["top_logprobs"]]
    except httpx.HTTPError as e:
        return RequestRecord(p.id, sent, first, time.perf_counter(), 0, tokens, gaps, spec, error=str(e),
                             arrivals=arrivals)
    return RequestRecord(p.id, sent, first, time.perf_counter(), int(usage.get("completion_tokens", 0)), tokens,
                         gaps, spec, arrivals=arrivals)


LONG_MAX_TOKENS = 8  # what a long prompt's request asks for: its prefill is the load


def long_prompts(prompts: Sequence[BenchPrompt], tokens: int) -> Iterator[BenchPrompt]:
    """Endless raw prompts of about ``tokens`` tokens (4 characters a token: the suite's texts
    over and over), each opening with its own line, so that no two share a cached prefix."""
    body = "\n\n".join(p.prompt or "\n".join(str(m.get("content", "")) for m in p.messages or []) for p in prompts)
    body = (body * (4 * tokens // max(1, len(body)) + 1))[:4 * tokens]
    for i in itertools.count():
        yield BenchPrompt(f"long-{tokens}", "long", f"# request {i}\n{body}", None, LONG_MAX_TOKENS)


def run_load(url: str, prompts: Sequence[BenchPrompt], concurrency: int, n_requests: int, model: str,
             max_tokens: int, api_key: str | None = None, long: Iterator[BenchPrompt] | None = None,
             ) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """C clients, each sending one request at a time, until n_requests were sent (prompts
    in turn); with ``long``, one more client sends its prompts one after another until they
    are done. Returns the C clients' records and the long client's."""
    import httpx

    todo: queue.Queue = queue.Queue()
    for i in range(n_requests):
        todo.put(prompts[i % len(prompts)])
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    done = threading.Event()

    def long_loop() -> list[RequestRecord]:
        out = []
        with httpx.Client(base_url=url, timeout=3600, headers=headers) as c:
            while not done.is_set():
                out.append(_send(c, next(long), model, LONG_MAX_TOKENS))
        return out

    def client_loop() -> list[RequestRecord]:
        out = []
        with httpx.Client(base_url=url, timeout=600, headers=headers) as c:
            while True:
                try:
                    p = todo.get_nowait()
                except queue.Empty:
                    return out
                out.append(_send(c, p, model, max_tokens))

    with ThreadPoolExecutor(concurrency + 1) as pool:
        background = pool.submit(long_loop) if long is not None else None
        try:
            short = [r for rs in pool.map(lambda _: client_loop(), range(concurrency)) for r in rs]
        finally:
            done.set()
        return short, background.result() if background is not None else []


def summarize(records: Sequence[RequestRecord]) -> dict:
    """Aggregate figures of one load level (see the module docstring); seconds and tokens."""
    ok = [r for r in records if r.error is None]
    if not ok:
        return {"requests": len(records), "errors": len(records), "first_error": records[0].error if records else None}
    wall = max(r.end for r in ok) - min(r.sent for r in ok)
    ttft = np.array([(r.first or r.end) - r.sent for r in ok])
    tpot = np.array([(r.end - r.first) / (r.completion_tokens - 1) for r in ok
                     if r.first is not None and r.completion_tokens > 1])
    itl = np.array([g for r in ok for g in r.gaps_s])
    tokens = sum(r.completion_tokens for r in ok)
    drafted = sum(int(r.speculation.get("drafted", 0)) for r in ok)
    accepted = sum(int(r.speculation.get("accepted", 0)) for r in ok)

    def pct(a: np.ndarray, q: float) -> float | None:
        return round(float(np.percentile(a, q)), 4) if len(a) else None

    return {
        "requests": len(records), "errors": len(records) - len(ok), "completion_tokens": tokens,
        "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95), "ttft_max_s": round(float(ttft.max()), 4),
        "tpot_p50_s": pct(tpot, 50), "tpot_p95_s": pct(tpot, 95),
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99), "itl_max_s": round(float(itl.max()), 4) if len(itl) else None,
        "drafted": drafted, "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
    }


def parity(batched: Sequence[RequestRecord], solo: Sequence[RequestRecord]) -> dict:
    """Greedy outputs of one load level against the same prompts run alone: counts of
    exact, near-tie (first difference where the solo run's top-2 logprob gap <=
    NEAR_TIE_GAP) and divergent outputs, with the divergent prompt ids."""
    ref = {r.prompt_id: r for r in solo if r.error is None}
    out = {"exact": 0, "near_tie": 0, "divergent": 0, "divergent_ids": []}
    for r in batched:
        s = ref.get(r.prompt_id)
        if s is None or r.error is not None:
            continue
        if r.tokens == s.tokens:
            out["exact"] += 1
            continue
        j = next((i for i in range(min(len(r.tokens), len(s.tokens))) if r.tokens[i] != s.tokens[i]),
                 min(len(r.tokens), len(s.tokens)))
        gap = s.top2_gaps[j] if j < len(s.top2_gaps) else None
        if gap is not None and gap <= NEAR_TIE_GAP:
            out["near_tie"] += 1
        else:
            out["divergent"] += 1
            out["divergent_ids"].append(r.prompt_id)
    return out


class _Server:
    """A self-started server: a Decoder with ``slots`` slots behind uvicorn on a free
    loopback port, in a daemon thread."""

    def __init__(self, cfg: ServeBenchConfig, slots: int, max_queue: int) -> None:
        import uvicorn

        from ..api import Decoder
        from ..server import ServerOptions, create_app

        self.decoder = Decoder(target=cfg.target, draft=cfg.draft, num_speculative_tokens=cfg.num_speculative_tokens,
                               n_ctx=cfg.n_ctx, n_threads=cfg.n_threads, progress=cfg.progress, parallel=slots,
                               **cfg.extra)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = create_app(self.decoder, ServerOptions(max_queue=max_queue, warmup=True))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "_Server":
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise SpecDecodeError("the benchmark's server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.decoder.close()


def _llama_server_binary(cfg: ServeBenchConfig):
    """The llama-server binary --llama-server names (or the built one). Raises SpecDecodeError
    naming the option where there is none."""
    from pathlib import Path

    from .llama_server import default_binary

    binary = Path(cfg.llama_server).expanduser() if cfg.llama_server else default_binary()
    if binary is None or not binary.exists():
        raise SpecDecodeError(f"--llama-server: no llama-server binary at {binary} (bash "
                              "benchmarks/build_llama_server.sh builds one)", param="--llama-server")
    return binary


def _llama_server(cfg: ServeBenchConfig, slots: int):
    """llama.cpp's llama-server (plain) with ``slots`` slots on the target's GGUF, the bench's
    context per slot and threads (:class:`.llama_server.LlamaServer`). Raises SpecDecodeError
    naming --llama-server where it cannot start."""
    from pathlib import Path

    from ..assembly import registry
    from ..backends.llama_cpp.lib import default_threads
    from .llama_server import LlamaServer

    try:
        return LlamaServer(_llama_server_binary(cfg), registry.resolve(cfg.target), cfg.n_ctx or 4096, cfg.n_threads or default_threads(),
                           slots=slots)
    except (RuntimeError, OSError) as e:
        raise SpecDecodeError(f"--llama-server could not start: {e}", param="--llama-server") from None


def _model_id(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise SpecDecodeError(f"no OpenAI-compatible server answers at {url}: {e}", param="--url") from None


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    """Run the load benchmark; returns {"config", "servers": {label: {C: summary}},
    "parity": {C: counts}, "speedup": {C: batched / one-slot tokens/s}}.
    Raises SpecDecodeError for bad options or an unreachable server."""
    from tqdm import tqdm

    check_config(cfg)
    if cfg.llama_server is not None and not cfg.url:
        _llama_server_binary(cfg)  # named before any model loads
    prompts = select_prompts(load_prompts(cfg.prompts), cfg.categories, cfg.per_category)
    if any(p.extra for p in prompts):  # /v1/completions has no field for other files: not sent without them
        print(f"bench-serve: {sum(bool(p.extra) for p in prompts)} fill-in-the-middle prompt(s) with extra files "
              "skipped (/v1/completions carries no extra files)", file=sys.stderr)
        prompts = [p for p in prompts if not p.extra]
        if not prompts:
            raise SpecDecodeError("no prompts left: those selected all carry extra files")
    levels = sorted(set(cfg.concurrency))
    n_req = {c: cfg.requests or max(c, len(prompts)) for c in levels}
    result: dict[str, Any] = {"config": {k: v for k, v in vars(cfg).items() if k not in ("api_key", "extra")},
                              "prompts": len(prompts), "servers": {}, "records": {}}
    targets: list[tuple[str, int | None]] = [("server", None)] if cfg.url else \
        [(f"{s} slot{'s' if s > 1 else ''}", s) for s in sorted(set(cfg.slots))]
    peer = max(cfg.slots) if cfg.llama_server is not None and not cfg.url else None
    if peer is not None:
        targets.append((f"llama-server, {peer} slot{'s' if peer > 1 else ''}", -peer))  # -N: llama-server's N slots
    bar = tqdm(total=len(targets) * len(levels), desc="bench-serve", disable=not cfg.progress)
    for label, slots in targets:
        runs, recs, longs = {}, {}, {}
        if slots is None:
            url, model, ctx = cfg.url.rstrip("/"), cfg.model or _model_id(cfg.url, cfg.api_key), None
        elif slots < 0:
            ctx = _llama_server(cfg, -slots)
            url, model = f"http://127.0.0.1:{ctx.port}", cfg.target
        else:
            ctx = _Server(cfg, slots, max_queue=max(levels) + 1)
            url, model = ctx.url, cfg.target
            ctx.__enter__()
        try:
            for c in levels:
                bar.set_postfix_str(f"{label}, {c} client{'s' if c > 1 else ''}")
                long = long_prompts(prompts, cfg.long_prompt_tokens) if cfg.long_prompt_tokens else None
                recs[c], long_recs = run_load(url, prompts, c, n_req[c], model, cfg.max_tokens, cfg.api_key, long)
                runs[c] = summarize(recs[c])
                if long_recs:
                    longs[c] = summarize(long_recs)
                bar.update()
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        result["servers"][label] = runs
        if longs:  # the long prompts' own figures (their TTFT is their prefill)
            result.setdefault("long", {})[label] = longs
        result["records"][label] = recs
    bar.close()
    labels = [lab for lab in result["servers"] if not lab.startswith("llama-server")]
    base, top = labels[0], labels[-1]
    if peer is not None:  # specdecode's batched server against llama-server's, per client count
        theirs = result["servers"][targets[-1][0]]
        result["vs_llama_server"] = {c: round(result["servers"][top][c]["tokens_per_s"] / theirs[c]["tokens_per_s"], 3)
                                     for c in levels if theirs[c].get("tokens_per_s")
                                     and result["servers"][top][c].get("tokens_per_s")}
    # Reference outputs: each prompt alone, i.e. the one-slot server (which runs one request
    # at a time at any concurrency), else the measured server at one client.
    ref = result["records"][base] if len(labels) > 1 else {c: result["records"][base].get(1) for c in levels}
    result["parity"] = {c: parity(result["records"][top][c], ref[c]) for c in levels if ref.get(c)}
    if len(labels) > 1:
        result["speedup"] = {c: round(result["servers"][top][c]["tokens_per_s"] /
                                      result["servers"][base][c]["tokens_per_s"], 3)
                             for c in levels if result["servers"][base][c].get("tokens_per_s")
                             and result["servers"][top][c].get("tokens_per_s")}
    result["records"] = {lab: {c: [{**vars(r), "gaps_s": r.gaps_s} for r in rs] for c, rs in recs.items()}
                         for lab, recs in result["records"].items()}
    return result
