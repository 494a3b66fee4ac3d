"""Clients that hold the server without using it (issue 43, item 5): a stream whose client never
reads is ended once it holds more than --max-unread-bytes unread (its slot freed, an error event
at its end in its endpoint's format), and connections that trickle a request's head or body are
answered 408 and closed after --header-timeout / --body-timeout.

The server runs on loopback around a scripted text model of bytes (no model file). The bound is
judged by counting events; the timeouts are set short (1 s) and each test waits up to 30 s for
their outcome, so that a loaded machine slows the tests without failing them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import h11
import httpx
import pytest
import uvicorn

from specdecode.api import Decoder
from specdecode.cli import build_parser
from specdecode.errors import SpecDecodeError
from specdecode.server import create_app
from specdecode.server.config import ServerOptions
from specdecode.server.connection import http_protocol
from specdecode.server.protocol import parse_request
from specdecode.server.jobs import EVENT_OVERHEAD_BYTES, ChoiceDone, Delta, Failed, Job, Started

from test_server import ServerThread, metrics, total
from test_server_access import MODEL, ByteBackend

X = ord("x")
WAIT = 30.0  # seconds a test waits for an outcome due after about 1 s (a loaded machine is slow, not wrong)


class EndlessBackend(ByteBackend):
    """A text model of bytes whose greedy answer to any prompt is the token X, again and again
    (to max_tokens), each X holding ``piece`` bytes of text."""

    def __init__(self, piece: int, n_ctx: int = 2048) -> None:
        super().__init__(n_ctx=n_ctx)
        self.piece = b"x" * piece

    def _next(self, upto: int) -> int:
        return X

    def token_bytes(self, token_id: int) -> bytes:
        return self.piece if token_id == X else super().token_bytes(token_id)

    def token_text(self, token_id: int) -> bytes:
        return self.piece if token_id == X else super().token_text(token_id)


def until(condition, what: str, timeout: float = WAIT) -> None:
    """Wait (polling) until condition() holds; fail naming what was awaited."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.01)


# ------------------------------------------------------------------ a stream nobody reads


PIECE = 100  # bytes of text per delta (one token a step: no drafter)
EVENT = EVENT_OVERHEAD_BYTES + PIECE  # what one unread delta counts
BOUND = 10 * EVENT  # ten deltas may wait unread; the eleventh passes the bound


def stream_job(app, loop, max_tokens: int, stream: bool = True) -> Job:
    """A completion job for the app's worker, prepared as the app prepares one."""
    worker = app.state.worker
    req = parse_request({"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "temperature": 0,
                         "stream": stream}, "completion", MODEL, worker.n_ctx)
    return Job(req, loop, time.perf_counter(), worker.preparer.prepare(req))


def test_a_stream_nobody_reads_is_ended_after_the_bound_and_frees_its_slot():
    """One slot: a stream whose events are never taken holds ten deltas, the eleventh passes the
    bound, and the worker ends it there (no twelfth step), with an error event after the deltas;
    the slot then serves the next request."""
    backend = EndlessBackend(PIECE)
    with Decoder(target=backend, draft="none", num_speculative_tokens=0, progress=False) as dec:
        app = create_app(dec, max_unread_bytes=BOUND)
        worker = app.state.worker

        async def go():
            loop = asyncio.get_running_loop()
            job = stream_job(app, loop, max_tokens=1000)
            assert worker.submit(job)
            # "started" (the stream opens), ten deltas, the eleventh over the bound, the error.
            while not (job.events.qsize() == 13 and worker.running() == 0):  # counted, the wait only bounded
                assert time.monotonic() < deadline, f"{job.events.qsize()} events, {worker.running()} running"
                await asyncio.sleep(0.01)
            assert isinstance(job.events.get_nowait(), Started)
            events = [job.events.get_nowait() for _ in range(12)]
            assert job.events.unread == 0
            after = stream_job(app, loop, max_tokens=3, stream=False)
            assert worker.submit(after)
            return events, await asyncio.wait_for(after.events.get(), WAIT), job

        worker.start()
        try:
            deadline = time.monotonic() + WAIT
            events, answer, job = asyncio.run(go())
        finally:
            worker.stop()
    assert [type(e) for e in events] == [Delta] * 11 + [Failed]
    assert all(e.text == "x" * PIECE for e in events[:11])
    error = events[-1].error
    assert error.code == "stream_not_read" and str(BOUND) in error.message and "--max-unread-bytes" in error.message
    assert str(11 * EVENT) in error.message  # what was unread when it ended
    result = answer.result
    assert isinstance(answer, ChoiceDone) and result.text == "x" * PIECE * 3 and result.finish_reason == "length"
    assert job.cancelled.is_set() is False  # ended by the bound, not by a disconnect


