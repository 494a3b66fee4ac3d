"""The tool fields of a chat request: tools, tool_choice, parallel_tool_calls, checked as OpenAI defines them.

:func:`parse_tools` gives a :class:`ToolRequest` (or None when the request uses no tools,
or tool_choice "none": the tools are then neither shown to the model nor looked for in its
output); a bad shape is a 400 naming the field exactly (``tools[1].function.name``).
Which tool-call format the model writes comes from its chat template
(:mod:`.toolcalls`); a model whose template teaches none known cannot take tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..grammar import Grammar, check_grammar
from ..messages import json_repr
from .apierror import APIError
from .toolcalls import MAX_NAME_LEN, NAME_CHARS, HermesParser, ToolCallFormat, ToolCallWatch

TOOL_CHOICES = ("none", "auto", "required")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
# A function that declares no parameters takes none.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, eq=False)
class ToolRequest:
    """A request's tools, to render, parse and (for required or a named function) enforce.

    tools: the tool objects as the chat template presents them ({"type": "function",
    "function": {...}}, null fields left out). choice: "auto" or "required"; name: the
    function tool_choice names (choice is then "required"), else None. parallel:
    parallel_tool_calls. format: the model's tool-call format.
    """

    tools: tuple[dict, ...]
    choice: str
    name: str | None
    parallel: bool
    format: ToolCallFormat

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    def schema(self, name: str) -> dict:
        """The parameters schema of the named function, as its grammar enforces it: an object
        schema ("type" defaults to "object"), compiled leniently (llguidance's ``lenient``: a
        keyword it does not implement, such as ``propertyNames`` in Claude Code's TaskCreate,
        constrains nothing instead of failing the whole grammar, whose calls would then go
        unconstrained under tool_choice auto)."""
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        params = fn.get("parameters")
        schema = _NO_PARAMETERS if params is None else params if "type" in params else {"type": "object", **params}
        return schema if "x-guidance" in schema else {**schema, "x-guidance": {"lenient": True}}

    def grammar(self) -> Grammar:
        """The grammar forcing the calls (tool_choice required or named); under auto, the lazy
        grammar that constrains a call once the output opens one (llama.cpp's lazy grammar)."""
        if self.choice == "auto":
            return self.format.lazy_grammar({n: self.schema(n) for n in self.names})
        names = self.names if self.name is None else (self.name,)
        return self.format.grammar({n: self.schema(n) for n in names}, several=self.name is None and self.parallel)

    def check_schemas(self, backend: Any) -> None:
        """Compile each tool's parameters schema alone; raise SpecDecodeError naming the first
        that does not compile (``tools[i].function.parameters``) with llguidance's message on
        the schema, not on the tools' internal grammar (issue 61: an error that named ``tools``
        and quoted the Lark grammar)."""
        for i, name in enumerate(self.names):
            check_grammar(Grammar.json_schema(self.schema(name), f"tools[{i}].function.parameters"), backend)

    def parser(self) -> HermesParser:
        """A fresh parser of one choice's output."""
        return self.format.parser(self.names, self.parallel)

    @property
    def max_calls(self) -> int | None:
        """The most calls one answer may make: one with parallel_tool_calls false or a named
        function (as OpenAI answers them), else no bound (None)."""
        return 1 if not self.parallel or self.name is not None else None

    def watch(self, token_bytes: Any = None) -> ToolCallWatch | None:
        """A choice's :class:`.toolcalls.ToolCallWatch` (the generation ends with its last
        allowed call), None where the calls are not bounded. token_bytes: unused (the
        worker's watch factories take it)."""
        limit = self.max_calls
        return None if limit is None else ToolCallWatch(self.format.parser(self.names, True), limit)


def parse_tools(body: dict, tool_format: ToolCallFormat | None) -> ToolRequest | None:
    """The request's tool fields (see the module docstring). tool_format: the served
    model's (None when its template teaches none). Raises APIError (400) naming the field."""
    tools = _check_tools(body.get("tools"))
    choice, name = _check_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, f"parallel_tool_calls must be a boolean, got {json_repr(parallel)}",
                       param="parallel_tool_calls")
    if not tools or choice == "none":
        return None
    if body.get("response_format") not in (None, {"type": "text"}):
        raise APIError(400, "response_format cannot be combined with tools unless tool_choice is \"none\": a tool "
                       "call's arguments follow the tool's parameters schema instead", param="response_format")
    if tool_format is None:
        raise APIError(400, "this model's chat template has no known tool-call format (it teaches none of: "
                       "<tool_call> JSON, as Hermes and Qwen2.5 write it), so it cannot be given tools; send "
                       "the request without tools, or with tool_choice \"none\"", param="tools")
    return ToolRequest(tools, "required" if name is not None else choice, name,
                       True if parallel is None else parallel, tool_format)


