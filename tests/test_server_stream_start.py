"""Streams that say they are working (issue 46, item 5): every streamed endpoint sends its
first event as soon as its generation's options are accepted, before the prompt is read: chat's role chunk, a
completion's empty text, the Responses API's response.created and response.in_progress,
Ollama's empty chunk, llama.cpp /infill's empty piece. A long prefill (minutes on a CPU) no
longer leaves a client with headers and nothing else.

The model is a scripted text model of bytes whose prefill blocks until the test releases it, so
"before the prefill" is judged by an event, not by a clock.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from specdecode.api import Decoder
from specdecode.server import create_app
from specdecode.server.infill import parse_infill
from specdecode.server.infill_response import InfillAnswer, InfillStream
from specdecode.server.jobs import Delta
from specdecode.server.runner import write_stream

from test_server import ServerThread
from test_server_access import MODEL, ByteBackend

WAIT = 60.0  # seconds a test waits for an event due at once (a loaded machine is slow, not wrong)
PREFILL = 12  # a forward of this many tokens or more is a prompt's prefill, held until released


class SlowPrefill(ByteBackend):
    """ByteBackend whose prefill (a forward of PREFILL tokens or more) waits for ``go``;
    ``prefilling`` is set when one waits."""

    def __init__(self) -> None:
        super().__init__()
        self.prefilling, self.go = threading.Event(), threading.Event()

    def forward(self, token_ids, logits_for, seq=0):
        if len(token_ids) >= PREFILL:
            self.prefilling.set()
            assert self.go.wait(WAIT), "the test never released the prefill"
        return super().forward(token_ids, logits_for, seq)


PROMPT = "a prompt long enough to be a prefill"
STREAMS = [
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
                              "stream": True}),
    ("/v1/responses", {"model": MODEL, "input": PROMPT, "max_output_tokens": 4, "stream": True, "store": False}),
    ("/api/generate", {"model": MODEL, "prompt": PROMPT, "options": {"num_predict": 4, "temperature": 0}}),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                   "options": {"num_predict": 4, "temperature": 0}}),
]


def first_events(path: str, lines: list[str]) -> list:
    """The events of a stream's lines (SSE data, or NDJSON objects)."""
    if path.startswith("/api/"):
        return [json.loads(line) for line in lines if line]
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("path, body", STREAMS, ids=["completions", "chat", "responses", "ollama-generate",
                                                     "ollama-chat"])
def test_a_stream_opens_before_its_prompt_is_read(path, body):
    backend = SlowPrefill()
    with Decoder(target=backend, draft="none", num_speculative_tokens=0, progress=False) as dec, \
            ServerThread(create_app(dec)) as s, httpx.Client(base_url=s.url, timeout=WAIT) as h:
        sampling = {} if path.startswith("/api/") else {"temperature": 0}
        with h.stream("POST", path, json={**body, **sampling}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            opening = []
            while len(first_events(path, opening)) < (2 if path == "/v1/responses" else 1):
                opening.append(next(lines))
            # The prefill cannot have ended (it waits for go): the opening came before it.
            assert not backend.go.is_set()
            assert backend.prefilling.wait(WAIT)  # and the worker reads the prompt meanwhile
            events = first_events(path, opening)
            if path == "/v1/completions":
                assert events[0]["choices"][0]["text"] == "" and events[0]["choices"][0]["finish_reason"] is None
            elif path == "/v1/chat/completions":
                assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            elif path == "/v1/responses":
                assert [e["type"] for e in events] == ["response.created", "response.in_progress"]
                assert events[1]["response"]["status"] == "in_progress"
            else:
                assert events[0]["done"] is False
                text = events[0]["response"] if path == "/api/generate" else events[0]["message"]["content"]
                assert text == ""
            backend.go.set()
            rest = first_events(path, list(lines))
        # The rest of the stream is what it always was: the answer, then its end.
        if path == "/v1/responses":
            assert rest[-1]["type"] == "response.completed"
        elif path.startswith("/api/"):
            assert rest[-1]["done"] is True
        else:
            assert rest[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_an_error_found_after_the_opening_is_inside_the_stream():
    """A stream opened before the prompt is read reports an error found later (here: the
    worker shutting down during the prefill) inside the stream, in its endpoint's format."""
    backend = SlowPrefill()
    with Decoder(target=backend, draft="none", num_speculative_tokens=0, progress=False) as dec, \
            ServerThread(create_app(dec)) as s, httpx.Client(base_url=s.url, timeout=WAIT) as h:
        worker = s.server.config.app.state.worker
        with h.stream("POST", "/v1/chat/completions", json={**STREAMS[1][1], "temperature": 0}) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines)[len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
            assert backend.prefilling.wait(WAIT)
            stopper = threading.Thread(target=worker.stop, kwargs={"timeout": WAIT})
            stopper.start()
            backend.go.set()
            rest = [line for line in lines if line.startswith("data: ")]
            stopper.join(WAIT)
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["error"]["type"] == "server_error"


def test_infill_streams_open_with_an_empty_piece():
    """/infill's stream (llama.cpp's shape) opens with an empty piece of content before the
    job's first event."""

    class Job:
        events = asyncio.Queue()
        prepared = None

    ir = parse_infill({"input_prefix": "def f(", "input_suffix": ")", "stream": True}, MODEL, 2048, True,
                      lambda: 0.0, False)
    Job.req = ir.req
    Job.events.put_nowait(Delta(0, "x"))

    async def events() -> list[dict]:
        out = []
        async for e in write_stream(InfillStream(InfillAnswer(ir, MODEL, 2048), None), Job, 1):
            out.append(json.loads(e.split("data: ", 1)[1]))
            if len(out) == 2:
                return out
        return out

    opening, first = asyncio.run(events())
    assert opening["content"] == "" and opening["stop"] is False
    assert first["content"] == "x"
