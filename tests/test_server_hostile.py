"""The server against a hostile (or merely unusual) client, on smollm2-135m-instruct: bursts
at the queue bound, SIGTERM in the middle of a stream, text that is not valid Unicode,
absurdly nested JSON, usage in streams as OpenAI sends it, and logprobs of characters split
across byte tokens. After every hostile request the server must still answer a normal one."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specdecode.api import Decoder
from specdecode.server import create_app

from test_server import CHAT, MODEL, PROMPTS, ServerThread, metrics, total

SLOTS = 3
QUEUE = 2


@pytest.fixture(scope="module")
def decoder():
    dec = Decoder(target=MODEL, draft="ngram", num_speculative_tokens=4, n_ctx=512, n_threads=1, progress=False,
                  parallel=SLOTS)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def server(decoder):
    with ServerThread(create_app(decoder, max_queue=QUEUE, warmup=True)) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def still_serving(http) -> None:
    """A normal request still gets its answer."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def wait_idle(http, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = http.get("/health").json()
        if h["running"] == 0 and h["waiting"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server did not become idle: {http.get('/health').json()}")


# ------------------------------------------------------------------ the queue bound


def test_a_burst_of_slots_plus_queue_to_an_idle_server_is_all_served(server, http):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
    burst = SLOTS + QUEUE
    before = metrics(http)
    for _ in range(3):  # several bursts: the race between arrival and admission must never refuse
        wait_idle(http)
        barrier = threading.Barrier(burst)

        def one(_):
            with httpx.Client(base_url=server.url, timeout=120) as h:
                barrier.wait()
                return h.post("/v1/completions", json=body).status_code

        with ThreadPoolExecutor(burst) as pool:
            codes = list(pool.map(one, range(burst)))
        assert codes == [200] * burst, codes
    after = metrics(http)
    assert (total(after, "specdecode:request_rejected_total", reason="queue_full")
            == total(before, "specdecode:request_rejected_total", reason="queue_full"))
    still_serving(http)


def test_beyond_busy_slots_and_a_full_queue_the_next_request_gets_429(server, http):
    wait_idle(http)
    # Sampled, so that lookup drafts rarely help: each runs for seconds.
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 480, "temperature": 1.0, "seed": 1, "stream": True}
    release = threading.Event()
    opened = []

    def hold(_):
        with httpx.Client(base_url=server.url, timeout=120) as h:
            with h.stream("POST", "/v1/completions", json=body) as r:
                opened.append(r.status_code)
                release.wait(120)
        return r.status_code

    with ThreadPoolExecutor(SLOTS + QUEUE) as pool:
        futures = [pool.submit(hold, i) for i in range(SLOTS + QUEUE)]
        try:
            deadline = time.monotonic() + 30
            while True:
                h = http.get("/health").json()
                if (h["running"], h["waiting"]) == (SLOTS, QUEUE):
                    break
                assert time.monotonic() < deadline, h
                time.sleep(0.02)
            r = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
        finally:
            release.set()
        assert [f.result() for f in futures] == [200] * (SLOTS + QUEUE)
    wait_idle(http)
    still_serving(http)


# ------------------------------------------------------------------ input that is not text


def raw_post(http, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800: what a hostile client sends.
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


C, X = "/v1/completions", "/v1/chat/completions"
SURROGATES = [
    (C, {"prompt": "hi \ud800 there"}, "prompt"),
    (C, {"prompt": "hi", "stop": "\ud800"}, "stop"),
    (C, {"prompt": "hi", "stop": ["ok", "a\udfff"]}, "stop[1]"),
    (C, {"prompt": "\ud800", "stream": True}, "prompt"),
    (X, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    (X, {"messages": [{"role": "system", "content": "be \udc00 nice"}, {"role": "user", "content": "hi"}]},
     "messages[0].content"),
    (X, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]},
     "messages[0].content[0].text"),
    (X, {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "messages[0].name"),
    (X, {"messages": CHAT, "stop": "\ud800"}, "stop"),
    (X, {"messages": CHAT, "user": "\ud800"}, "user"),
    (X, {"messages": [{"role": "user", "content": "\udbff"}], "stream": True}, "messages[0].content"),
    (X, {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "a\ud800"}}}},
     "response_format.json_schema.schema.pattern"),
]


