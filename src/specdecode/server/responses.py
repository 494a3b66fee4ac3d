"""The bodies the OpenAI-compatible endpoints answer: a whole response, or the chunks of a
server-sent-event stream, built from what the worker posts (:class:`.jobs.Job` events).

With tools (:mod:`.tools`), each chat choice's text goes through its own tool-call parser
(:mod:`.toolcalls`): the whole text at once for a full response, delta by delta for a
stream, so that the stream's content and argument pieces join to the full response's.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from .apierror import APIError
from .extensions import completion_details
from .jobs import ChoiceDone, Delta
from .protocol import GenRequest, parse_request
from .runner import Dialect, StreamWriter
from .toolcalls import finish_reason, parse_message
from .tools import ToolRequest


def sse(obj: dict | str) -> str:
    """One server-sent event: the object as JSON (or a string as it is)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


def _usage(results: list) -> dict:
    """The request's usage: the prompt once (every choice reads the same one, as OpenAI
    counts it; its cached tokens the first choice's), completion tokens summed over the choices."""
    prompt = results[0].stats.prompt_tokens
    completion = sum(r.stats.completion_tokens for r in results)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             # the prompt's tokens a slot's cache already held (OpenAI's field): not evaluated again
             "prompt_tokens_details": {"cached_tokens": results[0].stats.prompt_cached}}
    details = completion_details(results)  # with a prediction: its accepted and rejected tokens
    return {**usage, "completion_tokens_details": details} if details else usage


def _chat_message(result: Any, tools: ToolRequest | None) -> tuple[dict, str]:
    """A chat choice's message and finish_reason: with tools, its calls read out of the text
    (content None when the text is only calls; finish_reason "tool_calls" after calls)."""
    if tools is None:
        return {"role": "assistant", "content": result.text}, result.finish_reason
    content, calls = parse_message(result.text, tools.parser())
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, finish_reason(result.finish_reason, len(calls))


def full_response(kind: str, model_name: str, choices: list[tuple[int, Any, dict | None]],
                  speculation: Callable[[Any], dict], tools: ToolRequest | None = None) -> dict:
    """The whole response; choices: (index, GenerationResult, logprobs object) per choice.
    One choice: ``speculation`` at the top; several: on each choice."""
    items = []
    for index, result, logprobs in choices:
        if kind == "chat":
            message, finish = _chat_message(result, tools)
            item = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        else:
            item = {"index": index, "text": result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}
        if len(choices) > 1:
            item["speculation"] = speculation(result)
        items.append(item)
    if kind == "chat":
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion"}
    else:
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
    results = [result for _, result, _ in choices]
    out = {**head, "created": int(time.time()), "model": model_name, "system_fingerprint": None,
           "choices": items, "usage": _usage(results)}
    if len(choices) == 1:
        out["speculation"] = speculation(results[0])
    return out


def _part_delta(part: tuple) -> dict:
    """A tool-call parser's part as a chat delta (OpenAI's streamed tool_calls)."""
    if part[0] == "content":
        return {"content": part[1]}
    if part[0] == "call":
        _, index, call_id, name = part
        return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}
    return {"tool_calls": [{"index": part[1], "function": {"arguments": part[2]}}]}


class _Choices:
    """The chunks of one stream's choices: the first chunk of each chat choice carries the
    role; with tools, each chat choice's text goes through its own parser, and a delta's
    logprobs ride on the first chunk its text gives (on an empty delta when it gives none)."""

    def __init__(self, kind: str, head: dict, tools: ToolRequest | None) -> None:
        self.chat = kind == "chat"
        self.head = head
        self.tools = tools if self.chat else None
        self.parsers: dict[int, Any] = {}

    def chunk(self, index: int, delta: dict | str, finish: str | None = None, logprobs: dict | None = None) -> dict:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self.head, "choices": [choice]}

    def open(self, index: int) -> list[dict]:
        """The chunks that open a choice (chat: the role)."""
        if not self.chat or index in self.parsers:
            return []
        self.parsers[index] = self.tools.parser() if self.tools is not None else None
        return [self.chunk(index, {"role": "assistant", "content": ""})]

    def text(self, index: int, text: str, logprobs: dict | None) -> list[dict]:
        """The chunks of a text delta of the choice."""
        parser = self.parsers.get(index)
        if parser is None:
            return [self.chunk(index, {"content": text} if self.chat else text, logprobs=logprobs)]
        return self._parts(index, parser.feed(text), logprobs)

    def _parts(self, index: int, parts: list[tuple], logprobs: dict | None) -> list[dict]:
        deltas = [_part_delta(p) for p in parts] or ([{}] if logprobs is not None else [])
        return [self.chunk(index, d, logprobs=logprobs if i == 0 else None) for i, d in enumerate(deltas)]

    def end(self, index: int, result: Any, logprobs: dict | None) -> list[dict]:
        """The chunks that close a choice: what its parser held back, then the finish_reason chunk."""
        parser = self.parsers.get(index)
        out = [] if parser is None else self._parts(index, parser.close(), None)
        reason = result.finish_reason if parser is None else finish_reason(result.finish_reason, parser.calls)
        return out + [self.chunk(index, {} if self.chat else "", finish=reason, logprobs=logprobs)]


