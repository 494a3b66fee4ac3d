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
import functools
import json
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from .access import error_response
from .apierror import APIError
from .body import parse_json_body, read_body
from .jobs import closing_stream
from .ollama_models import OLLAMA_API_VERSION, model_card
from .ollama_protocol import OllamaRequest, check_model, parse_chat, parse_generate, rename_error
from .toolcalls import parse_message

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    from .jobs import Job


class _LoadCall(Exception):
    """A request with nothing to generate (Ollama's "load the model" call): no job."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _errors(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Every APIError of an Ollama route answered in Ollama's shape."""
    @functools.wraps(handler)
    async def wrapped(self: Any, request: Request) -> Response:
        try:
            return await handler(self, request)
        except APIError as e:
            return error_response(e, request.url.path)

    return wrapped


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


async def _stream(answer: _Answer, job: Job) -> AsyncIterator[str]:
    """The NDJSON lines of a stream: an empty chunk at once (before the prompt is read), a chunk
    per delta, then the last object; an error event is the last line ({"error": ...})."""
    yield _line(answer.chunk(""))
    event = await job.events.get()
    while True:
        kind, value = event
        if kind == "error":
            yield _line({"error": rename_error(value, answer.p.endpoint, answer.p.system).message})
            return
        for obj in answer.text(value[1]) if kind == "delta" else answer.end(value[1]):
            yield _line(obj)
        if kind == "choice":
            return
        event = await job.events.get()


class OllamaRoutes:
    """The Ollama endpoints around the app's routes object (``app._Routes``: its worker, model
    name, options, and the ``_submit`` / ``_first_events`` every generation request goes through)."""

    def __init__(self, routes: Any) -> None:
        self.routes = routes
        self.worker = routes.worker
        self.card = model_card(routes.decoder.target, routes.model_name, self.worker.n_ctx,
                               self.worker.tool_format is not None, routes.created)

    def add_to(self, app: FastAPI) -> None:
        app.add_route("/api/version", self.version, methods=["GET"])
        app.add_route("/api/tags", self.tags, methods=["GET"])
        app.add_route("/api/ps", self.ps, methods=["GET"])
        app.add_route("/api/show", self.show, methods=["POST"])
        app.add_route("/api/chat", self.chat, methods=["POST"])
        app.add_route("/api/generate", self.generate, methods=["POST"])

    async def version(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        return JSONResponse({"version": OLLAMA_API_VERSION})

    async def tags(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        return JSONResponse({"models": [self.card.tags_entry()]})

    async def ps(self, request: Request) -> Response:
        from fastapi.responses import JSONResponse

        return JSONResponse({"models": [self.card.ps_entry()]})

    @_errors
    async def show(self, request: Request) -> Response:
        """``POST /api/show``: the model named by ``model`` (or ``name``, older clients' field)."""
        from fastapi.responses import JSONResponse

        body = parse_json_body(await read_body(request, self.routes.options.max_body_bytes))
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object with model, got {body!r:.60}")
        check_model({"model": body.get("model") or body.get("name")}, self.card)
        return JSONResponse(self.card.show())

    @_errors
    async def chat(self, request: Request) -> Response:
        return await self._run(request, "chat")

    @_errors
    async def generate(self, request: Request) -> Response:
        return await self._run(request, "generate")

    async def _run(self, request: Request, endpoint: str) -> Response:
        """One generation request: parsed, queued on the worker as a job, answered whole or
        as an NDJSON stream (opened once the generation's options are accepted, before its prompt is
        read: an error found until then still gets its status)."""
        from fastapi.responses import JSONResponse

        parsed: list[OllamaRequest] = []
        options = self.routes.options

        def parse(body: Any) -> Any:
            read = parse_chat if endpoint == "chat" else parse_generate
            parsed.append(read(body, self.card, self.worker.n_ctx, self.worker.tool_format, options.strict))
            if parsed[0].req is None:
                raise _LoadCall()
            return parsed[0].req

        try:
            job = await self.routes._submit(request, parse)
        except _LoadCall:
            return JSONResponse(_Answer(parsed[0], time.perf_counter()).loaded())
        except APIError as e:
            raise rename_error(e, endpoint, parsed[0].system) if parsed else e from None
        p = parsed[0]
        answer = _Answer(p, job.arrival)
        first = await self.routes._first_events(request, job)
        if not isinstance(first, list):
            return first  # the client left (499)
        event = first[-1]
        if event[0] == "error":
            raise rename_error(event[1], endpoint, p.system)
        if p.req.stream:
            return closing_stream(_stream(answer, job), on_close=lambda: self.worker.cancel(job),
                                  media_type="application/x-ndjson", headers={"Cache-Control": "no-cache"})
        return JSONResponse(answer.whole(event[1][1]))
