"""Tool calls in generated text: the formats chat templates teach, read back and enforced.

A :class:`ToolCallFormat` says from a chat template whether the model was taught it
(:meth:`~ToolCallFormat.matches`), reads its calls out of generated text incrementally
(:meth:`~ToolCallFormat.parser`: the same parser serves a stream, fed delta by delta, and
a full response, fed the whole text at once, so the two agree) and builds the grammar that
forces calls (:meth:`~ToolCallFormat.grammar`, for tool_choice required or a named
function). :func:`tool_call_format` picks the first of FORMATS whose template test passes:
a new model family is one more format there.

Parts a parser returns, in text order: ``("content", text)``, ``("call", index, id, name)``
(a call begins: its name is known), ``("arguments", index, text)`` (the next piece of that
call's arguments, as generated: the pieces join to the arguments' JSON text).
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, Collection

from ..grammar import Grammar

# What a tool's name may hold (OpenAI's rule): names are matched, and written into grammars, as they are.
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_NAME_LEN = 64
_WS = " \t\r\n"


def new_call_id() -> str:
    """A fresh tool call id, as OpenAI writes them: ``call_`` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def finish_reason(reason: str, calls: int) -> str:
    """The choice's finish_reason: "tool_calls" when it made calls and ended by itself
    (end of generation: "stop"); a generation cut by max_tokens stays "length"."""
    return "tool_calls" if calls and reason == "stop" else reason


