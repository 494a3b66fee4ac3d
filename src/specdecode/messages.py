"""Chat messages as OpenAI clients send them: checked once, for the CLI, the API and the server.

A conversation is a non-empty list of ``{"role": ..., "content": ...}`` objects; role is
one of CHAT_ROLES, content a string or a list of ``{"type": "text", "text": ...}`` parts
(joined). The model's own chat template renders the result.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import SpecDecodeError
from .limits import check_text

CHAT_ROLES = ("system", "user", "assistant")


def json_repr(value: Any, limit: int = 60) -> str:
    """A short JSON rendering of a value for error messages (at most ``limit`` characters)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_messages(value: Any, name: str = "messages") -> list[dict]:
    """The conversation as a list of {"role", "content": str} dicts.

    Raises SpecDecodeError whose ``param`` names the offending element (e.g.
    "messages[2].role") and whose message shows its value.
    """
    if not isinstance(value, list) or not value:
        raise SpecDecodeError(f"{name} must be a non-empty list of messages, got {json_repr(value)}", param=name)
    out = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise SpecDecodeError(f"{where} must be an object, got {json_repr(msg)}", param=where)
        extra = sorted(k for k, v in msg.items() if k not in ("role", "content") and v is not None)
        if extra:
            raise SpecDecodeError(f"{where}: unsupported field(s) {', '.join(extra)}; only role and content are "
                                  "honoured", param=f"{where}.{extra[0]}")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise SpecDecodeError(f"{where}.role = {json_repr(role)} is not supported: expected one of "
                                  f"{', '.join(CHAT_ROLES)}", param=f"{where}.role")
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise SpecDecodeError(f"{where}.content[{j}] = {json_repr(part)} is not supported: only "
                                          '{"type": "text", "text": ...} parts are', param=f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise SpecDecodeError(f"{where}.content must be a string or a list of text parts, got "
                                  f"{json_repr(content)}", param=f"{where}.content")
        out.append({"role": role, "content": check_text(content, f"{where}.content")})
    return out
