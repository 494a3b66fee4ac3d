"""Chat messages as OpenAI clients send them: checked once, for the CLI, the API and the server.

A conversation is a non-empty list of ``{"role": ..., "content": ...}`` objects; role is
one of CHAT_ROLES, content a string or a list of ``{"type": "text", "text": ...}`` parts
(joined). Tool use adds two shapes: an assistant message may carry ``tool_calls``
(``[{"id", "type": "function", "function": {"name", "arguments": a JSON string}}]``, its
content then null, absent or text), and a ``tool`` message answers one of them
(``tool_call_id`` and content). :func:`template_messages` gives them in the form chat
templates read (each call's arguments decoded); the model's own chat template renders them.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import SpecDecodeError
from .limits import check_text

CHAT_ROLES = ("system", "user", "assistant", "tool")
# The fields each role may carry besides role and content.
_ROLE_FIELDS = {"system": (), "user": (), "assistant": ("tool_calls",), "tool": ("tool_call_id",)}


def json_repr(value: Any, limit: int = 60) -> str:
    """A short JSON rendering of a value for error messages (at most ``limit`` characters)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_messages(value: Any, name: str = "messages") -> list[dict]:
    """The conversation as a list of {"role", "content": str} dicts (an assistant message
    with tool_calls: content str or None, and its "tool_calls"; a tool message: its
    "tool_call_id").

    Raises SpecDecodeError whose ``param`` names the offending element (e.g.
    "messages[2].role", "messages[1].tool_calls[0].function.arguments") and whose message
    shows its value.
    """
    if not isinstance(value, list) or not value:
        raise SpecDecodeError(f"{name} must be a non-empty list of messages, got {json_repr(value)}", param=name)
    out = [_check_message(msg, f"{name}[{i}]") for i, msg in enumerate(value)]
    calls: set[str] = set()  # the ids of the tool calls made so far
    for i, m in enumerate(out):
        for j, call in enumerate(m.get("tool_calls") or ()):
            if call["id"] in calls:
                raise SpecDecodeError(f"{name}[{i}].tool_calls[{j}].id = {json_repr(call['id'])} repeats an earlier "
                                      "call's id", param=f"{name}[{i}].tool_calls[{j}].id")
            calls.add(call["id"])
        if m["role"] == "tool" and m["tool_call_id"] not in calls:
            raise SpecDecodeError(f"{name}[{i}].tool_call_id = {json_repr(m['tool_call_id'])} answers no earlier "
                                  f"tool call (made so far: {json_repr(sorted(calls))})", param=f"{name}[{i}].tool_call_id")
    return out


def _check_message(msg: Any, where: str) -> dict:
    if not isinstance(msg, dict):
        raise SpecDecodeError(f"{where} must be an object, got {json_repr(msg)}", param=where)
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise SpecDecodeError(f"{where}.role = {json_repr(role)} is not supported: expected one of "
                              f"{', '.join(CHAT_ROLES)}", param=f"{where}.role")
    allowed = ("role", "content", *_ROLE_FIELDS[role])
    extra = sorted(k for k, v in msg.items() if k not in allowed and v is not None)
    if extra:
        raise SpecDecodeError(f"{where}: unsupported field(s) {', '.join(extra)}; a message of role {role} may carry "
                              f"{', '.join(allowed)}", param=f"{where}.{extra[0]}")
    out: dict = {"role": role}
    if role == "assistant" and msg.get("tool_calls") is not None:
        out["tool_calls"] = _check_tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        out["content"] = None if msg.get("content") is None else _content(msg["content"], where)
        return out
    out["content"] = _content(msg.get("content"), where)
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise SpecDecodeError(f"{where}.tool_call_id must be the id of the tool call this message answers (a "
                                  f"non-empty string), got {json_repr(call_id)}", param=f"{where}.tool_call_id")
        out["tool_call_id"] = check_text(call_id, f"{where}.tool_call_id")
    return out


def text_parts(value: Any, where: str, exact: bool = False) -> str:
    """A text, or OpenAI's list of text parts (``[{"type": "text", "text": ...}]``) joined, as
    one string: the one reader of that shape (message contents, a prediction's content, the
    Python API's request-fed inputs). exact: a part holds no other keys. Raises
    SpecDecodeError naming ``where[j]`` for a part of another shape, ``where`` for another type."""
    if isinstance(value, list):
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                    and (not exact or set(part) == {"type", "text"})):
                raise SpecDecodeError(f"{where}[{j}] = {json_repr(part)} is not supported: only "
                                      '{"type": "text", "text": ...} parts are', param=f"{where}[{j}]")
        value = "".join(p["text"] for p in value)
    if not isinstance(value, str):
        raise SpecDecodeError(f"{where} must be a string or a list of text parts, got {json_repr(value)}", param=where)
    return value


def _content(content: Any, where: str) -> str:
    """A message's content as one string (text parts joined)."""
    return check_text(text_parts(content, f"{where}.content"), f"{where}.content")


def _check_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's tool_calls as [{"id", "type": "function", "function": {"name",
    "arguments": str}}]."""
    if not isinstance(calls, list) or not calls:
        raise SpecDecodeError(f"{where} must be a non-empty list of tool calls, got {json_repr(calls)}", param=where)
    out = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function" or \
                not set(k for k, v in call.items() if v is not None) <= {"id", "type", "function"}:
            raise SpecDecodeError(f'{at} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                                  f'"arguments": ...}}}}, got {json_repr(call)}', param=at)
        fn = call.get("function")
        if not isinstance(fn, dict) or not set(k for k, v in fn.items() if v is not None) <= {"name", "arguments"}:
            raise SpecDecodeError(f'{at}.function must be {{"name": ..., "arguments": ...}}, got {json_repr(fn)}',
                                  param=f"{at}.function")
        for key, v in (("id", call.get("id")), ("function.name", fn.get("name")),
                       ("function.arguments", fn.get("arguments"))):
            if not isinstance(v, str) or (not v and key != "function.arguments"):
                what = "a string (the arguments as JSON text)" if key == "function.arguments" else "a non-empty string"
                raise SpecDecodeError(f"{at}.{key} must be {what}, got {json_repr(v)}", param=f"{at}.{key}")
            check_text(v, f"{at}.{key}")
        # Arguments need not be valid JSON: a model's own call may not be (OpenAI's neither), and
        # a client sends it back as it came; the template gets it as text then.
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """Checked messages as chat templates read them: each tool call's arguments decoded
    from their JSON text when that text is a JSON object (templates write them with
    ``tojson``, as transformers' convention has it); other text is kept as it is."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                try:
                    args = json.loads(call["function"]["arguments"])
                except ValueError:
                    args = None
                fn = {**call["function"], "arguments": args} if isinstance(args, dict) else call["function"]
                calls.append({**call, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
