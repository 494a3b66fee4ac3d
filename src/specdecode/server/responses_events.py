"""What ``POST /v1/responses`` answers (:mod:`.responses_api` parses the request): the
response object, whole, or the stream of Responses events that builds it
(``response.created`` ... ``response.completed``), from what the worker posts
(:class:`.jobs.Job` events).

Output items: a ``message`` with one ``output_text`` part (present unless the output is only
function calls), then one ``function_call`` item per tool call read out of the text (the same
parser as chat, :mod:`.toolcalls`). A stream's events carry the items' ids, and its
``response.completed`` holds exactly the object a non-streamed request gets. A generation cut
by ``max_output_tokens`` ends with status ``incomplete`` (``response.incomplete``).
Event shapes: the Responses API reference, "Streaming events".
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, AsyncIterator, Callable

from .responses_api import ResponsesRequest
from .toolcalls import parse_message
from .jobs import Job


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage(result: Any) -> dict:
    """The Responses usage of a generation: no reasoning tokens; cached_tokens, the prompt's tokens
    reused from the slot's cache (not read again), as Chat Completions reports them."""
    prompt, completion = result.stats.prompt_tokens, result.stats.completion_tokens
    cached = result.stats.prompt_cached or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def _message(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _call(item_id: str, call_id: str, names: dict, arguments: str, status: str) -> dict:
    """A function_call item; names: its ``name`` (and ``namespace``, for a namespace's member:
    :meth:`.responses_tools.ToolSet.call_fields`)."""
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, **names,
            "arguments": arguments}


class ResponseBuilder:
    """One response: its id, the object's fields, and the conversation it leaves (for
    ``previous_response_id``)."""

    def __init__(self, rr: ResponsesRequest, model_name: str, speculation: Callable[[Any], dict]) -> None:
        self.rr = rr
        self.id = _id("resp")
        self.created = int(time.time())
        self.model_name = model_name
        self.speculation = speculation

    def object(self, status: str, output: list[dict], result: Any = None, error: dict | None = None) -> dict:
        """The response object in ``status`` (in_progress, completed, incomplete, failed)."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "background": False, "error": error, "incomplete_details": incomplete, "model": self.model_name,
               "output": output, "truncation": "disabled", "reasoning": {"effort": None, "summary": None},
               "usage": usage(result) if result is not None else None, **self.rr.echo}
        if result is not None:
            out["speculation"] = self.speculation(result)
        return out

    @staticmethod
    def status_of(result: Any) -> str:
        return "incomplete" if result.finish_reason == "length" else "completed"

    def history(self, output: list[dict]) -> list[dict]:
        """The conversation after this response: its input, then its output as one assistant message."""
        text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
        names = self.rr.tools.prompt_name
        calls = [{"id": it["call_id"], "type": "function",
                  "function": {"name": names(it["name"], it.get("namespace")), "arguments": it["arguments"]}}
                 for it in output if it["type"] == "function_call"]
        message: dict = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return self.rr.history + [message]

    def full(self, result: Any) -> dict:
        """The whole response of a finished generation."""
        tools = self.rr.req.tools
        content, calls = (result.text, []) if tools is None else parse_message(result.text, tools.parser())
        output = [_message(_id("msg"), content or "", "completed")] if content or not calls else []
        output += [_call(_id("fc"), c["id"], self.rr.tools.call_fields(c["function"]["name"]),
                         c["function"]["arguments"], "completed") for c in calls]
        return self.object(self.status_of(result), output, result)


class _Events:
    """The events of one stream, numbered (``sequence_number``), as server-sent events
    named by their type; the output items as they open and close."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.text = ""  # the open message's text

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def part(self, part: tuple) -> list[str]:
        """The events of a tool-call parser's part ("content", text) / ("call", i, call_id,
        name) / ("args", i, piece)."""
        out: list[str] = []
        if part[0] == "content":
            if not part[1]:
                return out
            if self.open is None or self.open["type"] != "message":
                out += self.close() + self.open_message()
            self.text += part[1]
            out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output),
                                  content_index=0, delta=part[1], logprobs=[]))
        elif part[0] == "call":
            names = self.builder.rr.tools.call_fields(part[3])
            out += self.close() + self._add(_call(_id("fc"), part[2], names, "", "in_progress"))
        else:
            self.open["arguments"] += part[2]
            out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=len(self.output), delta=part[2]))
        return out

    def open_message(self) -> list[str]:
        """The events that open a message item and its output_text part."""
        out = self._add(_message(_id("msg"), "", "in_progress"))
        out.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=len(self.output),
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _add(self, item: dict) -> list[str]:
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.output), item=dict(item))]

    def close(self) -> list[str]:
        """The events that close the open item, if any."""
        item, index, out = self.open, len(self.output), []
        if item is None:
            return out
        if item["type"] == "message":
            done = _message(item["id"], self.text, "completed")
            part = done["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=self.text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        else:
            done = {**item, "status": "completed"}
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        self.open, self.text = None, ""
        return out


async def stream_events(builder: ResponseBuilder, job: Job, first: tuple[str, Any] | None,
                        on_done: Callable[[dict], None]) -> AsyncIterator[str]:
    """The stream of one response: created, in_progress, the items' events as the text comes
    (a message's text deltas, a call's argument deltas), then completed (or incomplete, or,
    after an error, an ``error`` event and failed); on_done(response object) when it completes.
    created and in_progress go out at once, before the prompt is read (first None: the
    job's first event is awaited after them)."""
    events = _Events(builder)
    start = builder.object("in_progress", [])
    yield events.event("response.created", response=start)
    yield events.event("response.in_progress", response=start)
    tools = builder.rr.req.tools
    parser = tools.parser() if tools is not None else None
    event = first if first is not None else await job.events.get()
    while True:
        kind, value = event
        if kind == "error":
            error = {"code": value.code or value.type, "message": value.message}
            yield events.event("error", code=error["code"], message=value.message, param=value.param)
            yield events.event("response.failed", response=builder.object("failed", events.output, error=error))
            return
        if kind == "delta":
            for part in parser.feed(value[1]) if parser is not None else [("content", value[1])]:
                for e in events.part(part):
                    yield e
        else:
            result = value[1]
            for part in parser.close() if parser is not None else []:
                for e in events.part(part):
                    yield e
            if not events.output and events.open is None:  # an empty text: an empty message, as in full()
                for e in events.open_message():
                    yield e
            for e in events.close():
                yield e
            status = builder.status_of(result)
            response = builder.object(status, events.output, result)
            on_done(response)
            yield events.event(f"response.{status}", response=response)
            return
        event = await job.events.get()
