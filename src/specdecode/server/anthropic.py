"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as a
translation onto the chat request, as Claude Code and the ``anthropic`` SDK send it: a
Messages body becomes a chat body, parsed by :func:`.protocol.parse_request` like any other,
and errors name the Messages fields. The answers are :mod:`.anthropic_events`'.

Fields (the Messages API reference, https://docs.anthropic.com/en/api/messages):
``model``, ``messages`` (roles user and assistant, and ``system`` entries, which Claude Code
sends: each kept where it is, and merged into the system prompt where the chat template
refuses a system message after the first, :func:`specdecode.backends.chat_prompt.render`),
``system`` (a string or text blocks), ``max_tokens`` (required; larger than the room the
prompt leaves, as Claude Code's 32000 is, it is served up to the context), ``stop_sequences``,
``temperature`` (0 to 1, default 1), ``top_p``, ``top_k``, ``stream``, ``metadata``, ``tools``
(``name``, ``description``, ``input_schema``; a server tool, one with another ``type``, is
left out of the prompt), ``tool_choice`` (``auto``, ``any``, ``tool`` with ``name``,
``none``; ``disable_parallel_tool_use``), ``output_config.format`` (a ``json_schema``, through
the same grammars as ``response_format``); this server's ``speculative``, ``seed`` and the
request fields of drafter kinds (``prediction``). Content blocks: ``text``, ``tool_use``,
``tool_result`` (string or text-block content; ``is_error`` marks the result an error),
``thinking`` and ``redacted_thinking`` (dropped: this model never wrote them); ``image`` and
``document`` are a 400. Accepted and ignored, as they change nothing for this model:
``thinking``, ``context_management``, ``output_config.effort``, ``cache_control`` (prefix
reuse is automatic), ``service_tier``, ``container``, ``mcp_servers`` and any other field a
beta adds. A system text block that is Claude Code's billing header
(``x-anthropic-billing-header: ...``, whose ``cch=`` hash changes every request) is dropped,
so that it does not cost the cached prefix.

Pure: no FastAPI, no model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ..drafters.kinds import request_fields
from ..messages import json_repr
from .apierror import APIError
from .protocol import GenRequest, parse_request
from .toolcalls import ToolCallFormat

# What each Messages field becomes (the rest of the known fields are read here or ignored).
_PASSED = ("temperature", "top_p", "top_k", "stream", "speculative", "seed")
# A system block starting so is Claude Code's per-request billing line: no instruction to the model.
BILLING_HEADER = "x-anthropic-billing-header"
_ROLES = ("user", "assistant", "system")
_DROPPED_BLOCKS = ("thinking", "redacted_thinking")
_REFUSED_BLOCKS = ("image", "document", "search_result", "container_upload")
# Chat-field names in errors -> the Messages fields they came from.
_RENAMES = ((re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_tokens"),
            (re.compile(r"\bresponse_format(?:\.json_schema)?\b"), "output_config.format"),
            (re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
            (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
            (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
            (re.compile(r"\bstop\b(?! )"), "stop_sequences"))


def _error(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class Origins:
    """Where each chat field came from in the Messages body, for errors: ``messages[i]`` the
    field of chat message i (``messages[2]``, ``messages[3].content[0]``, ``system``),
    ``calls[i][j]`` the tool_use block of message i's call j, ``tools[j]`` the index in
    ``tools`` of chat tool j (server tools are left out)."""

    messages: list[str] = field(default_factory=list)
    calls: list[list[str]] = field(default_factory=list)
    tools: list[int] = field(default_factory=list)

    def add(self, where: str, calls: list[str] | None = None) -> None:
        self.messages.append(where)
        self.calls.append(calls or [])


@dataclass
class MessagesRequest:
    """A validated Messages request: the chat request it runs as (None for count_tokens'
    parse, which runs nothing), the chat messages and tools it renders, and for errors where
    each chat field came from (:class:`Origins`)."""

    req: GenRequest | None
    messages: list[dict]
    tools: list[dict] | None
    origin: Origins
    stop_sequences: tuple[str, ...]
    left_out: list[str]


# A JSON string as json_repr quotes a client's value in a message: never renamed.
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
# A chat tool call's fields -> a tool_use block's.
_CALL_FIELDS = {".id": ".id", ".function.name": ".name", ".function.arguments": ".input", ".function": "", "": ""}


def rename_error(e: APIError, origin: Origins | None = None) -> APIError:
    """The error with the chat fields it names (outside the values it quotes) renamed to the
    Messages fields they came from (:class:`Origins`); origin None: e as it is (found before
    the translation, it names the Messages fields already)."""
    if origin is None:
        return e

    def message(m: re.Match) -> str:  # messages[i], .tool_calls[j](.field), .tool_call_id
        i = int(m.group(1))
        where = origin.messages[i] if i < len(origin.messages) else "messages"
        if m.group(2) is not None:
            j, rest = int(m.group(2)), m.group(3) or ""
            if i < len(origin.calls) and j < len(origin.calls[i]):
                return origin.calls[i][j] + _CALL_FIELDS.get(rest, rest)
            return where + m.group(0)[m.end(1) + 1 - m.start():]
        return where + (".tool_use_id" if m.group(4) else "")

    def tool(m: re.Match) -> str:
        j = int(m.group(1))
        return f"tools[{origin.tools[j] if j < len(origin.tools) else j}]"

    def outside_quotes(text: str) -> str:
        text = re.sub(r"\btools\[(\d+)\]", tool, text)
        for pattern, to in _RENAMES:
            text = pattern.sub(to, text)
        return re.sub(r"\bmessages\[(\d+)\](?:\.tool_calls\[(\d+)\]((?:\.function)?(?:\.\w+)?)|(\.tool_call_id\b))?",
                      message, text)

    def rename(text: str | None) -> str | None:
        if text is None:
            return None
        parts, pos = [], 0
        for m in _QUOTED.finditer(text):
            parts += [outside_quotes(text[pos:m.start()]), m.group(0)]
            pos = m.end()
        return "".join(parts + [outside_quotes(text[pos:])])

    return APIError(e.status, rename(e.message), type=e.type, param=rename(e.param), code=e.code)


def _blocks(content: Any, where: str) -> list[dict]:
    """A message's content as blocks (a string is one text block), each checked: a block's
    index in the list is its index in the body (thinking blocks stay, to be skipped)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _error(f"{where}.content must be a string or a list of content blocks, got {json_repr(content)}",
                     f"{where}.content")
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise _error(f"{at} must be a content block (an object with a type), got {json_repr(block)}", at)
        kind = block.get("type")
        if kind in _REFUSED_BLOCKS:
            raise _error(f"{at}.type = {json_repr(kind)} is not supported: this server serves a text model; send text, "
                         "tool_use and tool_result blocks", f"{at}.type")
        if kind not in ("text", "tool_use", "tool_result", *_DROPPED_BLOCKS):
            raise _error(f"{at}.type = {json_repr(kind)} is not a content block this server reads: text, tool_use, "
                         "tool_result (thinking blocks are dropped)", f"{at}.type")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise _error(f"{at}.text must be a string, got {json_repr(block.get('text'))}", f"{at}.text")
    return content


def _text(blocks: list[dict]) -> str:
    return "".join(b["text"] for b in blocks if b["type"] == "text")


def system_text(value: Any) -> str | None:
    """``system`` (a string or text blocks) as one text, Claude Code's billing-header block left
    out (:data:`BILLING_HEADER`); None when nothing is left."""
    if value is None:
        return None
    if isinstance(value, str):
        blocks = [{"type": "text", "text": value}]
    elif isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" and isinstance(
            b.get("text"), str) for b in value):
        blocks = value
    else:
        raise _error(f"system must be a string or a list of text blocks, got {json_repr(value)}", "system")
    texts = [b["text"] for b in blocks if not b["text"].lstrip().startswith(BILLING_HEADER)]
    return "\n\n".join(texts) if texts else None


def _tool_result(block: dict, where: str) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _error(f"{where}.tool_use_id must be a non-empty string, got {json_repr(call_id)}", f"{where}.tool_use_id")
    content = block.get("content", "")
    if not isinstance(content, str):
        blocks = _blocks(content, where)
        for j, b in enumerate(blocks):
            if b["type"] != "text":
                raise _error(f"{where}.content[{j}].type = {json_repr(b['type'])}: a tool result's content holds text "
                             "blocks only", f"{where}.content[{j}].type")
        content = _text(blocks)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _error(f"{where}.is_error must be a boolean, got {json_repr(is_error)}", f"{where}.is_error")
    return {"role": "tool", "tool_call_id": call_id, "content": "Error: " + content if is_error else content}


def _tool_use(block: dict, where: str) -> dict:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise _error(f"{where}.{key} must be a non-empty string, got {json_repr(block.get(key))}", f"{where}.{key}")
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise _error(f"{where}.input must be an object, got {json_repr(args)}", f"{where}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def chat_messages(system: str | None, value: Any) -> tuple[list[dict], Origins]:
    """``system`` and ``messages`` as chat messages, and where each came from (:class:`Origins`).
    A user message's tool_result blocks become tool messages (before its text, as the API
    requires them first); an assistant message's tool_use blocks its tool_calls; thinking
    blocks are dropped. Raises APIError (400) naming the message and block."""
    if not isinstance(value, list) or not value:
        raise _error(f"messages must be a non-empty list of messages, got {json_repr(value)}", "messages")
    out: list[dict] = [{"role": "system", "content": system}] if system else []
    origin = Origins()
    if system:
        origin.add("system")
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _error(f"{where} must be a message (an object with role and content), got {json_repr(msg)}", where)
        role = msg.get("role")
        if role not in _ROLES:
            raise _error(f"{where}.role = {json_repr(role)} is not supported: expected user or assistant",
                         f"{where}.role")
        blocks = _blocks(msg.get("content"), where)
        if role == "system":
            out.append({"role": "system", "content": _text(blocks)})
            origin.add(where)
            continue
        allowed = ("text", "tool_use", *_DROPPED_BLOCKS) if role == "assistant" else ("text", "tool_result")
        for j, b in enumerate(blocks):
            if b["type"] not in allowed:
                raise _error(f"{where}.content[{j}].type = {json_repr(b['type'])} cannot be in a {role} message",
                             f"{where}.content[{j}].type")
            if b["type"] == "tool_result":
                out.append(_tool_result(b, f"{where}.content[{j}]"))
                origin.add(f"{where}.content[{j}]")
        text = _text(blocks)
        uses = [(f"{where}.content[{j}]", b) for j, b in enumerate(blocks) if b["type"] == "tool_use"]
        calls = [_tool_use(b, at) for at, b in uses]
        if role == "assistant":
            message: dict = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                message["tool_calls"] = calls
        elif text or not any(b["type"] == "tool_result" for b in blocks):
            message = {"role": "user", "content": text}
        else:
            continue
        out.append(message)
        origin.add(where, [at for at, _ in uses])
    return out, origin


def _tools(value: Any, origin: Origins) -> tuple[list[dict] | None, list[str]]:
    """``tools`` as chat tools (each one's index in ``tools`` added to origin.tools), and the
    names of the server tools left out."""
    if value is None:
        return None, []
    if not isinstance(value, list):
        raise _error(f"tools must be a list of tools, got {json_repr(value)}", "tools")
    out, left_out = [], []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise _error(f"tools[{i}] must be an object, got {json_repr(tool)}", f"tools[{i}]")
        kind = tool.get("type")
        if kind is not None and not isinstance(kind, str):
            raise _error(f"tools[{i}].type must be a string (\"custom\", or a server tool's type), got "
                         f"{json_repr(kind)}", f"tools[{i}].type")
        if kind not in (None, "custom"):
            left_out.append(str(tool.get("name") or kind))
            continue
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _error(f"tools[{i}].input_schema is required: the JSON schema (an object) of the tool's input, got "
                         f"{json_repr(schema)}", f"tools[{i}].input_schema")
        if schema.get("type", "object") != "object":
            raise _error(f"tools[{i}].input_schema.type = {json_repr(schema['type'])}: a tool's input is an object "
                         "(type \"object\")", f"tools[{i}].input_schema.type")
        origin.tools.append(i)
        fn = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out or None, left_out


def _tool_choice(value: Any, tools: list[dict] | None) -> tuple[Any, bool | None]:
    """tool_choice as chat's, and parallel_tool_calls (False where parallel use is disabled)."""
    if value is None:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _error(f"tool_choice = {json_repr(value)} is not supported: expected {{\"type\": \"auto\"}}, "
                     '{"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}', "tool_choice")
    parallel = value.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise _error(f"tool_choice.disable_parallel_tool_use must be a boolean, got {json_repr(parallel)}",
                     "tool_choice.disable_parallel_tool_use")
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise _error(f"tool_choice.name is required with type \"tool\": the tool to call, got "
                         f"{json_repr(value.get('name'))}", "tool_choice.name")
        choice: Any = {"type": "function", "function": {"name": value["name"]}}
    else:
        choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if not tools:
        choice = None  # the Messages API allows a choice without tools; chat would refuse it
    return choice, (False if parallel else None)


def _response_format(config: Any) -> Any:
    """output_config.format (a json_schema) as a chat response_format; effort is ignored."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise _error(f"output_config must be an object, got {json_repr(config)}", "output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _error(f"output_config.format = {json_repr(fmt)} is not supported: expected {{\"type\": "
                     '"json_schema", "schema": {...}}', "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def parse_messages(body: Any, model_name: str, n_ctx: int, tool_format: ToolCallFormat | None,
                   strict: bool = False, count_only: bool = False) -> MessagesRequest:
    """Validate a Messages body (module docstring) and translate it into the chat request it
    runs as. count_only: count_tokens' body (no max_tokens, nothing run: ``req`` None).

    Raises APIError: 404 for another model, 400 naming the Messages field at fault.
    """
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {json_repr(body)}")
    model = body.get("model")
    if model is None:
        raise _error(f"model is required: this server serves {json_repr(model_name)}", "model")
    if not isinstance(model, str):
        raise _error(f"model must be a string (this server serves {json_repr(model_name)}), got {json_repr(model)}",
                     "model")
    if model != model_name:
        raise APIError(404, f"the model {json_repr(model)} does not exist: this server serves {json_repr(model_name)} "
                       "(serve --served-model-name maps other names to it)", type="not_found_error", param="model",
                       code="model_not_found")
    messages, origin = chat_messages(system_text(body.get("system")), body.get("messages"))
    tools, left_out = _tools(body.get("tools"), origin)
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise _error(f"stop_sequences must be a list of strings, got {json_repr(stops)}", "stop_sequences")
    stops = tuple(s for s in stops or () if s)
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and isinstance(metadata.get("user_id", ""), str)):
        raise _error(f"metadata must be an object whose user_id is a string, got {json_repr(metadata)}", "metadata")
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise _error(f"temperature must be a number, got {json_repr(temperature)}", "temperature")
    if temperature is not None and not 0 <= temperature <= 1:
        raise _error(f"temperature = {json_repr(temperature)} is out of range: expected 0 <= temperature <= 1",
                     "temperature")
    max_tokens = None if count_only else body.get("max_tokens")  # (count_tokens takes none: ignored)
    if not count_only and max_tokens is None:
        raise _error("max_tokens is required: the most tokens to generate, an integer >= 1", "max_tokens")
    if not count_only and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise _error(f"max_tokens must be an integer >= 1, got {json_repr(max_tokens)}", "max_tokens")
    chat: dict[str, Any] = {"model": model_name, "messages": messages, "tools": tools, "tool_choice": choice,
                            "parallel_tool_calls": parallel, "stop": list(stops) or None,
                            "response_format": _response_format(body.get("output_config")),
                            # a bound: served up to the room the prompt leaves (GenRequest.fit_context)
                            "max_tokens": min(max_tokens, n_ctx) if isinstance(max_tokens, int) else None}
    for name in (*_PASSED, *request_fields()):
        chat[name] = body.get(name)
    if chat["temperature"] is None:
        chat["temperature"] = 1.0  # Anthropic's default
    try:
        req = parse_request({k: v for k, v in chat.items() if v is not None}, "chat", model_name, n_ctx, tool_format,
                            strict)
    except APIError as e:
        raise rename_error(e, origin) from None
    return MessagesRequest(None if count_only else replace(req, fit_context=True), messages, tools, origin, stops,
                           left_out)