@pytest.mark.parametrize("path,fields,param", SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_the_field(http, path, fields, param):
    r = raw_post(http, path, {"model": MODEL, "max_tokens": 4, "temperature": 0, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and "surrogate" in err["message"], err
    assert err["type"] == "invalid_request_error"
    still_serving(http)


@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_prompt_is_a_400_naming_prompt(http, stream):
    """Issue 43: smollm2 adds no start token, so an empty prompt gives no token; the 400 named
    prompt_ids, which no client sent."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "", "max_tokens": 4, "stream": stream})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["message"].startswith("prompt is empty"), err
    assert "prompt_ids" not in err["message"]
    still_serving(http)


def test_a_surrogate_in_a_field_name_or_the_model_is_a_400(http):
    r = raw_post(http, C, {"model": MODEL, "prompt": "hi", "\ud800": 1})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    r = raw_post(http, C, {"model": "x\ud800", "prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    still_serving(http)


@pytest.mark.parametrize("raw", [
    b"[" * 100_000,
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": "' + MODEL.encode() + b'", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    # Deep, but within what the JSON decoder takes: refused before anything walks it.
    b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "user": ' + b'{"a": ' * 900 + b"1" + b"}" * 900 + b"}",
    b'{"model": "' + MODEL.encode() + b'", "prompt": ' + b"[" * 900 + b"]" * 900 + b"}",
], ids=["100k-open", "100k-closed", "50k-in-prompt", "900-objects", "900-lists"])
def test_absurdly_nested_json_is_a_400(http, raw):
    for path in (C, X):
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        assert "nest" in r.json()["error"]["message"], r.text[:300]
    still_serving(http)


# ------------------------------------------------------------------ usage in streams


def sse(http, path: str, body: dict) -> list:
    """The stream's data: the JSON chunks, then "[DONE]"."""
    out = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("path,fields", [(C, {"prompt": PROMPTS[0]}), (X, {"messages": CHAT})])
@pytest.mark.parametrize("n", [1, 2])
def test_stream_usage_only_when_asked_and_once_on_a_last_empty_chunk(http, path, fields, n):
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "n": n, **fields}
    usage = http.post(path, json=body).json()["usage"]
    for options in (None, {"include_usage": False}):
        extra = {"stream_options": options} if options is not None else {}
        events = sse(http, path, {**body, "stream": True, **extra})
        assert events[-1] == "[DONE]"
        assert all(e.get("usage") is None for e in events[:-1]), [e for e in events[:-1] if e.get("usage")]
        assert sum(1 for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]) == n
    events = sse(http, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    with_usage = [e for e in chunks if e.get("usage") is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1], chunks
    # the same counts (how much of the prompt a slot's cache held depends on the requests before)
    uncached = lambda u: {k: v for k, v in u.items() if k != "prompt_tokens_details"}  # noqa: E731
    assert chunks[-1]["choices"] == [] and uncached(chunks[-1]["usage"]) == uncached(usage)
    assert all("usage" in e and e["usage"] is None for e in chunks[:-1])  # OpenAI: null on the others
    finals = [i for i, e in enumerate(chunks) if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == n and finals[-1] == len(chunks) - 2
    if n == 1:
        assert chunks[-1]["speculation"]["completion_tokens"] == usage["completion_tokens"]


def test_stream_usage_through_the_openai_client_counts_once(client):
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    for create, more in [(client.completions.create, {"prompt": PROMPTS[0]}),
                         (client.chat.completions.create, {"messages": CHAT})]:
        full = create(**kw, **more).usage
        chunks = list(create(**kw, **more, stream=True, stream_options={"include_usage": True}))
        assert sum(c.usage.total_tokens for c in chunks if c.usage) == full.total_tokens
        assert sum(c.usage.completion_tokens for c in chunks if c.usage) == full.completion_tokens
        assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
        chunks = list(create(**kw, **more, stream=True))
        assert all(c.usage is None for c in chunks)


# ------------------------------------------------------------------ logprobs of split characters

# Greedy: " 日本語..." with 日 and 語 split over byte tokens.
SPLIT_PROMPT = "Japanese: 日本語. Again: 日本語. Again:"


def token_bytes_of(token: str) -> bytes:
    """A legacy completions token back to its bytes: "bytes:\\xNN..." or the text itself."""
    if token.startswith("bytes:"):
        hexes = re.fullmatch(r"(?:\\x[0-9a-f]{2})+", token[len("bytes:"):])
        assert hexes, token
        return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token))
    return token.encode()


def expected_offsets(pieces: list[bytes]) -> list[int]:
    """Each token's offset: the characters completed before its first byte."""
    out, done = [], b""
    for p in pieces:
        out.append(len(done.decode("utf-8", errors="ignore")))
        done += p
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_of_byte_tokens(http, stream):
    body = {"model": MODEL, "prompt": SPLIT_PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 2}
    if not stream:
        choice = http.post(C, json=body).json()["choices"][0]
        text, lp = choice["text"], choice["logprobs"]
    else:
        chunks = [e for e in sse(http, C, {**body, "stream": True}) if e != "[DONE]"]
        text = "".join(e["choices"][0]["text"] for e in chunks)
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in chunks:
            for key in lp:
                lp[key] += (e["choices"][0]["logprobs"] or {}).get(key, [])
    assert "日本語" in text, text
    byte_tokens = [t for t in lp["tokens"] if t.startswith("bytes:")]
    assert byte_tokens, lp["tokens"]  # the prompt makes the model split characters
    assert "\ufffd" not in "".join(lp["tokens"]), lp["tokens"]
    pieces = [token_bytes_of(t) for t in lp["tokens"]]
    assert b"".join(pieces).decode() == text
    assert lp["text_offset"] == expected_offsets(pieces), (lp["text_offset"], lp["tokens"])
    assert all(0 <= o <= len(text) for o in lp["text_offset"])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # Each token's text starts at its offset, or, for a token inside a split character, at
    # that character.
    for t, o in zip(lp["tokens"], lp["text_offset"]):
        if not t.startswith("bytes:") and t:
            assert text[o:o + len(t)] == t
    for top in lp["top_logprobs"]:
        assert all(k.startswith("bytes:") or "\ufffd" not in k for k in top), top
    still_serving(http)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_of_byte_tokens_carry_their_bytes(http, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": 'Repeat exactly: "café ünïcödé 日本語"'}],
            "max_tokens": 30, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    if not stream:
        choice = http.post(X, json=body).json()["choices"][0]
        text, content = choice["message"]["content"], choice["logprobs"]["content"]
    else:
        chunks = [e for e in sse(http, X, {**body, "stream": True}) if e != "[DONE]"]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
        content = [t for e in chunks if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["content"]]
    assert "ü" in text, text
    joined = b"".join(bytes(t["bytes"]) for t in content)
    assert joined.decode() == text
    partial = []
    for t in content:
        b = bytes(t["bytes"])
        try:
            assert t["token"] == b.decode()
        except UnicodeDecodeError:
            partial.append(t)
            assert "\ufffd" not in t["token"] and "\\x" in t["token"], t
        for top in t["top_logprobs"]:
            assert isinstance(top["bytes"], list)
    assert partial, content  # ü comes as " \xc3" + "\xbc"
    still_serving(http)


def _strict_json(text: str):
    """json.loads refusing NaN and Infinity, which are not JSON (a client's parser rejects them)."""
    def refuse(name):
        raise ValueError(f"{name} in the body")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_under_a_grammar_are_finite_json(http, stream):
    """Issue 61: top_logprobs >= 2 under a json_schema answered 500 ("Out of range float values
    are not JSON compliant"), and streamed -Infinity: the tokens the grammar forbids are not
    candidates, so top_logprobs lists the allowed ones only (fewer where fewer are allowed)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0, "logprobs": True,
            "top_logprobs": 5, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    if not stream:
        r = http.post(X, json=body)
        assert r.status_code == 200, r.text
        content = _strict_json(r.text)["choices"][0]["logprobs"]["content"]
    else:
        with http.stream("POST", X, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = [_strict_json(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        content = [t for e in events if e["choices"] and e["choices"][0].get("logprobs")
                   for t in e["choices"][0]["logprobs"]["content"]]
    assert content
    assert any(len(t["top_logprobs"]) < 5 for t in content)  # where the grammar forces a token
    for t in content:
        assert all(-1e30 < top["logprob"] <= 0 for top in t["top_logprobs"]), t
        assert -1e30 < t["logprob"] <= 0
    still_serving(http)


# ------------------------------------------------------------------ SIGTERM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_mid_stream_ends_the_stream_and_exits_0(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "specdecode", "serve", "--target", MODEL, "--draft", "none",
                             "--ctx-size", "2048", "--threads", "1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)

        lines: list[str] = []
        outcome: dict = {}

        def read_stream():
            body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 1900, "temperature": 0, "stream": True}
            try:
                with httpx.Client(timeout=60) as h, h.stream("POST", url + "/v1/completions", json=body) as r:
                    outcome["status"] = r.status_code
                    for line in r.iter_lines():
                        lines.append(line)
                outcome["end"] = "closed"
            except httpx.HTTPError as e:
                outcome["end"] = repr(e)

        def queued():  # waits behind the stream (one slot): answered, not left hanging
            try:
                r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                               timeout=60)
                outcome["queued"] = r.status_code
            except httpx.HTTPError as e:
                outcome["queued"] = repr(e)

        reader = threading.Thread(target=read_stream, daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while sum(1 for line in lines if line.startswith("data: ")) < 5:
            assert time.monotonic() < deadline and reader.is_alive(), (outcome, lines)
            time.sleep(0.05)
        waiter = threading.Thread(target=queued, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", timeout=10).json()["waiting"] < 1:  # the queued one is in the queue
            assert time.monotonic() < deadline and waiter.is_alive(), outcome
            time.sleep(0.05)
        streamed = sum(1 for line in lines if line.startswith("data: "))
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)  # only a bound on a hang: how long it took is not judged
        took = time.monotonic() - start
        reader.join(60)
        waiter.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert rc == 0, (rc, took, (tmp_path / "serve.log").read_text()[-3000:])
    assert outcome.get("status") == 200 and outcome.get("end") == "closed", outcome
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    # Judged by what the stream says, not by the clock: the shutdown stopped the generation
    # (its error chunk) well before its 1900 tokens, rather than letting it run to its end.
    last = json.loads(data[-2])
    assert "error" in last and "shutting down" in last["error"]["message"], last
    texts = [json.loads(d) for d in data[:-2]]
    assert all(t["choices"][0]["finish_reason"] is None for t in texts), texts[-3:]
    assert streamed <= len(texts) < 1900, (streamed, len(texts), took)
    assert outcome.get("queued") == 503, outcome
