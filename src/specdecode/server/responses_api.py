"""OpenAI's Responses API (``POST /v1/responses``) as a translation onto the chat request:
a Responses body becomes a chat body, parsed by :func:`.protocol.parse_request` like any
other, and errors found anywhere on the way name the Responses fields (``input[3].call_id``,
``max_output_tokens``, ``text.format``), not the chat ones. The answer's shapes (the response
object and its stream of events) are :mod:`.responses_events`'.

Fields (the Responses API reference, https://platform.openai.com/docs/api-reference/responses):
``model``, ``input`` (a string, or items: messages of role user, assistant, system or
developer, with ``input_text``/``output_text`` parts; ``function_call``;
``function_call_output``), ``instructions`` (a system message first; not carried on by
``previous_response_id``, as OpenAI does), ``max_output_tokens``, ``temperature``, ``top_p``,
``tools`` (type ``function`` only: a hosted tool is a 400 naming its type), ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``, ``json_schema`` through
the same grammars as ``response_format``), ``stream``, ``store`` and ``previous_response_id``
(:class:`.responses_store.ResponseStore`, bounded, in memory), ``metadata``, ``user``, ``safety_identifier``,
``prompt_cache_key`` (prefix reuse is automatic here), ``client_metadata`` (an object of
strings, read and dropped); this server's ``speculative``, ``seed`` and the request fields of
drafter kinds (``prediction``). ``tools`` and ``tool_choice`` are :mod:`.responses_tools`'
(function and namespace tools; hosted ones left out of the prompt and listed in the response's
``tools_left_out``). ``reasoning`` (any ``effort`` and ``summary``) is accepted and does
nothing: the model reasons in its output or not at all, so no reasoning items are returned and
``usage.output_tokens_details.reasoning_tokens`` is 0. ``include`` takes the values that ask
for parts of items this server never produces (:data:`INCLUDE_NOTHING`). Fields that would ask
for what is not served (``background: true``, ``include`` of ``message.output_text.logprobs``,
``truncation: "auto"``, ``conversation``) are 400s naming them.

Pure: no FastAPI, no model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..drafters.kinds import request_fields
from ..errors import SpecDecodeError
from ..messages import check_messages, json_repr
from .apierror import APIError
from .protocol import GenRequest, parse_request
from .responses_store import ResponseStore
from .responses_tools import ToolSet, tool_choice, tool_set
from .toolcalls import ToolCallFormat

__all__ = ["ResponseStore", "ResponsesRequest", "parse_responses", "rename_error", "input_messages"]

_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "stream", "store", "previous_response_id", "metadata", "user",
    "safety_identifier", "prompt_cache_key", "speculative", "seed", "reasoning", "include", "client_metadata",
})
# Standard fields accepted at the values that ask for nothing beyond what is served.
_HARMLESS = {"background": (False,), "truncation": ("disabled",),
             "service_tier": ("auto", "default"), "stream_options": ({}, {"include_obfuscation": False}),
             "top_logprobs": (0,), "max_tool_calls": ()}
# include values that ask for parts of items this server never makes (reasoning, web search,
# file search, code interpreter and computer items; input images are refused): with no such
# item there is nothing to add, as on OpenAI when the model made none. Not here:
# message.output_text.logprobs, which would ask for logprobs the output_text parts lack.
INCLUDE_NOTHING = frozenset({
    "reasoning.encrypted_content", "web_search_call.action.sources", "web_search_call.results",
    "file_search_call.results", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "message.input_image.image_url",
})
# reasoning's fields and their values (the Responses API reference, "reasoning").
_REASONING = {"effort": ("none", "minimal", "low", "medium", "high", "xhigh"),
              "summary": ("auto", "concise", "detailed", "none"),
              "generate_summary": ("auto", "concise", "detailed", "none")}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# Chat-field names in errors -> the Responses fields they came from.
_RENAMES = ((re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format(?:\.json_schema)?\b"), "text.format"),
            (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"))
# A chat tool call's fields -> a function_call item's.
_CALL_FIELDS = {".id": ".call_id", ".function.name": ".name", ".function.arguments": ".arguments", ".function": "",
                ".type": ".type"}


@dataclass
class ResponsesRequest:
    """A validated Responses request: the chat request it runs as, and what the response
    object echoes. history: the conversation (without instructions) that a later request's
    ``previous_response_id`` continues, this request's input included."""

    req: GenRequest
    echo: dict
    history: list[dict]
    store: bool
    tools: ToolSet


