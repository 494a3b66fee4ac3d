"""A chat prompt as token ids: the model's chat template rendered, its own markers read as
special tokens and every text the request brings read as text.

A chat template writes turn markers (``<|im_start|>``, ``<|im_end|>``) around the messages'
contents. Tokenizing the rendered prompt with special-token parsing on (as llama.cpp's and
vLLM's servers do) also reads a marker's *text* inside a content as the marker itself, so a
user message, a web page quoted in it or a tool's output that contains ``<|im_end|>`` closes its
own turn and can open a ``system`` turn of its own. Here the template's markers are the only
special tokens in the prompt: each special token's text inside a request's string (a content,
a tool call's arguments, a tool's output, a tool's definition) is swapped for a placeholder
before rendering and put back after, marked as text, and the rendered prompt is tokenized as
llama.cpp tokenizes with special parsing on (split at special-token texts, each piece between
them tokenized as text) except at the marked places. A prompt whose request brings no special
token's text is tokenized whole, exactly as before.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Sequence

from jinja2 import TemplateError

from ..errors import SpecDecodeError
from .base import Backend


def _strings(value: Any):
    """Every string inside value (dict keys included), depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _replace_strings(value: Any, swap) -> Any:
    """value with every string s (dict keys included) replaced by swap(s)."""
    if isinstance(value, str):
        return swap(value)
    if isinstance(value, dict):
        return {_replace_strings(k, swap): _replace_strings(v, swap) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_replace_strings(v, swap) for v in value]
    return value


def _alternation(texts) -> re.Pattern:
    """A pattern matching any of texts, the longest first where several start at one place
    (as llama.cpp partitions: its special tokens longest first)."""
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def merge_system(messages: Sequence[dict]) -> list[dict]:
    """messages with every system message after the first merged into one system message
    first (their contents joined by a blank line, in order): what a chat template that takes a
    system message only first can render (Claude Code and some agents send system messages mid
    conversation)."""
    systems = [m["content"] or "" for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(s for s in systems if s)}] if systems else []) + rest


def render(backend: Backend, messages: Sequence[dict], tools: Sequence[dict] | None) -> str:
    """The backend's chat template over messages (and tools, where given). Where the template
    refuses a system message after the first, the system messages are merged into one first
    (:func:`merge_system`) and rendered again; a template that takes them keeps them in place
    (so that a conversation's earlier turns stay its cached prefix)."""
    def apply(msgs: Sequence[dict]) -> str:
        return backend.apply_chat_template(msgs, tools=tools) if tools else backend.apply_chat_template(msgs)

    try:
        return apply(messages)
    except (SpecDecodeError, TemplateError):
        if not any(m["role"] == "system" for m in messages[1:]):
            raise
        return apply(merge_system(messages))


def chat_prompt_ids(backend: Backend, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids [N] of messages rendered with backend's chat template (generation prompt
    added), no BOS beyond what the template writes; the template's own special tokens are
    special, every text of messages and tools is text.

    messages: as :func:`specdecode.messages.template_messages` gives them; tools: OpenAI tool
    objects or None. Raises SpecDecodeError as :meth:`Backend.apply_chat_template` does.
    """
    specials = backend.special_texts
    found = {s for s in specials if any(s in text for text in _strings((messages, tools)))} if specials else set()
    if not found:
        return backend.tokenize(render(backend, messages, tools), add_special=False, parse_special=True)
    rendered, marked = _render_marked(backend, messages, tools, found)
    return _tokenize_marked(backend, rendered, marked)


def _render_marked(backend: Backend, messages: Sequence[dict], tools: Sequence[dict] | None,
                   found: set[str]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered prompt and the spans [start, end) of the special tokens' texts that came
    from the request. Placeholders are letters, digits and underscores, which every filter a
    template applies (tojson, escaping, trim) leaves as they are."""
    texts = sorted(found, key=len, reverse=True)
    every = "".join(_strings((messages, tools)))
    nonce = secrets.token_hex(8)
    while nonce in every:  # as good as never; a placeholder must not occur in the request
        nonce = secrets.token_hex(8)
    index = {t: i for i, t in enumerate(texts)}
    pattern = _alternation(texts)
    swap = lambda s: pattern.sub(lambda m: f"SPECDECODE{nonce}_{index[m.group()]}_", s)  # noqa: E731
    rendered = render(backend, _replace_strings(list(messages), swap),
                      _replace_strings(list(tools), swap) if tools else None)
    out: list[str] = []
    marked: list[tuple[int, int]] = []
    pos = length = 0
    for m in re.finditer(f"SPECDECODE{nonce}_([0-9]+)_", rendered):
        out.append(rendered[pos:m.start()])
        length += m.start() - pos
        text = texts[int(m.group(1))]
        out.append(text)
        marked.append((length, length + len(text)))
        length += len(text)
        pos = m.end()
    out.append(rendered[pos:])
    return "".join(out), marked


def _tokenize_marked(backend: Backend, text: str, marked: list[tuple[int, int]]) -> list[int]:
    """text tokenized as ``tokenize(text, parse_special=True)`` would, except that the spans
    marked [start, end) are never read as special tokens."""
    pattern = _alternation(backend.special_texts)
    ids: list[int] = []
    start = 0  # where the text not yet tokenized begins
    spans = iter(marked)
    span = next(spans, None)
    pos = 0
    while (m := pattern.search(text, pos)) is not None:
        while span is not None and span[1] <= m.start():
            span = next(spans, None)
        if span is not None and span[0] <= m.start() < span[1]:
            pos = span[1]  # the request's text: read past it as text
            continue
        if m.start() > start:
            ids += backend.tokenize(text[start:m.start()], add_special=False, parse_special=False)
        ids.append(_special_id(backend, m.group()))
        start = pos = m.end()
    if start < len(text):
        ids += backend.tokenize(text[start:], add_special=False, parse_special=False)
    return ids


def _special_id(backend: Backend, text: str) -> int:
    ids = backend.tokenize(text, add_special=False, parse_special=True)
    if len(ids) != 1:  # a special text that is not one token: the backend's special_texts is wrong
        raise SpecDecodeError(f"{backend.name}: special token text {text!r} tokenizes as {ids}, not one token")
    return ids[0]
