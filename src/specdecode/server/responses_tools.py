"""The tools of a Responses request (``tools``, ``tool_choice``) as chat's, and the names of the
model's calls as the client expects them back (:mod:`.responses_api` uses it).

- ``function``: a chat function tool.
- ``namespace`` (OpenAI's group of function tools, ``{"type": "namespace", "name", "description",
  "tools": [...]}``; Codex CLI sends its sub-agent tools as one, ``multi_agent_v1``): each
  ``function`` member becomes a chat function tool of its own name (``{namespace}__{name}`` when
  that name is taken by another tool of the request), and a call of it comes back as
  ``{"name": name, "namespace": namespace}``, since a client that groups tools dispatches on
  both (OpenAI's function_call item carries ``namespace``); a function_call item of the input
  with a namespace is read back to that prompt name. Members of other types are left out, as
  hosted tools are.
- Tools the client does not run (OpenAI's hosted tools, :data:`LEFT_OUT`: ``web_search``,
  ``file_search``, ``code_interpreter``, ...) and those whose calls are not function calls
  (``local_shell``, ``custom``, ``apply_patch``, ``shell``): this server runs none and the model
  writes only function calls, so they are left out of the prompt, and the response lists them
  in ``tools_left_out`` (``{"tool": "tools[8]", "type": "web_search"}``). The answer means what
  it would have meant had the model chosen not to use them. Any other type is a 400.
- ``tool_choice``: ``none``, ``auto``, ``required``, ``{"type": "function", "name"}`` (with
  ``namespace`` for a member); forcing a tool that was left out (``{"type": "web_search"}``) is
  a 400, since the answer could not be that tool's.

Pure: no FastAPI, no model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from ..messages import json_repr
from .apierror import APIError
from .toolcalls import MAX_NAME_LEN, NAME_CHARS

# OpenAI's tool types that are not function tools (the Responses API reference, "Tools").
LEFT_OUT = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26", "file_search",
    "code_interpreter", "image_generation", "computer", "computer_use_preview", "mcp", "tool_search", "local_shell",
    "shell", "custom", "apply_patch",
})
SEPARATOR = "__"


def _error(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class ToolSet:
    """A request's tools as chat sees them.

    chat: the chat tools (None when the request has none); origin[j]: the Responses field
    chat tool j came from (``tools[4].tools[1]``); left_out: the tools left out of the prompt
    (``{"tool": "tools[8]", "type": "web_search"}``); members: prompt name -> (namespace,
    name) of each namespace member."""

    chat: list[dict] | None = None
    origin: list[str] = field(default_factory=list)
    left_out: list[dict] = field(default_factory=list)
    members: dict[str, tuple[str, str]] = field(default_factory=dict)

    def call_fields(self, prompt_name: str) -> dict:
        """A function_call item's name fields for a call of prompt_name: ``name``, and
        ``namespace`` for a namespace member."""
        if prompt_name in self.members:
            namespace, name = self.members[prompt_name]
            return {"name": name, "namespace": namespace}
        return {"name": prompt_name}

    def prompt_name(self, name: str, namespace: str | None) -> str:
        """The name the model sees for a function (of a namespace, or none)."""
        if namespace is None:
            return name
        for flat, member in self.members.items():
            if member == (namespace, name):
                return flat
        return _joined(namespace, str(name), self.members)  # a group no longer offered: a distinct name


def tool_set(value: Any) -> ToolSet:
    """``tools`` read into a :class:`ToolSet`. Raises APIError (400) naming the tool for a type
    that is neither a function, a namespace nor one of :data:`LEFT_OUT`."""
    if not isinstance(value, list):
        return ToolSet(chat=value)  # None, or a wrong type the chat parser names
    out = ToolSet(chat=[])
    entries: list[tuple[str, dict, str | None]] = []  # (where, function tool, namespace)
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            entries.append((where, tool, None))
        elif kind == "namespace":
            entries += _members(tool, where, out)
        elif kind in LEFT_OUT:
            out.left_out.append({"tool": where, "type": kind})
        else:
            raise _error(f"{where}.type = {json_repr(kind)} is not supported: this server reads function and "
                         f"namespace tools, and leaves out the tools it cannot run ({', '.join(sorted(LEFT_OUT))})",
                         f"{where}.type")
    taken = {t.get("name") for _, t, ns in entries if ns is None}
    for where, tool, namespace in entries:
        name = tool.get("name")
        if namespace is not None:
            # A member keeps its own name unless another tool has it: small models call
            # tools by the names they were shown, and Codex's members have distinct ones.
            clash = name in taken or sum(1 for _, t, ns in entries if ns is not None and t.get("name") == name) > 1
            flat = _flat_name(namespace, name, taken, f"{where}.name") if clash else name
            out.members[flat] = (namespace, name)
            taken.add(flat)
            name = flat
        fn = {k: v for k, v in tool.items() if k not in ("type", "name")}
        out.chat.append({"type": "function", "function": {"name": name, **fn}})
        out.origin.append(where)
    return out


def _flat_name(namespace: str, name: Any, taken: set, param: str) -> str:
    """A clashing member's name as the model sees it: ``{namespace}__{name}``, its characters
    outside a function name's (letters, digits, _ and -) as "_", and where that is longer than
    64 or taken, cut and ended by 8 hex digits of a hash of both names (issue 61: a name over 64
    characters, or a namespace with ".", got a 400 blaming a name the client never sent).
    Raises APIError naming the member's own name where that is no function name."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN or not set(name) <= NAME_CHARS:
        raise _error(f"{param} must be a string of 1 to {MAX_NAME_LEN} letters, digits, underscores and dashes, "
                     f"got {json_repr(name)}", param)
    return _joined(namespace, name, taken)