def test_a_stream_read_as_it_comes_is_never_cut():
    """The same bound, a reader that takes each delta before the next step (the steps wait
    for it): 60 deltas, six times the bound, all delivered, and the choice ends normally."""
    backend = EndlessBackend(PIECE)
    with Decoder(target=backend, draft="none", num_speculative_tokens=0, progress=False) as dec:
        app = create_app(dec, max_unread_bytes=BOUND)
        worker = app.state.worker
        jobs: list[Job] = []
        real_step = dec.step

        def step(gens):  # each step waits until the reader has taken every event
            until(lambda: jobs[0].events.unread == 0, "the reader")
            return real_step(gens)

        dec.step = step

        async def go():
            jobs.append(stream_job(app, asyncio.get_running_loop(), max_tokens=60))
            assert worker.submit(jobs[0])
            assert isinstance(await asyncio.wait_for(jobs[0].events.get(), WAIT), Started)  # the stream opens
            events = []
            while not events or isinstance(events[-1], Delta):
                events.append(await asyncio.wait_for(jobs[0].events.get(), WAIT))
            return events

        worker.start()
        try:
            events = asyncio.run(go())
        finally:
            worker.stop()
    assert [type(e) for e in events] == [Delta] * 60 + [ChoiceDone]
    assert events[-1].result.finish_reason == "length"


def post_head(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, bytes, dict]:
    """A whole HTTP response read from sock (h11 parses it): status, body, headers."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))  # h11 answers requests it sent
    conn.send(h11.EndOfMessage())
    status, headers, body = 0, {}, bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(1 << 16))
        elif isinstance(event, h11.Response):
            status, headers = event.status_code, {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return status, bytes(body), headers


BIG = 32768  # bytes of text per delta: max_tokens of them (128 MB) pass any socket's buffers (Linux's: 4 MB by default)
MAX_TOKENS = 4000
STREAMS = [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": MAX_TOKENS, "stream": True,
                         "temperature": 0}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": MAX_TOKENS, "stream": True,
                       "temperature": 0, "store": False}),
]


@pytest.mark.parametrize("path, body", STREAMS, ids=["completions", "chat", "responses"])
def test_a_stream_whose_client_stops_reading_ends_with_its_endpoints_error(path, body):
    """A client that reads nothing of its stream, with a small receive buffer: once the socket
    buffers are full (or the event loop falls behind the steps) the deltas wait in the server,
    and past the bound (eight deltas of 32 KiB) the generation ends, long before max_tokens, and
    its slot is free. The client, reading at
    last, finds the deltas and then the error in its endpoint's format."""
    backend = EndlessBackend(BIG, n_ctx=MAX_TOKENS + 64)
    with Decoder(target=backend, draft="none", num_speculative_tokens=0, progress=False) as dec, \
            ServerThread(create_app(dec, max_unread_bytes=8 * (BIG + EVENT_OVERHEAD_BYTES))) as s, \
            httpx.Client(base_url=s.url, timeout=WAIT) as h, socket.socket() as sock:
        worker = s.server.config.app.state.worker
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 14)  # set before connecting: no autotuning
        sock.settimeout(WAIT)
        sock.connect(("127.0.0.1", s.port))
        data = json.dumps(body).encode()
        sock.sendall(post_head(path, data) + data)
        until(lambda: backend.forwards > 1, "the generation to start")
        until(lambda: total(metrics(h), "specdecode:request_aborted_total") == 1, "the stream to be ended")
        assert worker.running() == 0
        generated = backend.forwards
        assert generated < MAX_TOKENS - 100  # ended by the bound, not by max_tokens
        status, raw, _ = read_response(sock)
        assert h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert status == 200
    datas = [json.loads(line[len("data: "):]) for line in raw.decode().split("\n")
             if line.startswith("data: ") and line != "data: [DONE]"]
    if path == "/v1/responses":
        assert [d["type"] for d in datas[-2:]] == ["error", "response.failed"]
        assert datas[-2]["code"] == "stream_not_read" and "--max-unread-bytes" in datas[-2]["message"]
        assert datas[-1]["response"]["status"] == "failed"
        text = "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta")
    else:
        assert raw.decode().endswith("data: [DONE]\n\n")
        assert datas[-1]["error"]["code"] == "stream_not_read"
        key = "text" if path == "/v1/completions" else "content"
        text = "".join((c["choices"][0].get(key) or c["choices"][0].get("delta", {}).get(key) or "")
                       for c in datas[:-1])
    deltas = len(text) // BIG
    assert text == "x" * BIG * deltas and 8 < deltas <= generated  # whole deltas, in order, the unread ones too