class HermesParser:
    """Calls written as Hermes and Qwen2.5 models write them, possibly several::

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    A call begins once ``<tool_call>``, the name (one of ``names``) and ``"arguments": {``
    have been read; its arguments are the JSON object that follows, to its closing brace
    (strings and nesting followed; the pieces are passed on as they arrive, nothing held
    back), then ``}`` and ``</tool_call>`` are expected and dropped. Text that cannot be
    such a call's beginning (another key order, an unknown name, arguments that are no
    object) is content, ``<tool_call>`` included. Text that may still be the start of
    ``<tool_call>``, and whitespace that may precede one, is held back; the whitespace
    right before a call, and whitespace that only follows one (to the next call or the
    end), is dropped. With parallel false, calls after the first are dropped.

    At the very start of the message a call may also come without the tag, in a code fence
    (```` ```json ````, ```` ```xml ```` or a bare ```` ``` ```` line, closed by ```` ``` ````) or bare:
    Qwen2.5-Coder writes its calls so (measured: Codex CLI's first turn on the 1.5B), and
    llama.cpp's Hermes 2 Pro handler reads the same forms there (its "good bad outputs"
    trigger, common/chat.cpp). Anywhere else such text is content.
    """

    FENCES = ("json", "xml", "")  # what may follow ``` on a fence line before a call at the start

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    # The beginning of a call after OPEN: "ws" any whitespace, "NAME" a tool's name, else literal text.
    HEAD = ("ws", "{", "ws", '"name"', "ws", ":", "ws", '"', "NAME", '"', "ws", ",", "ws", '"arguments"', "ws", ":",
            "ws", "{")

    def __init__(self, names: Collection[str], parallel: bool = True) -> None:
        self.names = frozenset(names)
        self.parallel = parallel
        self.calls = 0  # calls returned so far
        self.closed = 0  # calls returned whose arguments have ended
        self._mode = "start"  # start | text | head | args | tail
        self._fenced = False  # the call being read began with a code fence, which its tail closes
        self._buf = ""  # text read and not yet decided
        self._ws = ""  # the whitespace before the OPEN being read (content again if no call follows)
        self._after_call = False  # a call ended and no content followed yet
        self._emit = True  # the call being read is returned (False: a second call with parallel false)
        self._depth = 0
        self._in_string = self._escape = False

    def feed(self, text: str) -> list[tuple]:
        """The parts that the text so far settles (see the module docstring)."""
        self._buf += text
        out: list[tuple] = []
        while self._step(out, final=False):
            pass
        return out

    def close(self) -> list[tuple]:
        """The text has ended: the parts of everything held back."""
        out: list[tuple] = []
        while self._step(out, final=True):
            pass
        return out

    def _step(self, out: list[tuple], final: bool) -> bool:
        """Advance in the current mode; True when it made progress worth another step."""
        return getattr(self, "_" + self._mode)(out, final)

    def _content(self, out: list[tuple], text: str) -> None:
        if text and not (self._after_call and not text.strip(_WS)):  # whitespace alone after a call: dropped
            out.append(("content", text))
            self._after_call = False

    def _start(self, out: list[tuple], final: bool) -> bool:
        """The message's beginning: a call in a code fence or bare (see the class docstring),
        else on to text."""
        s = self._buf.lstrip(_WS)
        fenced = s.startswith("```")
        if fenced:
            nl = s.find("\n")
            if nl < 0 and not final and len(s) < 3 + max(map(len, self.FENCES)) + 1:
                return False
            if nl < 0 or s[3:nl].strip() not in self.FENCES:
                self._mode = "text"
                return True
            s = s[nl + 1:]
        elif "```".startswith(s) and s and not final or not s and not final:
            return False
        state, name, end = self._match_head(s) if s.lstrip(_WS)[:1] in ("{", "") else ("fail", "", 0)
        if state == "partial" and not final:
            return False
        if state != "ok":
            self._mode = "text"
            return True
        out.append(("call", self.calls, new_call_id(), name))
        self.calls += 1
        self._fenced, self._buf, self._mode = fenced, s[end:], "args"
        self._depth, self._in_string, self._escape = 0, False, False
        return True

    def _text(self, out: list[tuple], final: bool) -> bool:
        buf = self._buf
        i = buf.find(self.OPEN)
        if i >= 0:
            before = buf[:i].rstrip(_WS)
            self._content(out, before)
            self._ws, self._buf, self._mode = buf[len(before):i], buf[i + len(self.OPEN):], "head"
            return True
        if final:
            self._content(out, buf)
            self._buf = ""
            return False
        hold = next((k for k in range(min(len(buf), len(self.OPEN) - 1), 0, -1) if buf.endswith(self.OPEN[:k])), 0)
        settled = buf[:len(buf) - hold].rstrip(_WS)
        self._content(out, settled)
        self._buf = buf[len(settled):]
        return False

    def _head(self, out: list[tuple], final: bool) -> bool:
        state, name, end = self._match_head(self._buf)
        if state == "partial" and not final:
            return False
        if state == "partial":  # the output ended inside a call's head (max_tokens): a cut call, not content
            self._ws, self._buf, self._mode = "", "", "text"
            return False
        if state != "ok":  # no call: the OPEN and what follows are text
            self._content(out, self._ws + self.OPEN)
            self._ws, self._mode = "", "text"
            return True
        self._emit = self.parallel or self.calls == 0
        if self._emit:
            out.append(("call", self.calls, new_call_id(), name))
            self.calls += 1
        self._ws, self._buf, self._mode = "", self._buf[end:], "args"
        self._depth, self._in_string, self._escape = 0, False, False
        return True

    def _match_head(self, s: str) -> tuple[str, str, int]:
        """("ok", name, index of the arguments' "{"), ("partial", "", 0) when s may still
        become a call's beginning, or ("fail", "", 0)."""
        pos, name = 0, ""
        for el in self.HEAD:
            if el == "ws":
                while pos < len(s) and s[pos] in _WS:
                    pos += 1
            elif el == "NAME":
                start = pos
                while pos < len(s) and s[pos] != '"':
                    if s[pos] not in NAME_CHARS or pos - start >= MAX_NAME_LEN:
                        return "fail", "", 0
                    pos += 1
                name = s[start:pos]
                if pos == len(s):
                    return ("partial", "", 0) if any(n.startswith(name) for n in self.names) else ("fail", "", 0)
                if name not in self.names:
                    return "fail", "", 0
            else:
                piece = s[pos:pos + len(el)]
                if not el.startswith(piece):
                    return "fail", "", 0
                if len(piece) < len(el):
                    return "partial", "", 0
                pos += len(el)
            if pos == len(s) and el == "ws":
                return "partial", "", 0
        return "ok", name, pos - 1

    def _args(self, out: list[tuple], final: bool) -> bool:
        buf, end = self._buf, None
        for j, c in enumerate(buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = j + 1
                    break
        piece = buf if end is None else buf[:end]
        if piece and self._emit:
            out.append(("arguments", self.calls - 1, piece))
        self._buf = buf[len(piece):]
        if end is None:
            return False
        self.closed += self._emit
        self._mode = "tail"
        return True

    @property
    def held(self) -> int:
        """Characters fed and not yet settled (held back or being read)."""
        return len(self._buf)

    def _tail(self, out: list[tuple], final: bool) -> bool:
        """After the arguments: whitespace, the call object's "}", whitespace and CLOSE are
        dropped; anything else goes back to text."""
        buf, k = self._buf, 0
        while k < len(buf) and buf[k] in _WS:
            k += 1
        if buf[k:k + 1] == "}":
            k += 1
            while k < len(buf) and buf[k] in _WS:
                k += 1
        rest, close = buf[k:], "```" if self._fenced else self.CLOSE
        if rest.startswith(close):
            rest = rest[len(close):]
        elif close.startswith(rest) and not final:
            return False
        self._buf, self._mode, self._after_call, self._fenced = rest, "text", True, False
        return True


class ToolCallWatch:
    """One chat choice's bound on its tool calls (the worker's watch: ``feed(delta)`` the text
    kept of each committed delta, ``stopped``, ``finish(result)``): the generation ends as soon
    as the arguments of call number ``limit`` are complete, its text cut right after them. So
    ``parallel_tool_calls: false`` and a tool_choice naming a function give one call without
    generating (and dropping) more, as OpenAI answers them. The text is fed a character at a
    time so that the cut is exact inside a speculative step's several tokens. Raises nothing."""

    def __init__(self, parser: HermesParser, limit: int) -> None:
        self.parser, self.limit = parser, limit
        self.text = ""
        self.stopped = False

    def feed(self, delta: Any) -> str:
        if self.stopped:
            return ""
        before = len(self.text)
        for c in str(delta):
            self.text += c
            self.parser.feed(c)
            if self.parser.closed >= self.limit:
                self.text = self.text[:len(self.text) - self.parser.held]
                self.stopped = True
                break
        return self.text[before:]

    def finish(self, result: Any) -> Any:
        """The result with the kept text; ended by the bound, it ended by itself ("stop",
        which the response reports as "tool_calls")."""
        return replace(result, text=self.text, finish_reason="stop" if self.stopped else result.finish_reason)


class ToolCallFormat(ABC):
    """One way of writing tool calls (see the module docstring), the contract a new family's
    format implements. marker: text whose presence in a chat template says the template
    teaches this format."""

    name = ""
    marker = ""

    def matches(self, template: str) -> bool:
        return self.marker in template

    @abstractmethod
    def parser(self, names: Collection[str], parallel: bool) -> HermesParser:
        """A fresh parser of one output that may call the named tools (only the first call
        returned unless parallel)."""

    @abstractmethod
    def grammar(self, schemas: dict[str, dict], several: bool) -> Grammar:
        """The grammar of output that is exactly one call (several: one or more) of one of
        the tools ``schemas`` names, its arguments valid for that tool's parameters schema."""

    @abstractmethod
    def lazy_grammar(self, schemas: dict[str, dict]) -> Grammar:
        """tool_choice auto: a lazy grammar (``Grammar.trigger``) that allows any text that does
        not open a call, and once the text opens one, only calls of the tools ``schemas`` names
        with arguments valid for their schemas, to the end of the output."""


class HermesFormat(ToolCallFormat):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``: Hermes, Qwen2 and
    Qwen2.5 (whose templates present the tools in the system prompt and ask for this)."""

    name = "hermes"
    marker = HermesParser.OPEN

    def parser(self, names: Collection[str], parallel: bool) -> HermesParser:
        return HermesParser(names, parallel)

    def grammar(self, schemas: dict[str, dict], several: bool) -> Grammar:
        """Each call written exactly as the template asks (one per line when several), its
        arguments valid for the tool's parameters schema (llguidance's ``%json``)."""
        names = list(schemas)
        lit = json.dumps  # a Lark string literal: JSON's escapes
        head, tail = HermesParser.OPEN + '\n{"name": ', "}\n" + HermesParser.CLOSE
        repeat = ' ("\\n" call)*' if several else ""
        lark = "\n".join([f"start: call{repeat}", f"call: {lit(head)} fn {lit(tail)}",
                          "fn: " + " | ".join(f"fn_{i}" for i in range(len(names))),
                          *(f'fn_{i}: {lit(lit(name) + ", " + lit("arguments") + ": ")} '
                            f'%json {json.dumps(schemas[name])}' for i, name in enumerate(names))])
        return Grammar("lark", lark, name="tools")


    @staticmethod
    def trigger(names: Collection[str]) -> str:
        """What opens a call at the start of a message (as the parser's start mode reads it): the
        tag, or the call object, bare or in a code fence, once its "name" is one of the tools'
        (issue 61: a bare ``{"name"`` forced a call on a user who asked for ``{"name": "Bob"}``).
        The names are function names (letters, digits, _ and -): nothing in them to escape."""
        return r'\s*(<tool_call>|(```(json|xml)?\n)?\s*\{\s*"name"\s*:\s*"(' + "|".join(names) + ')")'

    def lazy_grammar(self, schemas: dict[str, dict]) -> Grammar:
        """llama.cpp's lazy grammar for Hermes 2 Pro (its trigger on the tag and on "good bad"
        outputs: the object in a fence or bare): any text that does not start like a call;
        else the tagged calls (one or more), or one fenced or bare call, each of a tool's name
        with arguments valid for its schema, then whitespace at most. Each opening is one lexeme with
        its leading whitespace, so that the lexer never has to take back a whitespace lexeme."""
        names = list(schemas)
        lit = json.dumps
        each = range(len(names))
        # A fenced or bare opening is one lexeme up to the name's closing quote, where the trigger
        # completes: the lexer never has to take back a lexeme that ended while OTHER still ran.
        lark = "\n".join([
            "start: OTHER | tagged | fenced | bare",
            f"OTHER: /(?s:.*)/ & ~/{self.trigger(names)}(?s:.*)/",
            "tagged: TAG_OPEN call TAG_CLOSE (TAG_OPEN call TAG_CLOSE)* TRAIL?",
            "fenced: " + " | ".join(f"fenced_{i}" for i in each),
            "bare: " + " | ".join(f"bare_{i}" for i in each),
            r"TRAIL: /\s+/",
            r'TAG_OPEN: /\s*<tool_call>\s*\{\s*"name"\s*:\s*/',
            r"TAG_CLOSE: /\s*\}\s*<\/tool_call>/",
            r"FENCE_CLOSE: /\s*\}\s*```/",
            r"OBJECT_CLOSE: /\s*\}/",
            r'ARGUMENTS: /\s*,\s*"arguments"\s*:\s*/',
            "call: " + " | ".join(f"call_{i}" for i in each),
            *(f"call_{i}: {lit(lit(name))} ARGUMENTS %json {json.dumps(schemas[name])}" for i, name in enumerate(names)),
            *(f'FENCE_{i}: /\\s*```(json|xml)?\\n\\s*\\{{\\s*"name"\\s*:\\s*"{name}"/' for i, name in enumerate(names)),
            *(f'BARE_{i}: /\\s*\\{{\\s*"name"\\s*:\\s*"{name}"/' for i, name in enumerate(names)),
            *(f"fenced_{i}: FENCE_{i} ARGUMENTS %json {json.dumps(schemas[name])} FENCE_CLOSE TRAIL?"
              for i, name in enumerate(names)),
            *(f"bare_{i}: BARE_{i} ARGUMENTS %json {json.dumps(schemas[name])} OBJECT_CLOSE TRAIL?"
              for i, name in enumerate(names))])
        return Grammar("lark", lark, name="tools", trigger=self.trigger(names))


FORMATS: tuple[ToolCallFormat, ...] = (HermesFormat(),)


def tool_call_format(template: str | None) -> ToolCallFormat | None:
    """The format a chat template teaches (the first of FORMATS that matches it), None
    for a template that teaches none known (or no template)."""
    if not template:
        return None
    return next((f for f in FORMATS if f.matches(template)), None)


def parse_message(text: str, parser: HermesParser) -> tuple[str | None, list[dict]]:
    """A whole generated text as (content, tool_calls in OpenAI's shape): content is None
    when the text is only calls."""
    content, calls = [], []
    for part in parser.feed(text) + parser.close():
        if part[0] == "content":
            content.append(part[1])
        elif part[0] == "call":
            calls.append({"id": part[2], "type": "function", "function": {"name": part[3], "arguments": ""}})
        else:
            calls[part[1]]["function"]["arguments"] += part[2]
    text = "".join(content)
    return (None if calls and not text else text), calls