def _error(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def rename_error(e: APIError, origin: list[str] | None = None, calls: list[list[str]] | None = None,
                 tools: list[str] | None = None) -> APIError:
    """The error with the chat fields it names (param and message) renamed to the Responses
    fields they came from; origin[i]: the input item of chat message i (None: not from input);
    calls[i][j]: the function_call item of message i's tool call j; tools[j]: the tool
    (``tools[4].tools[1]``) chat tool j came from."""
    def call(m: re.Match) -> str:
        i, j = int(m.group(1)), int(m.group(2))
        if calls is None or i >= len(calls) or j >= len(calls[i]):
            return m.group(0)
        return calls[i][j] + _CALL_FIELDS.get(m.group(3) or "", m.group(3) or "")

    def message(m: re.Match) -> str:
        i = int(m.group(1))
        return origin[i] if origin is not None and i < len(origin) else "input"

    def rename(text: str | None) -> str | None:
        if text is None:
            return None
        if tools is not None:
            text = re.sub(r"\btools\[(\d+)\](?:\.function\b)?",
                          lambda m: tools[int(m.group(1))] if int(m.group(1)) < len(tools) else m.group(0), text)
        for pattern, to in _RENAMES:
            text = pattern.sub(to, text)
        text = re.sub(r"\bmessages\[(\d+)\]\.tool_calls\[(\d+)\]((?:\.function)?\.\w+)?", call, text)
        text = re.sub(r"\bmessages\[(\d+)\]\.tool_call_id\b", lambda m: message(m) + ".call_id", text)
        text = re.sub(r"\bmessages\[(\d+)\]", message, text)
        # The field, not the word: "tool messages" in a sentence stays as it is.
        return re.sub(r"(?<!tool )\bmessages\b", "input", text)

    return APIError(e.status, rename(e.message), type=e.type, param=rename(e.param), code=e.code)


def _text(content: Any, where: str) -> str:
    """An item's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _error(f"{where}.content must be a string or a list of text parts, got {json_repr(content)}",
                     f"{where}.content")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _error(f"{where}.content[{j}]: type {json_repr(kind)} is not supported: this server reads text "
                         f"parts only ({', '.join(_TEXT_PARTS)} with a string text)", f"{where}.content[{j}].type")
        out.append(part["text"])
    return "".join(out)


def input_messages(value: Any, tools: ToolSet | None = None) -> tuple[list[dict], list[str], list[list[str]]]:
    """``input`` as chat messages, for each the input item it came from ("input[2]"), and for
    each its tool calls' function_call items. Consecutive function_call items join one
    assistant message (after the assistant text right before them, if any); a function_call
    with a ``namespace`` calls the name the model was shown for it (tools). Raises APIError
    (400) naming the item and field."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], ["input"], [[]]
    if not isinstance(value, list) or not value:
        raise _error(f"input must be a string or a non-empty list of items, got {json_repr(value)}", "input")
    messages: list[dict] = []
    origin: list[str] = []
    calls: list[list[str]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _error(f"{where} must be an object, got {json_repr(item)}", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise _error(f"{where}.role = {json_repr(item.get('role'))} is not supported: expected one of "
                             f"{', '.join(_ROLES)}", f"{where}.role")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
            origin.append(where)
            calls.append([])
        elif kind == "function_call":
            call = _function_call(item, where, tools or ToolSet())
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origin.append(where)
                calls.append([])
            calls[-1].append(where)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _error(f"{where}.call_id must be a non-empty string, got {json_repr(call_id)}",
                             f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), where)})
            origin.append(where)
            calls.append([])
        else:
            raise _error(f"{where}.type = {json_repr(kind)} is not supported: this server reads message, "
                         "function_call and function_call_output items", f"{where}.type")
    return messages, origin, calls