# ------------------------------------------------------------------ trickled heads and bodies


class TimeoutServer(ServerThread):
    """ServerThread with the header timeout of ``specdecode serve`` (uvicorn's protocol with a
    deadline on each request's head)."""

    def __init__(self, app, header_timeout: float) -> None:
        super().__init__(app)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=http_protocol(header_timeout)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)


@pytest.fixture(scope="module")
def server():
    dec = Decoder(target=ByteBackend(), draft="none", num_speculative_tokens=0, progress=False)
    with TimeoutServer(create_app(dec, body_timeout=1.0), header_timeout=1.0) as s:
        yield s
    dec.close()


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    out = bytearray()
    while chunk := sock.recv(1 << 16):
        out += chunk
    return bytes(out)


def error_code(answer: bytes) -> str:
    head, _, body = answer.partition(b"\r\n\r\n")
    return json.loads(body)["error"]["code"]


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-"],
                         ids=["nothing", "half a head"])
def test_a_head_not_complete_in_time_gets_408_and_the_connection_closes(server, sent):
    with connect(server) as sock:
        sock.sendall(sent)
        answer = read_to_close(sock)  # returns once the server closes
    assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer.lower()
    assert error_code(answer) == "header_timeout"


def test_a_head_sent_in_time_is_answered(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, body, _ = read_response(sock)
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_a_later_request_on_the_connection_gets_its_own_deadline(server):
    """A kept-alive connection: the first request answered, the second's head cut off: 408."""
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock)[0] == 200
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        answer = read_to_close(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") and error_code(answer) == "header_timeout"


def test_a_body_not_complete_in_time_gets_408_and_the_connection_closes(server):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    with connect(server) as sock:
        sock.sendall(post_head("/v1/completions", body) + body[:10])
        answer = read_to_close(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer.lower()
    assert error_code(answer) == "body_timeout"


def test_a_body_to_a_route_that_reads_none_is_not_drained_forever(server):
    """GET /health with a body that never ends: the drain gives up at the deadline, the answer
    comes and the connection closes."""
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n0123456789")
        answer = read_to_close(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and b"connection: close" in answer.lower()


def test_a_body_sent_in_time_is_answered(server):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}).encode()
    with connect(server) as sock:
        sock.sendall(post_head("/v1/completions", body) + body)
        status, answer, _ = read_response(sock)
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == "ok"


# ------------------------------------------------------------------ the options


def test_the_options_are_checked_and_reach_the_server():
    o = ServerOptions.from_strings({"max_unread_bytes": "4096", "header_timeout": "2.5", "body_timeout": "10"})
    assert (o.max_unread_bytes, o.header_timeout, o.body_timeout) == (4096, 2.5, 10.0)
    for field, value in (("max_unread_bytes", 0), ("max_unread_bytes", 1.5), ("header_timeout", 0),
                         ("header_timeout", float("inf")), ("body_timeout", -1), ("body_timeout", True),
                         ("body_timeout", "60")):
        with pytest.raises(SpecDecodeError) as e:
            ServerOptions(**{field: value})
        assert e.value.param == field and field in str(e.value)
    args = build_parser().parse_args(["serve", "--max-unread-bytes", "65536", "--header-timeout", "5",
                                      "--body-timeout", "20"])
    o = ServerOptions.from_args(args, None)
    assert (o.max_unread_bytes, o.header_timeout, o.body_timeout) == (65536, 5.0, 20.0)
    d = ServerOptions.from_args(build_parser().parse_args(["serve"]), None)
    assert (d.max_unread_bytes, d.header_timeout, d.body_timeout) == (1 << 20, 30.0, 60.0)
    for flag, value in (("--header-timeout", "0"), ("--body-timeout", "nan"), ("--max-unread-bytes", "0")):
        with pytest.raises(SpecDecodeError) as e:
            ServerOptions.from_args(build_parser().parse_args(["serve", flag, value]), None)
        assert e.value.param == flag and f"{flag} " in str(e.value) and "expected" in str(e.value)
