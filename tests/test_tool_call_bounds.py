"""Tool calls that end cleanly (issue 46, item 6, second half): with ``parallel_tool_calls``
false or a ``tool_choice`` naming a function an answer makes one call, as OpenAI answers
them, and the generation ends as soon as that call's arguments are complete, instead of
generating further calls only to drop them (one message carried 13 calls until max_tokens).
Without a bound (auto or required, parallel true) nothing changes.

The watch is judged on text split at random places (a speculative step commits several
tokens at once); the server is judged by counted forwards of a scripted model that writes
three calls.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import httpx
import pytest

from specdecode.api import Decoder
from specdecode.server import create_app, parse_request
from specdecode.server.toolcalls import FORMATS, ToolCallWatch, parse_message

from test_server import ServerThread
from test_server_responses import ScriptBackend

HERMES = FORMATS[0]


@dataclass
class Result:  # the fields of a GenerationResult a watch replaces
    text: str
    finish_reason: str

NAMES = ("get_weather", "get_time")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "a\\"}}{b"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES]


def run_watch(text: str, limit: int, rng: random.Random) -> ToolCallWatch:
    """A watch fed the text in random pieces, as committed deltas come."""
    watch = ToolCallWatch(HERMES.parser(NAMES, True), limit)
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(10, len(text)))))
    kept = "".join(watch.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)]))
    assert kept == watch.text  # what was streamed is what the full answer holds
    return watch


@pytest.mark.parametrize("text", ["Sure.\n" + CALL + "\n" + CALL2 + "\n" + CALL, CALL + CALL2, CALL])
def test_one_call_ends_the_text_right_after_its_arguments(text):
    rng = random.Random(5)
    for _ in range(50):
        watch = run_watch(text, 1, rng)
        assert watch.stopped
        end = text.index(CALL) + CALL.index("}}") + 1  # the arguments' closing brace
        assert watch.text == text[:end]
        content, calls = parse_message(watch.text, HERMES.parser(NAMES, False))
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
        assert content == ("Sure." if text.startswith("Sure.") else None)
        done = watch.finish(Result(text="everything", finish_reason="length"))
        assert (done.text, done.finish_reason) == (watch.text, "stop")  # ended by itself: "tool_calls"


def test_a_limit_of_two_keeps_two_and_text_without_calls_is_untouched():
    rng = random.Random(9)
    text = CALL + "\n" + CALL2 + "\n" + CALL
    watch = run_watch(text, 2, rng)
    assert watch.stopped and watch.text == text[:len(CALL) + 1 + CALL2.rindex("}}") + 1]  # "}}" in the string is text
    assert len(parse_message(watch.text, HERMES.parser(NAMES, True))[1]) == 2
    # Braces and tags inside a string argument are not its end; text that only mentions a tag is text.
    plain = 'No call: "<tool_call>" is how {one} writes them.'
    watch = run_watch(plain, 1, rng)
    assert not watch.stopped and watch.text == plain
    result = Result(text=plain, finish_reason="length")
    assert watch.finish(result).finish_reason == "length"


def chat_tools(**body):
    return parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **body},
                         "chat", "m", 4096, HERMES).tools


def test_which_requests_are_bounded():
    assert chat_tools().max_calls is None and chat_tools().watch() is None  # auto, parallel: as the model writes
    assert chat_tools(tool_choice="required").max_calls is None
    assert chat_tools(parallel_tool_calls=False).max_calls == 1
    assert chat_tools(tool_choice="required", parallel_tool_calls=False).max_calls == 1
    named = chat_tools(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.max_calls == 1 and isinstance(named.watch(), ToolCallWatch)


THREE = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' * 3).encode()


class ThreeCalls(ScriptBackend):
    """The scripted byte model, answering three calls of get_weather when tools are shown."""

    def _next(self, upto: int) -> int:
        text = bytes(t for t in self.tokens[:upto] if t < 256)
        start = text.rfind(b"assistant:") + len(b"assistant:")
        answer = THREE if text.startswith(b"tools: ") else b"ok"
        i = upto - start
        return answer[i] if i < len(answer) else 256


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_false_ends_the_generation_at_its_first_call(stream):
    backend = ThreeCalls()
    body = {"model": backend.name, "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
            "temperature": 0, "max_tokens": 400, "stream": stream}
    with Decoder(target=backend, draft="none", num_speculative_tokens=0, progress=False) as dec, \
            ServerThread(create_app(dec)) as s, httpx.Client(base_url=s.url, timeout=60) as h:
        counts = {}
        for parallel in (True, False):
            before = backend.forwards
            r = h.post("/v1/chat/completions", json={**body, "parallel_tool_calls": parallel})
            assert r.status_code == 200, r.text
            counts[parallel] = backend.forwards - before
            if stream:
                chunks = [json.loads(line[6:]) for line in r.text.split("\n")
                          if line.startswith("data: ") and line != "data: [DONE]"]
                ids = [tc["id"] for c in chunks for tc in (c["choices"][0]["delta"].get("tool_calls") or [])
                       if tc.get("id")]
                finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
            else:
                message = r.json()["choices"][0]["message"]
                ids = [c["id"] for c in message["tool_calls"]]
                finish = [r.json()["choices"][0]["finish_reason"]]
                assert message["content"] is None
            assert len(ids) == (3 if parallel else 1) and finish == ["tool_calls"]
    # One token a forward: the bounded answer stopped about two calls' worth of text earlier.
    call = len(THREE) // 3
    assert counts[True] - counts[False] >= 2 * call - 20
