"""Who may call a local server, and what one request may cost the others (issue 32): Host and
Origin checks against DNS rebinding and cross-site pages, CORS for listed origins, 415 for
bodies not sent as JSON, an answered 413 however the body comes, the prediction's limits, and
a request's preparation (tokenizing a long prediction) off the worker's steps.

The HTTP tests run a real server (uvicorn on loopback) around a scripted text model of bytes,
so that they need no model file and judge counts and events, never the wall clock.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import httpx
import numpy as np
import openai
import pytest

from specdecode.api import Decoder
from specdecode.backends.base import BackendBase
from specdecode.errors import SpecDecodeError
from specdecode.server import create_app
from specdecode.server.access import HostOriginPolicy, normalize_origin, require_json, split_host
from specdecode.server.apierror import APIError
from specdecode.server.config import PREDICTION_BYTES_PER_TOKEN, ServerOptions

from test_server import ServerThread

MODEL = "bytes"
EOS = 256
SLOW = "SLOW:"  # text that starts so is tokenized only once the test releases it


class ByteBackend(BackendBase):
    """A text model over bytes (ids 0..255, 256 ends generation) whose greedy answer to any
    prompt is "ok": the next byte is a function of the last one. Tokenizing a text that
    starts with SLOW waits (``entered`` set) until ``release`` is set, as a long prediction
    keeps a tokenizer busy. ``forwards`` counts forward passes."""

    thread_safe_tokenizer = True
    chat_template = "role: content lines"

    def __init__(self, n_ctx: int = 2048) -> None:
        self.name, self._n_vocab, self._n_ctx, self._eog = MODEL, EOS + 1, n_ctx, frozenset({EOS})
        self.tokens: list[int] = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.forwards = self.tokenized = self.slow = 0

    _kv_len = property(lambda self: len(self.tokens))

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self.tokenized += 1
        if text.startswith(SLOW):
            self.slow += 1
            self.entered.set()
            assert self.release.wait(60), "the test never released the slow tokenization"
        return list(text.encode())

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < EOS else b""

    def token_text(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < EOS else b"</s>"

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    def forward(self, token_ids: Sequence[int], logits_for: Sequence[int], seq: int = 0) -> np.ndarray:
        rows = self._check_forward(token_ids, logits_for, seq)
        self.forwards += 1
        base = len(self.tokens)
        self.tokens.extend(int(t) for t in token_ids)
        out = np.zeros((len(rows), self._n_vocab), dtype=np.float32)
        for r, i in enumerate(rows):
            out[r, self._next(base + i + 1)] = 10.0
        return out

    def _next(self, upto: int) -> int:
        """The greedy token after tokens[:upto]."""
        last = self.tokens[upto - 1]
        return ord("k") if last == ord("o") else EOS if last == ord("k") else ord("o")

    def rollback(self, n: int, seq: int = 0) -> None:
        if self._check_rollback(n, seq):
            del self.tokens[n:]

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def backend():
    return ByteBackend()


@pytest.fixture(scope="module")
def decoder(backend):
    dec = Decoder(target=backend, draft="prediction", num_speculative_tokens=4, progress=False)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def server(decoder):
    with ServerThread(create_app(decoder, max_queue=4, max_body_bytes=1 << 16, max_prediction_tokens=64,
                                 cors_origins=("http://localhost:3000",))) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}


def error_of(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    return err


# ------------------------------------------------------------------ the rules, as pure checks


def test_hosts_and_origins_are_split_and_normalised():
    assert split_host("[::1]:8000") == ("::1", "8000")
    assert split_host("LocalHost.") == ("localhost", "")
    assert split_host("127.0.0.1:80") == ("127.0.0.1", "80")
    assert normalize_origin("HTTP://LocalHost:80") == "http://localhost"
    assert normalize_origin("https://example.com:443/") == "https://example.com"
    assert normalize_origin("http://[::1]:8000") == "http://[::1]:8000"
    assert normalize_origin("null") == "null"
    for bad in ("localhost:3000", "http://a.example/path", "ftp://a.example", "http://", "http://u@a.example"):
        assert normalize_origin(bad) is None, bad


def test_host_names_this_server_or_is_refused():
    local = HostOriginPolicy("127.0.0.1")
    for ok in (None, "127.0.0.1:8000", "localhost:8000", "LOCALHOST", "localhost.", "[::1]:8000", "127.0.0.2"):
        assert local.check(ok, None) is None, ok
    assert local.check("[::ffff:127.0.0.1]:8000", None) is None  # IPv4-mapped loopback
    for bad in ("rebind.evil.example:8000", "evil.example", "localhost.evil.example", "10.0.0.5:8000", "",
                "localhost:evil", "[::1]evil", "[::1]:80@evil.example"):
        err = local.check(bad, None)
        assert err is not None and err.status == 403 and err.param == "Host" and repr(bad) in err.message, bad
    named = HostOriginPolicy("127.0.0.1", allowed_hosts=("my-box.local",))
    assert named.check("my-box.local:8000", None) is None and named.check("other.local", None) is not None
    assert HostOriginPolicy("127.0.0.1", allowed_hosts=("*",)).check("anything.example", None) is None
    # On a wildcard address any IP literal names the server (a rebinding page sends a name).
    wild = HostOriginPolicy("0.0.0.0")
    assert wild.check("192.168.1.20:8000", None) is None and wild.check("evil.example", None) is not None
    assert HostOriginPolicy("my-box.local").check("my-box.local", None) is None


def test_origin_must_be_the_servers_own_or_listed():
    p = HostOriginPolicy("127.0.0.1", cors_origins=("http://localhost:3000/",))
    host = "127.0.0.1:8000"
    assert p.check(host, "http://127.0.0.1:8000") is None  # the page at / itself
    assert p.check("localhost", "http://localhost:80") is None  # default port on both sides
    assert p.check(host, "http://localhost:3000") is None  # listed (a trailing / in the option is fine)
    assert p.check(host, "https://127.0.0.1:8000") is None  # the scheme is not compared (a TLS proxy in front)
    for bad in ("https://evil.example", "http://127.0.0.1:9000", "http://localhost:8000", "null", "garbage"):
        err = p.check(host, bad)
        assert err is not None and err.status == 403 and err.param == "Origin" and "--cors-origins" in err.message, bad
    assert HostOriginPolicy("127.0.0.1", cors_origins=("*",)).check(host, "https://any.example") is None
    assert HostOriginPolicy("127.0.0.1", cors_origins=("null",)).check(host, "null") is None
    # A refused Host is refused whatever the Origin.
    assert p.check("evil.example", "http://localhost:3000").param == "Host"


def test_only_json_is_json():
    for ok in ("application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
        require_json(ok)
    for bad in (None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                "application/jsonx"):
        with pytest.raises(APIError) as e:
            require_json(bad)
        assert e.value.status == 415 and e.value.param == "Content-Type"


def test_server_options_check_the_new_fields():
    o = ServerOptions(allowed_hosts=["a.local", "b.local"], cors_origins="http://localhost:3000")
    assert o.allowed_hosts == ("a.local", "b.local") and o.cors_origins == ("http://localhost:3000",)
    for field, value in (("allowed_hosts", ("a b",)), ("allowed_hosts", ("http://a.local",)), ("allowed_hosts", ("",)),
                         ("cors_origins", ("localhost:3000",)), ("cors_origins", ("http://a.example/x",)),
                         ("cors_origins", (3,)), ("max_prediction_tokens", 0)):
        with pytest.raises(SpecDecodeError) as e:
            ServerOptions(**{field: value})
        assert e.value.param == field and field in str(e.value)
    o = ServerOptions.from_strings({"allowed_hosts": "a.local, b.local", "cors_origins": "http://x.example",
                                    "max_prediction_tokens": "100"})
    assert o.allowed_hosts == ("a.local", "b.local") and o.cors_origins == ("http://x.example",)
    assert o.max_prediction_tokens == 100


def test_serve_flags_reach_the_options():
    from specdecode.cli import build_parser

    args = build_parser().parse_args(["serve", "--allowed-hosts", "a.local,b.local", "--allowed-hosts", "c.local",
                                      "--cors-origins", "http://localhost:3000", "--max-prediction-tokens", "512"])
    o = ServerOptions.from_args(args, None)
    assert o.allowed_hosts == ("a.local", "b.local", "c.local") and o.cors_origins == ("http://localhost:3000",)
    assert o.max_prediction_tokens == 512
    args = build_parser().parse_args(["serve", "--cors-origins", "localhost:3000"])
    with pytest.raises(SpecDecodeError) as e:
        ServerOptions.from_args(args, None)
    assert e.value.param == "--cors-origins" and "--cors-origins" in str(e.value)


# ------------------------------------------------------------------ the rules, over HTTP


def test_a_rebinding_host_is_refused_on_every_path(server, http):
    before = http.get("/metrics").text
    for method, path in (("GET", "/"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/health")):
        r = http.request(method, path, headers={"Host": "rebind.evil.example"}, json=CHAT if method == "POST" else None)
        err = error_of(r, 403, "Host")
        assert err["code"] == "host_not_allowed" and "rebind.evil.example" in err["message"]
    assert http.get("/v1/models").status_code == 200  # its own name (127.0.0.1:port) still works
    assert http.get("/v1/models", headers={"Host": f"localhost:{server.port}"}).status_code == 200
    assert 'reason="forbidden"' in http.get("/metrics").text and 'reason="forbidden"' not in before


def test_a_cross_site_simple_request_is_refused(server, http):
    # What any web page may send without a preflight: text/plain with a JSON body.
    r = http.post("/v1/chat/completions", content=json.dumps(CHAT), headers={"Content-Type": "text/plain"})
    assert error_of(r, 415, "Content-Type")["code"] == "unsupported_media_type"
    # ... and from another site's page, whatever its type.
    r = http.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://evil.example"})
    assert error_of(r, 403, "Origin")["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    # The server's own page (same origin) and a listed origin are served; only the latter gets CORS.
    own = http.post("/v1/chat/completions", json=CHAT, headers={"Origin": server.url})
    assert own.status_code == 200 and own.json()["choices"][0]["message"]["content"] == "ok"
    listed = http.post("/v1/chat/completions", json=CHAT, headers={"Origin": "http://localhost:3000"})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_cors_preflight_for_listed_origins_only(http):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    ok = http.options("/v1/chat/completions", headers={"Origin": "http://localhost:3000", **ask})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    error_of(http.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **ask}), 403, "Origin")


def test_the_page_may_not_be_framed(http):
    r = http.get("/")
    assert r.status_code == 200 and r.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]


def test_the_openai_client_is_served_unchanged(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=8, temperature=0)
    assert r.choices[0].message.content == "ok"


def _urllib_post(url: str, body: bytes, content_type: str = "application/json", chunked: bool = False) -> tuple:
    """POST with urllib, which sends Connection: close (so the server closes once it has
    answered): (status, error body) or ("reset", message)."""
    data = iter([body[i:i + 65536] for i in range(0, len(body), 65536)]) if chunked else body
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    if chunked:
        req.add_header("Transfer-Encoding", "chunked")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]
    except (urllib.error.URLError, ConnectionError) as e:
        return "reset", str(e)


@pytest.mark.parametrize("size", [1 << 20, 16 << 20])
def test_every_body_over_the_limit_gets_its_413(server, size):
    url = server.url + "/v1/chat/completions"
    status, err = _urllib_post(url, b"x" * size)
    assert status == 413 and err["code"] == "request_too_large" and str(size) in err["message"], (status, err)
    status, err = _urllib_post(url, b"x" * size, chunked=True)
    assert status == 413 and err["code"] == "request_too_large", (status, err)
    # Refused for its type before it is read: still answered, not reset.
    status, err = _urllib_post(url, b"x" * size, content_type="text/plain")
    assert status == 415, (status, err)


def test_a_raw_client_that_sends_everything_before_reading_gets_the_413(server):
    body = b"x" * (4 << 20)
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply


# ------------------------------------------------------------------ what one request costs the others


def test_a_prediction_over_the_limits_is_a_400_naming_it(http):
    too_many = dict(CHAT, prediction={"type": "content", "content": "y" * 65})  # 65 byte tokens > 64
    err = error_of(http.post("/v1/chat/completions", json=too_many), 400, "prediction")
    assert err["code"] == "prediction_too_large" and "65 tokens" in err["message"] and "64" in err["message"]
    size = PREDICTION_BYTES_PER_TOKEN * 64 + 1
    too_long = dict(CHAT, prediction={"type": "content", "content": "y" * size})
    err = error_of(http.post("/v1/chat/completions", json=too_long), 400, "prediction")
    assert f"{size} bytes" in err["message"]
    fits = dict(CHAT, prediction={"type": "content", "content": "ok"})
    r = http.post("/v1/chat/completions", json=fits)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_a_neighbour_is_served_while_a_maximal_prediction_is_prepared(server, backend, http):
    """The big request's prediction takes its tokenizer "forever" (until the test releases
    it); the neighbour's request must meanwhile run to its end, in as many forwards as alone."""
    alone_before = backend.forwards
    assert http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"] == "ok"
    alone = backend.forwards - alone_before
    maximal = SLOW + "y" * (64 - len(SLOW))  # 64 tokens: the limit
    big = dict(CHAT, prediction={"type": "content", "content": maximal})
    backend.entered.clear()
    backend.release.clear()
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.url, timeout=60) as other:
        pending = pool.submit(other.post, "/v1/chat/completions", json=big)
        try:
            assert backend.entered.wait(30), "the big request's prediction was never tokenized"
            before = backend.forwards
            r = http.post("/v1/chat/completions", json=CHAT, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
            assert backend.forwards - before == alone  # steps of its own only
            assert not pending.done()  # the big one is still being prepared
        finally:
            backend.release.set()
        done = pending.result(timeout=60)
    assert done.status_code == 200 and done.json()["choices"][0]["message"]["content"] == "ok"


def test_duplicate_host_or_origin_headers_are_refused(server):
    for name, value in (("Host", f"127.0.0.1:{server.port}"), ("Origin", server.url)):
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
            first = f"Host: 127.0.0.1:{server.port}\r\n" if name == "Origin" else ""
            s.sendall(f"GET /v1/models HTTP/1.1\r\n{first}{name}: {value}\r\n{name}: evil.example\r\n"
                      "Connection: close\r\n\r\n".encode())
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 403") and f'"param":"{name}"'.encode() in reply, reply[:300]


def test_listed_origins_are_matched_as_browsers_send_them(decoder):
    with ServerThread(create_app(decoder, cors_origins=("HTTP://LocalHost:3000/", "http://localhost:80"))) as s, \
            httpx.Client(base_url=s.url, timeout=60) as h:
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        for origin in ("http://localhost:3000", "http://localhost"):
            r = h.options("/v1/chat/completions", headers={"Origin": origin, **ask})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, (origin, r.text)
            r = h.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("method,path,status", [("POST", "/v1/nothing-here", 404), ("POST", "/v1/models", 405),
                                                ("POST", "/health", 405)])
def test_a_big_body_to_a_route_that_reads_none_is_answered(server, method, path, status):
    req = urllib.request.Request(server.url + path, data=b"x" * (8 << 20), method=method,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == status and json.loads(e.value.read())["error"]["message"]


def test_a_chunked_body_whose_last_chunk_passes_the_limit_gets_its_413(server):
    """The over-limit chunk is also the last: nothing is left to drain (this hung once)."""
    body = json.dumps({"model": MODEL, "prompt": "x" * (1 << 16)}).encode()
    with httpx.Client(base_url=server.url, timeout=30) as h:
        r = h.post("/v1/completions", content=iter([body[:1000], body[1000:]]),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_prompt_too_long_for_any_context_is_refused_before_it_is_tokenized():
    b = ByteBackend(n_ctx=512)
    with Decoder(target=b, draft="none", num_speculative_tokens=0, progress=False) as dec, \
            ServerThread(create_app(dec)) as s, httpx.Client(base_url=s.url, timeout=60) as h:
        huge = dict(CHAT, messages=[{"role": "user", "content": "y" * (32 * 512 + 1)}])  # 32 bytes per token
        err = error_of(h.post("/v1/chat/completions", json=huge), 400, "messages")
        assert err["code"] == "context_length_exceeded" and "bytes" in err["message"]
        assert b.tokenized == 0
        fits = dict(CHAT, messages=[{"role": "user", "content": "y" * 400}])
        assert h.post("/v1/chat/completions", json=fits).status_code == 200 and b.tokenized == 1


def test_requests_waiting_to_be_prepared_get_503_when_the_server_stops():
    """Both preparation threads busy with slow tokenizations and a third request queued behind
    them: stopping answers every one with a JSON 503, none with a 500."""
    b = ByteBackend()
    dec = Decoder(target=b, draft="none", num_speculative_tokens=0, progress=False)
    slow = {"model": MODEL, "prompt": SLOW + " hi", "max_tokens": 4, "temperature": 0}
    app = create_app(dec)
    try:
        with ServerThread(app) as s, ThreadPoolExecutor(3) as pool, httpx.Client(base_url=s.url, timeout=60) as h:
            pending = [pool.submit(h.post, "/v1/completions", json=slow) for _ in range(3)]
            for _ in range(3000):  # both threads inside the slow tokenizer: counted, not timed
                if b.slow >= 2:
                    break
                threading.Event().wait(0.01)
            assert b.slow == 2, "the preparation threads never both started"
            app.state.worker.stop(timeout=0)  # as SIGTERM does
            b.release.set()
            answers = [p.result(timeout=60) for p in pending]
    finally:
        b.release.set()
        dec.close()
    for r in answers:
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text


def test_each_refusal_is_logged_on_one_line_with_its_reason_and_not_the_body(http, caplog):
    """Issue 46, item 4: uvicorn logged a 400 as '"POST /v1/responses HTTP/1.1" 400 Bad Request'."""
    secret = "hunter2-do-not-log"
    with caplog.at_level("WARNING", logger="specdecode.server"):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": secret}],
                                                     "temperature": 9})
        assert r.status_code == 400
        r = http.post("/v1/completions", content=b"{", headers={"Content-Type": "application/json"})
        assert r.status_code == 400
        r = http.get("/v1/models/" + "x" * 500)
        assert r.status_code == 404
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "specdecode.server"]
    assert lines[0] == "400 /v1/chat/completions: invalid_request_error, param temperature", lines
    assert lines[1].startswith("400 /v1/completions: invalid_request_error") and len(lines) == 3, lines
    assert lines[2].startswith("404 /v1/models/xxxx") and len(lines[2]) < 300, lines
    assert not any(secret in line or "\n" in line for line in lines)
