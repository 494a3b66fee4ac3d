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
from typing import Any, Callable

from ..messages import json_repr
from .apierror import APIError
from .jobs import ChoiceDone, Delta
from .responses_api import ResponsesRequest, parse_responses, rename_error
from .runner import Dialect, StreamWriter
from .toolcalls import parse_message


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


class ResponsesStream(StreamWriter):
    """The stream of one response: created, in_progress, the items' events as the text comes
    (a message's text deltas, a call's argument deltas), then completed (or incomplete, or,
    after an error, an ``error`` event and failed); on_done(response object) when it completes.
    created and in_progress go out at once, before the prompt is read."""

    def __init__(self, builder: ResponseBuilder, on_done: Callable[[dict], None]) -> None:
        self.builder = builder
        self.on_done = on_done
        self.events = _Events(builder)
        tools = builder.rr.req.tools
        self.parser = tools.parser() if tools is not None else None

    def open(self) -> list[str]:
        start = self.builder.object("in_progress", [])
        return [self.events.event("response.created", response=start),
                self.events.event("response.in_progress", response=start)]

    def delta(self, event: Delta) -> list[str]:
        parts = self.parser.feed(event.text) if self.parser is not None else [("content", event.text)]
        return [e for part in parts for e in self.events.part(part)]

    def choice(self, event: ChoiceDone, last: bool) -> list[str]:
        events, result = self.events, event.result
        out = [e for part in (self.parser.close() if self.parser is not None else []) for e in events.part(part)]
        if not events.output and events.open is None:  # an empty text: an empty message, as in full()
            out += events.open_message()
        out += events.close()
        status = self.builder.status_of(result)
        response = self.builder.object(status, events.output, result)
        self.on_done(response)
        return out + [events.event(f"response.{status}", response=response)]

    def failed(self, error: APIError) -> list[str]:
        body = {"code": error.code or error.type, "message": error.message}
        return [self.events.event("error", code=body["code"], message=error.message, param=error.param),
                self.events.event("response.failed", response=self.builder.object("failed", self.events.output,
                                                                                  error=body))]


class ResponsesDialect(Dialect):
    """``POST /v1/responses`` (:mod:`.responses_api`): the request translated to chat, run
    like one, answered as a response object or its stream of events; stored (for
    ``previous_response_id`` and ``GET /v1/responses/{id}``) unless ``store`` is false."""

    path = "/v1/responses"

    def routes(self, server: Any) -> list:
        async def stored(request: Any) -> Any:
            return await stored_response(server, request)

        return [("/v1/responses/{response_id}", stored, ["GET", "DELETE"])]

    def parse(self, body: Any, server: Any) -> ResponsesRequest:
        w = server.worker
        return parse_responses(body, server.model_name, w.n_ctx, w.tool_format, server.store, server.options.strict)

    def rename(self, error: APIError, parsed: Any) -> APIError:
        return rename_error(error)

    @staticmethod
    def _keep(rr: ResponsesRequest, builder: ResponseBuilder, server: Any) -> Callable[[dict], None]:
        def keep(response: dict) -> None:
            # One response larger than the whole store is not kept: it says so (store false).
            if rr.store and not server.store.put(response, builder.history(response["output"])):
                response["store"] = False

        return keep

    def whole(self, parsed: ResponsesRequest, choices: list[ChoiceDone], job: Any, server: Any) -> dict:
        builder = ResponseBuilder(parsed, server.model_name, server.speculation)
        response = builder.full(choices[-1].result)
        self._keep(parsed, builder, server)(response)
        return response

    def writer(self, parsed: ResponsesRequest, job: Any, server: Any) -> ResponsesStream:
        builder = ResponseBuilder(parsed, server.model_name, server.speculation)
        return ResponsesStream(builder, self._keep(parsed, builder, server))


async def stored_response(server: Any, request: Any) -> Any:
    """``GET`` (the object) or ``DELETE`` a stored response; 404 naming the id when it is not stored."""
    from fastapi.responses import JSONResponse, Response

    store = server.store
    response_id = request.path_params["response_id"]
    found = store.response_json(response_id)
    if found is None or (request.method == "DELETE" and not store.delete(response_id)):
        raise APIError(404, f"no stored response has the id {json_repr(response_id)}: this server keeps the last "
                       f"{store.max_responses} responses made with store true (at most "
                       f"{store.max_bytes // 2**20} MiB of their JSON), in memory",
                       type="not_found_error", param="response_id", code="response_not_found")
    if request.method == "DELETE":
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
    return Response(found, media_type="application/json")


DIALECT = ResponsesDialect()