def _function_call(item: dict, where: str, tools: ToolSet) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise _error(f"{where}.{key} must be a{' non-empty' if key != 'arguments' else ''} string, got "
                         f"{json_repr(item.get(key))}", f"{where}.{key}")
    namespace = item.get("namespace")
    if namespace is not None and not (isinstance(namespace, str) and namespace):
        raise _error(f"{where}.namespace must be a non-empty string, got {json_repr(namespace)}", f"{where}.namespace")
    name = tools.prompt_name(item["name"], namespace)
    return {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": item["arguments"]}}


def _check_no_calls(items: Any, model_name: str) -> None:
    """A 400 naming the first function_call or function_call_output item, for a model whose
    chat template shows no tool use (the chat check would name chat fields)."""
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if item.get("type") in ("function_call", "function_call_output"):
            raise _error(f"input[{i}].type = {json_repr(item['type'])}: the model {json_repr(model_name)} has no known "
                         "tool-call format in its chat template, so its conversations cannot carry function calls or "
                         "their outputs", f"input[{i}].type")


def _check_fields(body: dict) -> None:
    allowed = _FIELDS | set(request_fields())
    for name, value in body.items():
        if name in allowed or value is None:
            continue
        if name in _HARMLESS and any(type(value) is type(ok) and value == ok for ok in _HARMLESS[name]):
            continue
        ok = " or ".join(json_repr(v) for v in _HARMLESS.get(name, ()))
        raise _error(f"{name} = {json_repr(value)} is not supported by this server" + (f" (only {ok} is)" if ok else "")
                     + ". It honours: " + ", ".join(sorted(allowed)), name)


def _check_accepted(body: dict) -> None:
    """reasoning, include and client_metadata: accepted at the values that change nothing in
    what this server answers (the module docstring); a 400 naming the field otherwise."""
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _error(f"reasoning must be an object, got {json_repr(reasoning)}", "reasoning")
        for key, value in reasoning.items():
            if key not in _REASONING:
                raise _error(f"reasoning.{key} is not a reasoning field: expected {', '.join(_REASONING)}",
                             f"reasoning.{key}")
            if value is not None and value not in _REASONING[key]:
                raise _error(f"reasoning.{key} = {json_repr(value)} is not one of "
                             f"{', '.join(json_repr(v) for v in _REASONING[key])}", f"reasoning.{key}")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise _error(f"include must be a list of strings, got {json_repr(include)}", "include")
        for i, value in enumerate(include):
            if value not in INCLUDE_NOTHING:
                raise _error(f"include[{i}] = {json_repr(value)} is not supported: this server adds nothing to its "
                             "items (its output_text parts carry no logprobs); it accepts "
                             + ", ".join(sorted(INCLUDE_NOTHING)) + ", which ask for items it never makes",
                             f"include[{i}]")
    meta = body.get("client_metadata")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _error(f"client_metadata must be an object of strings, got {json_repr(meta)}", "client_metadata")


def _response_format(text: Any) -> Any:
    """``text`` ({"format": {...}, "verbosity": ...}) as a chat response_format."""
    if text is None:
        return None
    if not isinstance(text, dict) or not set(text) <= {"format", "verbosity"}:
        raise _error(f'text must be an object with format, got {json_repr(text)}', "text")
    fmt = text.get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    if fmt.get("schema") is None:  # required here, as OpenAI's (chat's response_format may leave it out)
        raise _error(f"text.format.schema is required for a json_schema format: the JSON schema (an object) the "
                     f"output follows; got {json_repr(fmt)}", "text.format.schema")
    spec = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


def parse_responses(body: Any, model_name: str, n_ctx: int, tool_format: ToolCallFormat | None,
                    store: ResponseStore, strict: bool = False) -> ResponsesRequest:
    """Validate a Responses body and translate it into the chat request it runs as
    (strict: the server's default for ``speculative.strict``).

    Raises APIError: 404 for another model, 400 naming the Responses field at fault (an
    unknown ``previous_response_id`` included).
    """
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {json_repr(body)}")
    _check_fields(body)
    _check_accepted(body)
    if body.get("input") is None:
        raise _error("input is required", "input")
    history: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        found = store.history(previous) if isinstance(previous, str) else None
        if found is None:
            raise _error(f"previous_response_id = {json_repr(previous)} is not a stored response: this server keeps "
                         f"the last {store.max_responses} responses made with store true (at most "
                         f"{store.max_bytes // 2**20} MiB of their JSON), in memory, until it stops",
                         "previous_response_id")
        history = found
    tools = tool_set(body.get("tools"))
    messages, origin, calls = input_messages(body["input"], tools)
    if tool_format is None:
        _check_no_calls(body["input"], model_name)
    conversation = history + messages
    origin = ["history"] * len(history) + origin
    calls = [["history"] * len(m.get("tool_calls") or ()) for m in history] + calls
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _error(f"instructions must be a string, got {json_repr(instructions)}", "instructions")
    full = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    origin, calls = (["instructions"] if instructions else []) + origin, ([[]] if instructions else []) + calls
    try:
        check_messages(full)
    except SpecDecodeError as e:
        raise rename_error(APIError(400, str(e), param=e.param), origin, calls) from None
    for name in ("store", "stream", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise _error(f"{name} must be a boolean, got {json_repr(body[name])}", name)
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _error(f"{name} must be a string, got {json_repr(body[name])}", name)
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise _error("metadata must be an object of at most 16 string values (keys up to 64 characters, values up "
                     f"to 512), got {json_repr(metadata)}", "metadata")
    chat = {"model": body.get("model"), "messages": full, "max_completion_tokens": body.get("max_output_tokens"),
            "tools": tools.chat, "tool_choice": tool_choice(body.get("tool_choice"), tools),
            "response_format": _response_format(body.get("text")), "stream": body.get("stream"),
            "user": body.get("user")}
    for name in ("temperature", "top_p", "parallel_tool_calls", "speculative", "seed", *request_fields()):
        chat[name] = body.get(name)
    try:
        req = parse_request({k: v for k, v in chat.items() if v is not None}, "chat", model_name, n_ctx, tool_format,
                            strict)
    except APIError as e:
        raise rename_error(e, origin, calls, tools.origin) from None
    echo = {name: body.get(name) for name in ("instructions", "max_output_tokens", "previous_response_id",
                                              "user", "safety_identifier", "prompt_cache_key")}
    echo.update(metadata=metadata or {}, temperature=req.options.sampling.temperature,
                top_p=req.options.sampling.top_p, tool_choice=body.get("tool_choice") or "auto",
                tools=body.get("tools") or [], parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
                text=body.get("text") or {"format": {"type": "text"}}, store=body.get("store") is not False,
                tools_left_out=tools.left_out)
    return ResponsesRequest(req, echo, conversation, echo["store"], tools)