def _joined(namespace: str, name: str, taken: set | dict) -> str:
    flat = "".join(c if c in NAME_CHARS else "_" for c in f"{namespace}{SEPARATOR}{name}")
    if len(flat) > MAX_NAME_LEN or flat in taken:
        digest = hashlib.sha256(f"{namespace}\0{name}".encode("utf-8", "surrogatepass")).hexdigest()[:8]
        flat = f"{flat[:MAX_NAME_LEN - 9]}_{digest}"
    return flat


def _members(tool: dict, where: str, out: ToolSet) -> list[tuple[str, dict, str]]:
    """A namespace's function members (its other members go to out.left_out)."""
    namespace, members = tool.get("name"), tool.get("tools")
    if not isinstance(namespace, str) or not namespace:
        raise _error(f"{where}.name must be a non-empty string, got {json_repr(namespace)}", f"{where}.name")
    if not isinstance(members, list):
        raise _error(f"{where}.tools must be a list of tools, got {json_repr(members)}", f"{where}.tools")
    entries = []
    for j, member in enumerate(members):
        at = f"{where}.tools[{j}]"
        kind = member.get("type") if isinstance(member, dict) else None
        if kind == "function":
            entries.append((at, member, namespace))
        elif kind in LEFT_OUT:
            out.left_out.append({"tool": at, "type": kind})
        else:
            raise _error(f"{at}.type = {json_repr(kind)} is not supported in a namespace: expected function",
                         f"{at}.type")
    return entries


def tool_choice(value: Any, tools: ToolSet) -> Any:
    """``tool_choice`` in the chat shape. Raises APIError (400) naming tool_choice for a shape
    other than those of the module docstring, or for a tool that was left out."""
    if value is None or isinstance(value, str):
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and set(value) <= {"type", "name", "namespace"} and "name" in value:
        namespace = value.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise _error(f"tool_choice.namespace must be a string, got {json_repr(namespace)}", "tool_choice.namespace")
        name = value["name"] if not isinstance(value["name"], str) else tools.prompt_name(value["name"], namespace)
        return {"type": "function", "function": {"name": name}}
    if kind in LEFT_OUT:
        left = [t["tool"] for t in tools.left_out if t["type"] == kind]
        raise _error(f"tool_choice = {json_repr(value)} forces a tool this server cannot run: a {kind} tool is left "
                     f"out of the prompt ({', '.join(left) or 'and the request has none'}), so no answer could be "
                     'its call; use "auto", "required" or a function', "tool_choice")
    raise _error(f'tool_choice = {json_repr(value)} is not supported: expected "none", "auto", "required" or '
                 '{"type": "function", "name": ...}', "tool_choice")