def _check_tools(value: Any) -> tuple[dict, ...]:
    """tools as tool objects with their null fields left out; () when absent or empty."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise APIError(400, f"tools must be a list of tools, got {json_repr(value)}", param="tools")
    out, seen = [], {}
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(400, f"{where} must be an object, got {json_repr(tool)}", param=where)
        _no_other_keys(tool, ("type", "function"), where)
        if tool.get("type") != "function":
            raise APIError(400, f'{where}.type = {json_repr(tool.get("type"))} is not supported: only "function" '
                           "tools are", param=f"{where}.type")
        fn = _check_function(tool.get("function"), f"{where}.function")
        if fn["name"] in seen:
            raise APIError(400, f"{where}.function.name = {json_repr(fn['name'])} is also the name of "
                           f"tools[{seen[fn['name']]}]: tool names must be unique", param=f"{where}.function.name")
        seen[fn["name"]] = i
        out.append({"type": "function", "function": fn})
    return tuple(out)


def _no_other_keys(obj: dict, keys: tuple[str, ...], where: str) -> None:
    extra = [k for k, v in obj.items() if k not in keys and v is not None]
    if extra:
        raise APIError(400, f"{where}: unsupported field(s) {', '.join(extra)}; expected {', '.join(keys)}",
                       param=f"{where}.{extra[0]}")


def _check_function(fn: Any, where: str) -> dict:
    """A tool's function object: name (as OpenAI allows: letters, digits, _ and -, at most
    64), optional description (string), parameters (a JSON schema object), strict (boolean)."""
    if not isinstance(fn, dict):
        raise APIError(400, f"{where} must be an object with name, description, parameters, strict; got "
                       f"{json_repr(fn)}", param=where)
    _no_other_keys(fn, _FUNCTION_KEYS, where)
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN or not set(name) <= NAME_CHARS:
        raise APIError(400, f"{where}.name must be a string of 1 to {MAX_NAME_LEN} letters, digits, underscores "
                       f"and dashes, got {json_repr(name)}", param=f"{where}.name")
    for key, kind, ok in (("description", "a string", lambda v: isinstance(v, str)),
                          ("parameters", "a JSON schema (an object)", lambda v: isinstance(v, dict)),
                          ("strict", "a boolean", lambda v: isinstance(v, bool))):
        v = fn.get(key)
        if v is not None and not ok(v):
            raise APIError(400, f"{where}.{key} must be {kind}, got {json_repr(v)}", param=f"{where}.{key}")
    kind = (fn.get("parameters") or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise APIError(400, f"{where}.parameters.type = {json_repr(kind)}: a function's parameters are an object "
                       '(type "object") of its arguments by name', param=f"{where}.parameters.type")
    return {k: fn[k] for k in _FUNCTION_KEYS if fn.get(k) is not None}


def _check_choice(value: Any, tools: tuple[dict, ...]) -> tuple[str, str | None]:
    """tool_choice as (choice, the named function or None); "auto" when absent."""
    if value is None:
        return "auto", None
    names = [t["function"]["name"] for t in tools]
    if isinstance(value, str) and value in TOOL_CHOICES:
        if value == "required" and not tools:
            raise APIError(400, 'tool_choice = "required" needs tools', param="tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    if not (isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "function"}
            and isinstance(fn, dict) and set(fn) == {"name"} and isinstance(fn["name"], str)):
        raise APIError(400, f'tool_choice = {json_repr(value)} is not supported: expected "none", "auto", '
                       '"required" or {"type": "function", "function": {"name": ...}}', param="tool_choice")
    if fn["name"] not in names:
        known = ", ".join(json_repr(n) for n in names) or "none (the request has no tools)"
        raise APIError(400, f"tool_choice names the function {json_repr(fn['name'])}, which is not among tools: "
                       f"they are {known}", param="tool_choice.function.name")
    return "function", fn["name"]
