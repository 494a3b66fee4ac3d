"""What ``POST /v1/messages`` answers (:mod:`.anthropic` parses the request): the message
object, whole, or the stream of events that builds it, and ``POST /v1/messages/count_tokens``;
errors in Anthropic's shape under ``/v1/messages``.

A message's ``content``: a ``text`` block (unless the output is only tool calls), then one
``tool_use`` block per call read out of the text (the same parser as chat, :mod:`.toolcalls`;
``input`` the arguments as an object; a call whose arguments are no JSON object stays text).
``stop_reason``: ``end_turn`` (the model's end token), ``stop_sequence`` (one of
``stop_sequences``, named in ``stop_sequence`` where only one was given), ``max_tokens``
(``max_tokens`` or the context), ``tool_use`` (it called a tool). ``usage``: ``input_tokens``
the prompt's tokens evaluated, ``cache_read_input_tokens`` those a slot's cache held (not
evaluated again), ``cache_creation_input_tokens`` 0, ``output_tokens``. ``speculation``: the
statistics every route reports.

The stream (the Messages API reference, "Streaming messages"): ``message_start``, a ``ping``,
then per block ``content_block_start``, ``content_block_delta`` (``text_delta``,
``input_json_delta``), ``content_block_stop``, then ``message_delta`` (stop_reason, usage,
speculation) and ``message_stop``; a ``ping`` every PING_S seconds while nothing else comes (a
long prompt being read); after an error an ``error`` event ends it.
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

from .anthropic import MessagesRequest, parse_messages, rename_error
from .apierror import APIError
from .jobs import ChoiceDone, Delta
from .runner import Dialect, StreamWriter
from .toolcalls import parse_message

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

# Seconds between two pings of a stream that has nothing else to send (a long prompt being read).
PING_S = 10.0
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def error_body(error: APIError) -> dict:
    """Anthropic's error object: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(result: Any) -> dict:
    s = result.stats
    cached = s.prompt_cached or 0
    return {"input_tokens": s.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": s.completion_tokens}


def stop_reason(result: Any, calls: int, mr: MessagesRequest) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation (module docstring)."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if mr.stop_sequences and not result.stats.eog_committed:
        return "stop_sequence", mr.stop_sequences[0] if len(mr.stop_sequences) == 1 else None
    return "end_turn", None


def _tool_use(call_id: str, name: str, arguments: str) -> dict | str:
    """A call as a tool_use block, or, when its arguments are no JSON object (a call cut off by
    max_tokens), the text the model wrote for it: nothing added that it did not write."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}'
    if not isinstance(args, dict):
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'
    return {"type": "tool_use", "id": call_id, "name": name, "input": args}


class MessageBuilder:
    """One message's id and its whole object."""

    def __init__(self, mr: MessagesRequest, model_name: str, speculation: Any) -> None:
        self.mr = mr
        self.id = _id("msg")
        self.model_name = model_name
        self.speculation = speculation

    def head(self, content: list, stop: tuple[str | None, str | None], use: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model_name, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": use}

    def whole(self, result: Any) -> dict:
        tools = self.mr.req.tools
        text, calls = (result.text, []) if tools is None else parse_message(result.text, tools.parser())
        blocks, text = [], text or ""
        for call in calls:
            fn = call["function"]
            block = _tool_use(call["id"], fn["name"], fn["arguments"])
            if isinstance(block, str):  # no JSON object: left as the text the model wrote
                text += block
            else:
                blocks.append(block)
        content = ([{"type": "text", "text": text}] if text or not blocks else []) + blocks
        out = self.head(content, stop_reason(result, len(blocks), self.mr), usage(result))
        out["speculation"] = self.speculation(result)
        return out


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class MessagesStream(StreamWriter):
    """The events of one streamed message (module docstring). n_prompt: the prompt's tokens
    (message_start's input_tokens, before the cached part is known). A tool call is held until
    its arguments are complete, then sent as one tool_use block (its input in one
    input_json_delta), so that a call cut off by max_tokens is the same text as in the whole
    answer, never a tool_use block with partial input."""

    keepalive_s = PING_S

    def __init__(self, builder: MessageBuilder, n_prompt: int) -> None:
        self.builder = builder
        self.n_prompt = n_prompt
        tools = builder.mr.req.tools
        self.parser = tools.parser() if tools is not None else None
        self.index = -1  # the open block's index (-1: none yet)
        self.open_kind: str | None = None
        self.calls = 0
        self.pending: dict | None = None  # the call whose arguments are arriving

    def open(self) -> list[str]:
        use = {"input_tokens": self.n_prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
               "output_tokens": 0}
        return [_event("message_start", {"message": self.builder.head([], (None, None), use)}), self.keepalive()]

    def keepalive(self) -> str:
        return _event("ping", {})

    def _start(self, block: dict) -> list[str]:
        out = self._stop()
        self.index += 1
        self.open_kind = block["type"]
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def _stop(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        out = self._start({"type": "text", "text": ""}) if self.open_kind != "text" else []
        return out + [_event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": text}})]

    def _flush(self) -> list[str]:
        """The pending call's events: a tool_use block, or the text it was (:func:`_tool_use`)."""
        call, self.pending = self.pending, None
        if call is None:
            return []
        block = _tool_use(call["id"], call["name"], call["arguments"])
        if isinstance(block, str):
            return self._text(block)
        self.calls += 1
        return self._start({**block, "input": {}}) + [
            _event("content_block_delta", {"index": self.index, "delta": {"type": "input_json_delta",
                                                                          "partial_json": call["arguments"]}}),
            *self._stop()]

    def _parts(self, parts: list[tuple]) -> list[str]:
        out: list[str] = []
        for part in parts:
            if part[0] == "arguments":
                self.pending["arguments"] += part[2]
                continue
            out += self._flush()
            if part[0] == "content":
                out += self._text(part[1])
            else:
                self.pending = {"id": part[2], "name": part[3], "arguments": ""}
        return out

    def delta(self, event: Delta) -> list[str]:
        return self._parts(self.parser.feed(event.text) if self.parser is not None else [("content", event.text)])

    def choice(self, event: ChoiceDone, last: bool) -> list[str]:
        result = event.result
        out = self._parts(self.parser.close()) if self.parser is not None else []
        out += self._flush() + self._stop()
        stop = stop_reason(result, self.calls, self.builder.mr)
        out.append(_event("message_delta", {"delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                            "usage": usage(result),
                                            "speculation": self.builder.speculation(result)}))
        return out + [_event("message_stop", {})]

    def failed(self, error: APIError) -> list[str]:
        return [_event("error", {"error": error_body(error)["error"]})]


class MessagesDialect(Dialect):
    """Anthropic's Messages API: ``POST /v1/messages`` (``?beta=true`` as Claude Code sends it)
    and ``POST /v1/messages/count_tokens``."""

    path = "/v1/messages"
    prefix = "/v1/messages"

    def routes(self, server: Any) -> list:
        async def count(request: Request) -> Response:
            return await count_tokens(server, request)

        return [("/v1/messages/count_tokens", count, ["POST"])]

    def parse(self, body: Any, server: Any) -> MessagesRequest:
        w = server.worker
        return parse_messages(body, server.model_name, w.n_ctx, w.tool_format, server.options.strict)

    def rename(self, error: APIError, parsed: MessagesRequest | None) -> APIError:
        return rename_error(error, parsed.origin if parsed is not None else None)

    def error_body(self, error: APIError) -> dict:
        return error_body(error)

    def whole(self, parsed: MessagesRequest, choices: list[ChoiceDone], job: Any, server: Any) -> dict:
        return MessageBuilder(parsed, server.model_name, server.speculation).whole(choices[-1].result)

    def writer(self, parsed: MessagesRequest, job: Any, server: Any) -> MessagesStream:
        n_prompt = len(job.prepared.ids) if job.prepared is not None else 0
        return MessagesStream(MessageBuilder(parsed, server.model_name, server.speculation), n_prompt)


async def count_tokens(server: Any, request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: {"input_tokens": the prompt's tokens as the request
    would be read} (chat template, tools and all)."""
    from fastapi.responses import JSONResponse

    from jinja2 import TemplateError

    from ..errors import SpecDecodeError
    from .body import parse_json_body, read_body

    body = server.resolve_model(parse_json_body(await read_body(request, server.options.max_body_bytes)))
    w = server.worker
    mr = parse_messages(body, server.model_name, w.n_ctx, w.tool_format, server.options.strict, count_only=True)
    try:
        ids = await w.preparer.run_async(lambda: server.decoder.prompt_ids(messages=mr.messages, tools=mr.tools))
    except (SpecDecodeError, TemplateError) as e:  # the template refused the messages, or a field is wrong
        raise rename_error(APIError(400, str(e), param=getattr(e, "param", None) or "messages"), mr.origin) from None
    return JSONResponse({"input_tokens": len(ids)})


DIALECT = MessagesDialect()