class ChatStream(StreamWriter):
    """The SSE chunks of a stream, choice after choice (each opened, for chat, by its role
    chunk and closed by its finish_reason chunk); then, as OpenAI does, with
    stream_options.include_usage only, one chunk with empty choices and the request's
    usage (every other chunk then has usage null; without the option no chunk has usage);
    then [DONE]. speculation(result): a choice's statistics."""

    def __init__(self, kind: str, model_name: str, req: GenRequest, speculation: Callable[[Any], dict]) -> None:
        self.head = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                     "created": int(time.time()), "model": model_name, "system_fingerprint": None}
        if req.include_usage:
            self.head["usage"] = None
        self.req = req
        self.speculation = speculation
        self.choices = _Choices(kind, self.head, req.tools)
        self.results: list = []

    def open(self) -> list[str]:
        # The stream opens before the prompt is read (a long prefill takes minutes on a CPU):
        # chat's role chunk, a completion's empty text.
        return [sse(c) for c in (self.choices.open(0) if self.choices.chat else [self.choices.chunk(0, "")])]

    def delta(self, event: Delta) -> list[str]:
        chunks = self.choices.open(event.index)
        text = self.choices.text(event.index, event.text, event.logprobs)
        if text and event.trace is not None:  # speculative.trace: where this text came from
            text[0]["speculation_trace"] = event.trace
        return [sse(c) for c in chunks + text]

    def choice(self, event: ChoiceDone, last: bool) -> list[str]:
        req, result = self.req, event.result
        self.results.append(result)
        spec = self.speculation(result)
        *chunks, final = self.choices.open(event.index) + self.choices.end(event.index, result, event.logprobs)
        if req.n > 1:
            final["choices"][0]["speculation"] = spec
        if last and req.n == 1:
            final["speculation"] = spec
        out = [sse(c) for c in (*chunks, final)]
        if last and req.include_usage:
            tail = {**self.head, "choices": [], "usage": _usage(self.results)}
            if req.n == 1:
                tail["speculation"] = spec
            out.append(sse(tail))
        return out

    def failed(self, error: APIError) -> list[str]:
        return [sse(error.body()), sse("[DONE]")]

    def close(self) -> list[str]:
        return [sse("[DONE]")]


@dataclass
class OpenAIRequest:
    """A parsed Chat Completions or Completions body: the request it runs as."""

    req: GenRequest


class OpenAIDialect(Dialect):
    """Chat Completions (kind "chat", ``POST /v1/chat/completions``) or Completions (kind
    "completion", ``POST /v1/completions``): OpenAI's bodies (:func:`.protocol.parse_request`),
    answers and errors."""

    def __init__(self, kind: str, path: str) -> None:
        self.kind = kind
        self.path = path

    def parse(self, body: Any, server: Any) -> OpenAIRequest:
        w = server.worker
        return OpenAIRequest(parse_request(body, self.kind, server.model_name, w.n_ctx,
                                           w.tool_format, server.options.strict))

    def whole(self, parsed: OpenAIRequest, choices: list[ChoiceDone], job: Any, server: Any) -> dict:
        return full_response(self.kind, server.model_name, [(c.index, c.result, c.logprobs) for c in choices],
                             server.speculation, parsed.req.tools)

    def writer(self, parsed: OpenAIRequest, job: Any, server: Any) -> ChatStream:
        return ChatStream(self.kind, server.model_name, parsed.req, server.speculation)


CHAT = OpenAIDialect("chat", "/v1/chat/completions")
COMPLETIONS = OpenAIDialect("completion", "/v1/completions")
