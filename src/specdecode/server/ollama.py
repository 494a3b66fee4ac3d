"""Ollama's API on ``specdecode serve``: the endpoints local tools speak (Open WebUI, VS Code
Copilot's Ollama provider, Continue, Zed, the ``ollama`` Python client), on the same worker,
limits, access checks and speculation as the OpenAI routes: a chat or generate request is
translated (:mod:`.ollama_protocol`) and runs as one job like a chat completion.

- ``GET /api/version``: {"version"}, the Ollama release whose API this follows
  (:data:`.ollama_models.OLLAMA_API_VERSION`).
- ``GET /api/tags``, ``GET /api/ps``: the one served model (:mod:`.ollama_models`).
- ``POST /api/show`` (``model``, or ``name`` as older clients send it; ``verbose`` accepted):
  capabilities, template, details, model_info with the served context.
- ``POST /api/chat``, ``POST /api/generate``: streamed as NDJSON unless ``"stream": false``;
  each chunk ``{"model", "created_at", "message": {"role": "assistant", "content"} |
  "response", "done": false}``; tool calls (chat) in Ollama's shape, ``{"id", "function":
  {"index", "name", "arguments": an object}}``, each in a chunk of its own once its arguments
  are complete (a call whose arguments are no JSON object stays text, as Ollama's parser
  leaves it); the last object ``done`` true with ``done_reason`` ("stop", "length"; "load" for
  a load call), Ollama's counters (``prompt_eval_count``: the prompt's tokens evaluated, those
  a slot's cache held not counted; ``eval_count``; ``total_duration`` from arrival,
  ``prompt_eval_duration``, ``eval_duration``, ``load_duration`` 0: the model is loaded when
  the server starts; all in nanoseconds) and ``speculation`` (the statistics the OpenAI
  responses carry). Not returned: ``context`` (token ids to send back; a request's
  ``context`` must be empty).

Errors are Ollama's shape, ``{"error": "..."}``, with the status the OpenAI routes give (404
for another model, 400 for a bad body, 429 when the queue is full, ...); an error after a
stream has begun is its last line, as Ollama's.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import TYPE_CHECKING, Any

from .apierror import APIError
from .body import parse_json_body, read_body
from .jobs import ChoiceDone, Delta
from .ollama_models import OLLAMA_API_VERSION, ModelCard, model_card
from .ollama_protocol import OllamaRequest, check_model, parse_chat, parse_generate, rename_error
from .runner import Dialect, StreamWriter
from .toolcalls import parse_message

# Where errors are answered in Ollama's shape: its API's paths.
OLLAMA_PATHS = "/api/"

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


class _Answer:
    """The objects of one answer: chunks, the last one with Ollama's counters, or the whole."""

    def __init__(self, p: OllamaRequest, arrival: float) -> None:
        self.p = p
        self.arrival = arrival
        tools = p.req.tools if p.req is not None else None
        self.parser = tools.parser() if tools is not None else None
        self.call: dict | None = None  # the call whose arguments are arriving (streams)
        self.calls = 0

    def chunk(self, text: str = "", calls: list | None = None, done: bool = False) -> dict:
        head = {"model": self.p.model, "created_at": _now()}
        if self.p.endpoint == "generate":
            return {**head, "response": text, "done": done}
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {**head, "message": message, "done": done}

    def final(self, result: Any, text: str = "", calls: list | None = None) -> dict:
        s = result.stats
        return {**self.chunk(text, calls, done=True), "done_reason": result.finish_reason,
                "total_duration": _ns(time.perf_counter() - self.arrival), "load_duration": 0,
                "prompt_eval_count": s.prompt_tokens - s.prompt_cached, "prompt_eval_duration": _ns(s.prefill_s),
                "eval_count": s.completion_tokens, "eval_duration": _ns(s.decode_s), "speculation": s.to_dict()}

    def loaded(self) -> dict:
        return {**self.chunk(done=True), "done_reason": "load"}

    def whole(self, result: Any) -> dict:
        if self.parser is None:
            return self.final(result, result.text)
        content, calls = parse_message(result.text, self.parser)
        out, text = [], content or ""
        for call in calls:
            made = self._ollama_call(call["id"], call["function"]["name"], call["function"]["arguments"])
            if isinstance(made, str):
                text += made
            else:
                out.append(made)
        return self.final(result, text, out)

    def _ollama_call(self, call_id: str, name: str, arguments: str) -> dict | str:
        """A call in Ollama's shape, or, when its arguments are no JSON object, its text."""
        try:
            args = json.loads(arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'
        self.calls += 1
        return {"id": call_id, "function": {"index": self.calls - 1, "name": name, "arguments": args}}

    def parts(self, parts: list[tuple]) -> list[dict]:
        """The chunks of a tool-call parser's parts: content at once, a call once its
        arguments parse as a JSON object (or, failing that, as text when the next part comes)."""
        out = []
        for part in parts:
            if part[0] == "arguments":
                self.call["arguments"] += part[2]
                try:
                    complete = isinstance(json.loads(self.call["arguments"]), dict)
                except ValueError:
                    complete = False
                if complete:
                    out.append(self._flush())
                continue
            if self.call is not None:
                out.append(self._flush())
            if part[0] == "content":
                out.append(self.chunk(part[1]))
            else:
                self.call = {"id": part[2], "name": part[3], "arguments": ""}
        return out

    def _flush(self) -> dict:
        call, self.call = self.call, None
        made = self._ollama_call(call["id"], call["name"], call["arguments"])
        return self.chunk(made) if isinstance(made, str) else self.chunk(calls=[made])

    def text(self, text: str) -> list[dict]:
        return [self.chunk(text)] if self.parser is None else self.parts(self.parser.feed(text))

    def end(self, result: Any) -> list[dict]:
        tail = [] if self.parser is None else self.parts(self.parser.close())
        if self.call is not None:
            tail.append(self._flush())
        return tail + [self.final(result)]


class OllamaStream(StreamWriter):
    """The NDJSON lines of a stream: an empty chunk at once (before the prompt is read), a chunk
    per delta, then the last object; an error event is the last line ({"error": ...})."""

    def __init__(self, answer: _Answer) -> None:
        self.answer = answer

    def open(self) -> list[str]:
        return [_line(self.answer.chunk(""))]

    def delta(self, event: Delta) -> list[str]:
        return [_line(obj) for obj in self.answer.text(event.text)]

    def choice(self, event: ChoiceDone, last: bool) -> list[str]:
        return [_line(obj) for obj in self.answer.end(event.result)]

    def failed(self, error: APIError) -> list[str]:
        return [_line({"error": error.message})]


def card(server: Any) -> ModelCard:
    """The served model's card (made once per server)."""
    found = server.shared.get("ollama_card")
    if found is None:
        w = server.worker
        found = server.shared["ollama_card"] = model_card(server.decoder.target, server.model_name, w.n_ctx,
                                                          w.tool_format is not None, server.created)
    return found


class OllamaDialect(Dialect):
    """``POST /api/chat`` or ``POST /api/generate`` (endpoint "chat" or "generate"): the request
    translated (:mod:`.ollama_protocol`) and run as one job like a chat completion; errors in
    Ollama's shape under ``/api/``. The chat dialect also lists Ollama's other endpoints."""

    prefix = OLLAMA_PATHS
    media_type = "application/x-ndjson"
    stream_headers = {"Cache-Control": "no-cache"}

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.path = f"/api/{endpoint}"

    def routes(self, server: Any) -> list:
        if self.endpoint != "chat":
            return []

        async def version(request: Request) -> Response:
            from fastapi.responses import JSONResponse

            return JSONResponse({"version": OLLAMA_API_VERSION})

        async def tags(request: Request) -> Response:
            from fastapi.responses import JSONResponse

            return JSONResponse({"models": [card(server).tags_entry()]})

        async def ps(request: Request) -> Response:
            from fastapi.responses import JSONResponse

            return JSONResponse({"models": [card(server).ps_entry()]})

        async def show(request: Request) -> Response:
            """``POST /api/show``: the model named by ``model`` (or ``name``, older clients' field)."""
            from fastapi.responses import JSONResponse

            body = parse_json_body(await read_body(request, server.options.max_body_bytes))
            if not isinstance(body, dict):
                raise APIError(400, f"the request body must be a JSON object with model, got {body!r:.60}")
            body = server.resolve_model({"model": body.get("model") or body.get("name")})
            check_model(body, card(server))
            return JSONResponse(card(server).show())

        return [("/api/version", version, ["GET"]), ("/api/tags", tags, ["GET"]), ("/api/ps", ps, ["GET"]),
                ("/api/show", show, ["POST"])]

    def parse(self, body: Any, server: Any) -> OllamaRequest:
        read = parse_chat if self.endpoint == "chat" else parse_generate
        w = server.worker
        return read(body, card(server), w.n_ctx, w.tool_format, server.options.strict)

    def rename(self, error: APIError, parsed: OllamaRequest | None) -> APIError:
        return error if parsed is None else rename_error(error, self.endpoint, parsed.system)

    def error_body(self, error: APIError) -> dict:
        return {"error": error.message}

    def no_job(self, parsed: OllamaRequest, server: Any) -> dict:
        return _Answer(parsed, time.perf_counter()).loaded()

    def whole(self, parsed: OllamaRequest, choices: list[ChoiceDone], job: Any, server: Any) -> dict:
        return _Answer(parsed, job.arrival).whole(choices[-1].result)

    def writer(self, parsed: OllamaRequest, job: Any, server: Any) -> OllamaStream:
        return OllamaStream(_Answer(parsed, job.arrival))


CHAT = OllamaDialect("chat")
GENERATE = OllamaDialect("generate")
