"""Decoding a request body of the OpenAI-compatible endpoints: JSON that is text all through
(no NaN, no lone surrogate) and nests no deeper than MAX_JSON_DEPTH."""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from .access import require_json
from ..limits import is_int
from ..messages import json_repr
from .apierror import APIError

# How deep a request body's arrays and objects may nest: a real request nests a few levels
# (a json_schema some more); far deeper ones only make every walk over the body recurse.
MAX_JSON_DEPTH = 64


def parse_json_body(raw: bytes) -> Any:
    """Decode a request body. NaN and Infinity are refused: they are not JSON, and a
    client sending them has a bug worth reporting. So are arrays and objects nested
    deeper than MAX_JSON_DEPTH, and strings (or field names) holding a lone UTF-16
    surrogate (a \\ud800 escape without its pair): they are no Unicode text, and could
    reach neither the tokenizer nor a UTF-8 response. Raises APIError (400; for a
    surrogate, param names the field, e.g. "messages[0].content")."""

    def reject_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, f"the request body is nested too deeply: arrays and objects may nest at most "
                       f"{MAX_JSON_DEPTH} levels") from None
    _check_body_values(body)
    return body


def _check_body_values(body: Any) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH or a string holding a lone surrogate
    (walked without recursion, so that depth alone cannot exhaust the stack). A value's
    path ("messages[0].content") is built only for containers and for the error."""

    def join(parent: str, key: str | int) -> str:
        return f"{parent}[{key}]" if isinstance(key, int) else f"{parent}.{key}" if parent else key

    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        container, path, depth = stack.pop()
        if depth >= MAX_JSON_DEPTH:
            top = path.split(".")[0].split("[")[0] or None
            raise APIError(400, f"the request body is nested too deeply{f' (in {top})' if top else ''}: arrays "
                           f"and objects may nest at most {MAX_JSON_DEPTH} levels", param=top)
        items = enumerate(container) if isinstance(container, list) else \
            container.items() if isinstance(container, dict) else ()
        for key, value in items:
            if isinstance(key, str):
                _check_text(key, f"a field name in {path or 'the request body'}", path or None)
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    _check_text(value, join(path, key), join(path, key))
            elif isinstance(value, (dict, list)):
                stack.append((value, join(path, key), depth + 1))


def _check_text(text: str, where: str, param: str | None) -> None:
    """400 when text holds a lone surrogate (U+D800..U+DFFF: what a JSON \\ud800 escape
    without its pair decodes to), naming where it is and at which character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{where} contains a lone surrogate (\\u{ord(text[e.start]):04x} at character "
                       f"{e.start}), which is not valid Unicode text: send UTF-8, with every \\ud800-\\udbff "
                       "escape followed by its \\udc00-\\udfff pair", param=param) from None


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes: a larger one is refused (413), from its
    Content-Length before anything is read or, sent without one (chunked), once what has
    arrived passes the limit; nothing past the limit is kept (the rest is read and discarded
    before the answer, :class:`.access.DrainUnread`). A body not sent as JSON is refused (415)."""
    def too_large(size: str) -> APIError:
        return APIError(413, f"the request body has {size} bytes, more than this server reads ({limit} bytes, "
                        "--max-body-bytes)", code="request_too_large")

    require_json(request.headers.get("content-type"))
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(length)
    body, more = bytearray(), True
    while more:
        message = await request.receive()
        if message["type"] != "http.request":
            raise APIError(400, "the client disconnected before its request body ended")
        body += message.get("body", b"")
        more = message.get("more_body", False)
        if len(body) > limit:
            raise too_large(f"over {limit}")
    return bytes(body)


def _is_finite_number(x: Any) -> bool:
    """An int or float that converts to a finite float (JSON allows integers of any length:
    1 followed by 400 zeros is beyond float's range, and math.isfinite raises on it)."""
    if is_int(x):
        try:
            return math.isfinite(float(x))
        except OverflowError:
            return False
    return isinstance(x, float) and math.isfinite(x)


class BodyFields:
    """Typed access to a request body's fields; every failure is a 400 naming the field.

    A field whose value is null counts as absent (None). prefix: prepended to field
    names in errors, for nested objects (e.g. "stream_options.").
    """

    def __init__(self, body: dict, prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def _typed(self, name: str, ok: Callable[[Any], bool], kind: str) -> Any:
        """The field's value (None when absent or null) after ``ok(value)`` holds; else a
        400 saying it must be ``kind``."""
        v = self.body.get(name)
        if v is not None and not ok(v):
            full = self.prefix + name
            raise APIError(400, f"{full} must be {kind}, got {json_repr(v)}", param=full)
        return v

    def integer(self, name: str, lo: int | None = None, hi: int | None = None, why: str = "") -> int | None:
        v = self._typed(name, is_int, "an integer")
        if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
            name = self.prefix + name
            lo_s = f"{lo} <= " if lo is not None else ""
            hi_s = f" <= {hi}" if hi is not None else ""
            raise APIError(400, f"{name} = {json_repr(v)} is out of range: expected {lo_s}{name}{hi_s}{why}",
                           param=name)
        return v

    def number(self, name: str) -> float | None:
        v = self._typed(name, _is_finite_number, "a number")
        return None if v is None else float(v)

    def boolean(self, name: str) -> bool | None:
        return self._typed(name, lambda x: isinstance(x, bool), "a boolean")

    def string(self, name: str) -> str | None:
        return self._typed(name, lambda x: isinstance(x, str), "a string")
