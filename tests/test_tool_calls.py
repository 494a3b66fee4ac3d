"""Tool calls on /v1/chat/completions: the request fields, the conversation shapes, the
parser of the Hermes/Qwen2.5 format (whole and streamed), the grammar that forces calls,
and, on the default target (qwen2.5-coder-1.5b-instruct), the chat template's rendering
and a round trip through the official openai client."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from specdecode.errors import SpecDecodeError
from specdecode.grammar import GrammarConstraint
from specdecode.messages import check_messages, template_messages
from specdecode.server import APIError, create_app, parse_request
from specdecode.server.jobs import ChoiceDone, Delta
from specdecode.server.responses import ChatStream, full_response
from specdecode.server.runner import write_stream
from specdecode.server.toolcalls import FORMATS, HermesFormat, HermesParser, parse_message, tool_call_format
from test_server import ServerThread

MODEL = "m"
N_CTX = 4096
HERMES = FORMATS[0]  # the registry's Hermes/Qwen2.5 format
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a time zone",
                                           "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                          "required": ["tz"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'


def chat(body: dict, tool_format=HERMES):
    return parse_request({"model": MODEL, "messages": ASK, **body}, "chat", MODEL, N_CTX, tool_format)


def fails(body: dict, tool_format=HERMES) -> APIError:
    with pytest.raises(APIError) as e:
        chat(body, tool_format)
    assert e.value.status == 400
    return e.value


# --- the request fields --------------------------------------------------------------------

def test_tools_default_to_auto_and_parallel():
    req = chat({"tools": TOOLS})
    t = req.tools
    assert (t.choice, t.name, t.parallel, t.names) == ("auto", None, True, ("get_weather", "get_time"))
    assert t.tools[0] == TOOLS[0]
    lazy = req.options.grammar  # auto: the model may answer text; a call, once opened, is constrained
    assert lazy.trigger and lazy.name == "tools" and "get_time" in lazy.source and lazy.source.startswith("start: OTHER")
    assert chat({"tools": []}).tools is None and chat({}).tools is None


def test_required_and_named_choices_constrain_the_output():
    req = chat({"tools": TOOLS, "tool_choice": "required"})
    assert req.options.grammar.kind == "lark" and req.options.grammar.name == "tools"
    assert 'start: call ("\\n" call)*' in req.options.grammar.source and "get_time" in req.options.grammar.source
    one = chat({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}).options.grammar.source
    assert one.startswith("start: call\n")
    named = chat({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert (named.tools.choice, named.tools.name) == ("required", "get_time")
    assert "get_weather" not in named.options.grammar.source and named.options.grammar.source.startswith("start: call\n")


def test_tool_choice_none_neither_renders_nor_parses():
    req = chat({"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "json_object"}})
    assert req.tools is None and req.options.grammar.kind == "json_object"  # none: response_format allowed
    # Whatever the model writes stays text: none never returns tool_calls.
    out = full_response("chat", MODEL, [(0, result(CALL), None)], lambda r: {}, req.tools)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": CALL}
    assert out["choices"][0]["finish_reason"] == "stop"
    # Even a model whose template teaches no format may be sent tools with tool_choice none.
    assert chat({"tools": TOOLS, "tool_choice": "none"}, tool_format=None).tools is None


BAD = [
    ({"tools": {"type": "function"}}, "tools", "tools must be a list"),
    ({"tools": ["f"]}, "tools[0]", "tools[0] must be an object"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", '"retrieval" is not supported'),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools[0].x", "unsupported field(s) x"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "tools[0].function must be an object"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"description": "no name"}}]}, "tools[1].function.name",
     "tools[1].function.name must be a string of 1 to 64"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "get weather"}}]}, "tools[1].function.name",
     'got "get weather"'),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools[0].function.name", "1 to 64"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "tool names must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters",
     "must be a JSON schema (an object)"),
    # Issue 61: parameters of another type gave 200 with raw <tool_call> tags in content.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters.type", 'a function\'s parameters are an object'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": ["array"]}}}]},
     "tools[0].function.parameters.type", '["array"]'),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[0].function.description",
     "must be a string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict",
     "must be a boolean"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parms": {}}}]}, "tools[0].function.parms",
     "unsupported field(s) parms"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", 'tool_choice = "any" is not supported'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice", "is not supported"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
     "tool_choice.function.name", 'names the function "get_news", which is not among tools'),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice.function.name", "not among tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "must be a boolean"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", 'unless tool_choice is "none"'),
]


@pytest.mark.parametrize("body,param,fragment", BAD, ids=[b[1] for b in BAD])
def test_a_bad_tools_shape_is_a_400_naming_the_field(body, param, fragment):
    err = fails(body)
    assert err.param == param, err.body()
    assert fragment in err.message, err.message


def test_a_template_without_a_known_format_refuses_tools():
    err = fails({"tools": TOOLS}, tool_format=None)
    assert err.param == "tools" and "no known tool-call format" in err.message
    assert tool_call_format(None) is None and tool_call_format("{{ messages }}") is None
    assert tool_call_format("... <tool_call> ...") is HERMES and isinstance(HERMES, HermesFormat)
    with pytest.raises(APIError, match="unsupported field"):  # completions take no tools
        parse_request({"model": MODEL, "prompt": "hi", "tools": TOOLS}, "completion", MODEL, N_CTX, HERMES)


# --- the conversation ----------------------------------------------------------------------

FOLLOW_UP = [*ASK,
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 17, "condition": "sunny"}'}]


def test_assistant_tool_calls_and_tool_messages_are_checked():
    msgs = check_messages(FOLLOW_UP)
    assert msgs[1] == {"role": "assistant", "content": None, "tool_calls": FOLLOW_UP[1]["tool_calls"]}
    assert msgs[2] == FOLLOW_UP[2]
    # Templates read the arguments as an object; text that is no JSON object stays text.
    assert template_messages(msgs)[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    odd = [{**FOLLOW_UP[1], "tool_calls": [{**FOLLOW_UP[1]["tool_calls"][0],
                                            "function": {"name": "f", "arguments": "not json"}}]}]
    assert template_messages(check_messages(odd))[0]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "unit": "celsius"}'  # unchanged


BAD_MESSAGES = [
    ([{"role": "tool", "content": "17"}], "messages[0].tool_call_id", "tool_call_id must be the id"),
    ([{"role": "user", "content": "hi", "tool_call_id": "x"}], "messages[0].tool_call_id", "unsupported field(s)"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], "messages[0].tool_calls", "unsupported field(s)"),
    ([{"role": "assistant", "tool_calls": []}], "messages[0].tool_calls", "must be a non-empty list"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "code", "function": {}}]}], "messages[0].tool_calls[0]",
     "must be {"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": "f"}]}], "messages[0].tool_calls[0].function",
     "must be {"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls[0].id", "must be a non-empty string"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]}],
     "messages[0].tool_calls[0].function.arguments", "the arguments as JSON text"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "", "arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name", "must be a non-empty string"),
    ([{"role": "assistant"}], "messages[0].content", "content must be a string"),
]


@pytest.mark.parametrize("messages,param,fragment", BAD_MESSAGES, ids=[b[1] for b in BAD_MESSAGES])
def test_a_bad_tool_message_names_the_field(messages, param, fragment):
    with pytest.raises(SpecDecodeError) as e:
        check_messages(messages)
    assert e.value.param == param and fragment in str(e.value), (e.value.param, str(e.value))
    err = fails({"messages": messages})
    assert err.param == param


# --- reading the calls ---------------------------------------------------------------------

NAMES = ("get_weather", "get_time")


def parse(text: str, parallel: bool = True):
    return parse_message(text, HermesParser(NAMES, parallel))


def test_one_call_parallel_calls_and_text_around_them():
    content, calls = parse(CALL)
    assert content is None and len(calls) == 1
    c = calls[0]
    assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29
    assert c["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}
    content, calls = parse(CALL + "\n" + CALL2 + "\n")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert calls[0]["id"] != calls[1]["id"]
    content, calls = parse("Let me look that up.\n\n" + CALL + "\nOne moment.")
    assert content == "Let me look that up.\nOne moment." and len(calls) == 1  # the whitespace before a call dropped
    content, calls = parse(CALL + "\n" + CALL2, parallel=False)  # parallel_tool_calls false: the first only
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    # Arguments are taken as written, braces and quotes inside strings included.
    tricky = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "a\\"}{b", "n": [1, {"x": "]"}]}}\n</tool_call>'
    assert json.loads(parse(tricky)[1][0]["function"]["arguments"]) == {"tz": 'a"}{b', "n": [1, {"x": "]"}]}


@pytest.mark.parametrize("text", [
    "Use <tool_call> tags to call tools.",  # the tag, then no call
    '<tool_call>\n{"name": "get_news", "arguments": {}}\n</tool_call>',  # not among tools
    '<tool_call>\n{"arguments": {"tz": "UTC"}, "name": "get_time"}\n</tool_call>',  # another order
    '<tool_call>\n{"name": "get_time", "arguments": "UTC"}\n</tool_call>',  # arguments no object
    'Here:\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',  # a fence after text
    '```json\n{"name": "get_news", "arguments": {}}\n```',  # a fence at the start, not among tools
    '```python\nprint({"name": "get_time", "arguments": {}})\n```',  # another language's fence
    '{"name": "Ada", "arguments": {}}',  # bare JSON at the start, no tool's name
    "plain text\n\n", "ends with <tool_c",
])
def test_text_that_is_no_call_stays_content(text):
    content, calls = parse(text)
    assert (content, calls) == (text, [])
    out = full_response("chat", MODEL, [(0, result(text), None)], lambda r: {}, chat({"tools": TOOLS}).tools)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert out["choices"][0]["finish_reason"] == "stop"


FENCED = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'


@pytest.mark.parametrize("text", [FENCED, "\n" + FENCED + "\n", FENCED.replace("json", "", 1),
                                  FENCED.replace("json", "xml", 1), '{"name": "get_weather", "arguments": {"city": "Paris"}}'])
def test_a_call_in_a_fence_or_bare_at_the_start_is_a_call(text):
    """Qwen2.5-Coder-1.5B wrote Codex's exec_command call in a ```json fence, as llama.cpp's
    Hermes 2 Pro handler reads it at the start of the message."""
    content, calls = parse(text)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_weather", '{"city": "Paris"}')]
    content, calls = parse(FENCED + "\nThen I will answer.\n" + FENCED)  # text after it; a second fence is text
    assert len(calls) == 1 and content == "\nThen I will answer.\n" + FENCED


def test_a_call_cut_in_its_head_never_leaks_into_content():
    """Issue 46, item 6: '<tool_call>\n{"name": "final_answer", "arguments":' was left in content."""
    for cut in ('\n<tool_call>\n{"name": "get_time", "arguments":', "\n<tool_call>\n{\"name\": \"get_ti", "\n<tool_call>"):
        content, calls = parse("Sure.\n" + CALL + cut)
        assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_weather"], (cut, content)
    assert parse("ends with <tool_c") == ("ends with <tool_c", [])  # no call begun: text


def test_a_call_cut_by_max_tokens_keeps_length():
    cut = CALL[:60]
    content, calls = parse(cut)
    assert content is None and calls[0]["function"]["arguments"] == cut.split('"arguments": ', 1)[1]
    out = full_response("chat", MODEL, [(0, result(cut, "length"), None)], lambda r: {}, chat({"tools": TOOLS}).tools)
    assert out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("text", [CALL, "Checking.\n" + CALL + "\n" + CALL2 + "\n", "no call <tool_call>\n{\"nam",
                                  "a <tool", CALL[:70], CALL + " then text <tool_call>\n{} done", FENCED,
                                  "``` not a call", FENCED + "\nok\n" + CALL, FENCED[:30]])
def test_any_split_of_the_text_gives_the_same_parts(text):
    whole_content, whole_calls = parse(text)
    rng = random.Random(7)
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(12, len(text)))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        p = HermesParser(NAMES)
        parts = [part for piece in pieces for part in p.feed(piece)] + p.close()
        assert "".join(x[1] for x in parts if x[0] == "content") == (whole_content or "")
        names = [x[3] for x in parts if x[0] == "call"]
        args = ["".join(x[2] for x in parts if x[0] == "arguments" and x[1] == i) for i in range(len(names))]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == list(zip(names, args))


# --- streaming -----------------------------------------------------------------------------

def result(text: str, finish: str = "stop"):
    stats = SimpleNamespace(prompt_tokens=5, prompt_cached=0, completion_tokens=len(text))
    return SimpleNamespace(text=text, finish_reason=finish, stats=stats)


def run_stream(req, pieces: list[str], res, logprobs: bool = False) -> list[dict]:
    """The chunks a stream of these text deltas gives (the worker's events, faked)."""
    async def go():
        job = SimpleNamespace(events=asyncio.Queue())
        events = [Delta(0, p, {"content": [p], "refusal": None} if logprobs else None) for p in pieces]
        events.append(ChoiceDone(0, res, None))
        for e in events:
            job.events.put_nowait(e)
        writer = ChatStream("chat", MODEL, req, lambda r: {"drafted": 0})
        return [c async for c in write_stream(writer, job, 1)]
    chunks = asyncio.run(go())
    assert chunks[-1] == "data: [DONE]\n\n"
    return [json.loads(c[len("data: "):]) for c in chunks[:-1]]


def join_stream(chunks: list[dict]) -> tuple[str | None, list[dict], str]:
    """A stream's message as a client rebuilds it: content, tool calls, finish_reason."""
    content, calls, finish = None, [], None
    for c in chunks:
        choice = c["choices"][0]
        delta = choice["delta"]
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for tc in delta.get("tool_calls") or []:
            if tc.get("id"):
                assert tc["index"] == len(calls) and tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls.append({"id": tc["id"], "type": "function", "function": dict(tc["function"])})
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
        finish = choice.get("finish_reason") or finish
    return content, calls, finish


@pytest.mark.parametrize("text", [CALL, "Sure.\n" + CALL + "\n" + CALL2, "no tools needed, <tool_call> said"])
def test_stream_deltas_join_to_the_full_response(text):
    req = chat({"tools": TOOLS, "stream": True})
    full = full_response("chat", MODEL, [(0, result(text), None)], lambda r: {}, req.tools)["choices"][0]
    rng = random.Random(3)
    cuts = sorted(rng.sample(range(1, len(text)), 15))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    chunks = run_stream(req, pieces, result(text))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content, calls, finish = join_stream(chunks)
    assert content == full["message"]["content"] and finish == full["finish_reason"]
    strip = [{**c, "id": None} for c in full["message"].get("tool_calls", [])]  # ids are drawn per response
    assert [{**c, "id": None} for c in calls] == strip
    if strip:
        assert len([c for c in chunks if any("id" in t for t in c["choices"][0]["delta"].get("tool_calls", []))]) \
            == len(strip)
        assert sum(1 for c in chunks if c["choices"][0]["delta"].get("tool_calls")) > len(strip) + 1  # pieces


def test_stream_logprobs_ride_on_the_chunks_of_their_text():
    req = chat({"tools": TOOLS, "stream": True, "logprobs": True})
    pieces = ["<tool", "_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris", ', '"unit": "celsius"}',
              "}\n</tool_call>"]
    chunks = run_stream(req, pieces, result("".join(pieces)), logprobs=True)
    carried = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
    assert carried == pieces  # each delta's logprobs once, in order, even where its text gave no part
    assert join_stream(chunks)[2] == "tool_calls"


# --- the grammar ---------------------------------------------------------------------------

def test_the_forced_call_matches_the_schema(smollm):
    """The grammar of tool_choice required, compiled over a real vocabulary: the template's
    own form with valid arguments passes whole; a wrong enum value, a missing key or text
    before the call is cut; the call is complete only at its closing tag."""
    grammar = chat({"tools": TOOLS, "tool_choice": "required"}).options.grammar

    def allowed(text: str) -> tuple[int, int, GrammarConstraint]:
        ids = smollm.tokenize(text, add_special=False)
        c = GrammarConstraint(grammar, smollm)
        return c.valid_prefix(ids), len(ids), c

    for good in (CALL, CALL + "\n" + CALL2, CALL.replace('"Paris", "unit"', '"Paris","unit"')):
        n, total, c = allowed(good)
        assert n == total, good
        c.commit(smollm.tokenize(good, add_special=False))
        assert c.accepting
    for bad in (CALL.replace("celsius", "kelvin"), CALL.replace(', "unit": "celsius"', ""), "Sure. " + CALL,
                CALL.replace("get_weather", "get_news")):
        n, total, _ = allowed(bad)
        assert n < total, bad
    n, total, c = allowed(CALL[:-3])
    assert n == total and not c.accepting


FENCED_CALL = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris", "unit": "celsius"}\n}\n```'


@pytest.mark.parametrize("text, left", [
    ("Sure, Paris is sunny today.", 1),  # text: the constraint retires at its first token
    ("  It depends.", 2),  # (its first token, the two spaces, may still open one)
    ('{"temperature": 17}', 2),  # a JSON answer whose first key is not "name"
    ("```python\nprint(1)\n```", 3),
    # Issue 61: the user asked for this JSON and a bare {"name" forced a get_weather call; now a
    # "name" that is none of the tools' is text (the constraint retires within "Bob").
    ('{"name": "Bob", "age": 30}', 6),
    ('```json\n{"name": "Bob", "age": 30}\n```', 9),
])
def test_under_auto_text_is_free_and_the_constraint_retires(smollm, text, left):
    """tool_choice auto (llama.cpp's lazy grammar): text that cannot open a call passes whole,
    and once the text rules a call out the constraint retires (no mask: every token allowed)."""
    grammar = chat({"tools": TOOLS}).options.grammar
    ids = smollm.tokenize(text, add_special=False)
    c = GrammarConstraint(grammar, smollm)
    assert c.valid_prefix(ids) == len(ids) and not c.retired
    assert c.mask(ids[:left]).all()  # drafts past the point where a call is ruled out: no mask
    c.commit(ids)
    assert c.retired and c.accepting and c.mask().all() and c.valid_prefix([0, 1, 2]) == 3


@pytest.mark.parametrize("text", [CALL, CALL + "\n" + CALL2, FENCED_CALL, FENCED_CALL.replace("json", "xml", 1),
                                  '{"name": "get_time", "arguments": {"tz": "UTC"}}'])
def test_under_auto_an_opened_call_is_constrained_to_the_tools(smollm, text):
    grammar = chat({"tools": TOOLS}).options.grammar
    ids = smollm.tokenize(text, add_special=False)
    c = GrammarConstraint(grammar, smollm)
    assert c.valid_prefix(ids) == len(ids)
    c.commit(ids)
    assert not c.retired and c.accepting  # a whole call: the end may come
    assert parse(text)[1], text  # and the parser reads it as one
    other = text.replace("get_weather", "get_news").replace("get_time", "get_news")
    if not text.startswith("<tool_call>"):  # an object naming no tool is no call: text (issue 61), and free
        ids = smollm.tokenize(other, add_special=False)
        assert GrammarConstraint(grammar, smollm).valid_prefix(ids) == len(ids) and not parse(other)[1], other
    for bad in ((other,) if text.startswith("<tool_call>") else ()) + (  # the tag opens a call: no such tool
                text.replace('"celsius"', '"kelvin"').replace('"UTC"', "5"),  # arguments off the schema
                text + " Then some text."):  # nothing after the call but another call
        if bad == text:
            continue
        ids = smollm.tokenize(bad, add_special=False)
        assert GrammarConstraint(grammar, smollm).valid_prefix(ids) < len(ids), bad
    cut = GrammarConstraint(grammar, smollm)
    cut.commit(smollm.tokenize(text[:-4], add_special=False))
    assert not cut.accepting  # an unfinished call may not end


def test_under_auto_a_schema_llguidance_cannot_compile_constrains_nothing(smollm):
    broken = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}]
    c = GrammarConstraint(chat({"tools": broken}).options.grammar, smollm)
    assert c.retired and c.mask().all() and c.valid_prefix([1, 2, 3]) == 3


def test_under_auto_speculation_keeps_plain_decodings_answer(smollm_path):
    """The lazy grammar under speculation and in plain decoding: the same greedy text, where
    the model answers text (the constraint retires) and where it is asked for a call."""
    import specdecode

    with specdecode.Decoder(target=str(smollm_path), draft="ngram", num_speculative_tokens=4, n_ctx=1024,
                            progress=False) as dec:
        for messages in (ASK, [{"role": "user", "content": "Reply with exactly this JSON and nothing else: "
                                                            '{"name": "get_time", "arguments": {"tz": "UTC"}}'}]):
            req = chat({"tools": TOOLS, "messages": messages, "temperature": 0, "max_tokens": 48})
            ids = dec.prompt_ids(messages=messages)
            spec = dec.generate(prompt_ids=ids, options=req.choice_options(0, 48))
            plain = dec.generate(prompt_ids=ids, options=req.choice_options(0, 48), draft="none")
            assert spec.token_ids == plain.token_ids, (spec.text, plain.text)


def test_a_schema_the_grammar_cannot_compile_is_named_by_its_tool(smollm):
    """Issue 61: the error named ``tools`` and quoted the internal Lark grammar; the tool's own
    schema, compiled alone, names ``tools[i].function.parameters`` (the server does this where
    the tools' grammar fails: the qwen round trip below sends it over HTTP)."""
    from specdecode.grammar import check_grammar

    broken = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}]
    req = chat({"tools": broken, "tool_choice": "required"})
    with pytest.raises(SpecDecodeError) as e:
        check_grammar(req.options.grammar, smollm)
    assert e.value.param == "tools"  # the whole grammar fails: which tool is not known from it
    with pytest.raises(SpecDecodeError) as e:
        req.tools.check_schemas(smollm)
    assert e.value.param == "tools[1].function.parameters" and "cannot be compiled" in str(e.value)
    assert "%json" not in str(e.value) and "fn_0" not in str(e.value)
    chat({"tools": TOOLS, "tool_choice": "required"}).tools.check_schemas(smollm)  # good schemas pass


def test_constrained_generation_gives_calls_valid_for_the_schema(smollm_path):
    """A small model that was never taught the format, sampled, forced by the grammar under
    speculation: every answer parses into calls whose arguments the schema accepts."""
    import specdecode

    schema = {**WEATHER, "properties": {**WEATHER["properties"], "city": {"type": "string", "maxLength": 24}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}, TOOLS[1]]
    req = chat({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "temperature": 0.8, "seed": 11, "max_tokens": 80})
    with specdecode.Decoder(target=str(smollm_path), draft="ngram", num_speculative_tokens=4, n_ctx=1024,
                            progress=False) as dec:
        ids = dec.prompt_ids(messages=ASK)
        for i in range(2):  # two seeds (choices 0 and 1)
            res = dec.generate(prompt_ids=ids, options=req.choice_options(i, 80))
            assert res.finish_reason == "stop", res.text
            content, calls = parse_message(res.text, req.tools.parser())
            assert content is None and len(calls) == 1, res.text
            assert calls[0]["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)


def test_the_torch_backend_passes_tools_to_the_tokenizers_template():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    from specdecode.backends.torch import TorchBackend

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token="</s>")
    tok.chat_template = ("{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
                         "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}CALL {{ c.function.arguments "
                         "| tojson }}{% endfor %}\n{% endfor %}")
    fake = SimpleNamespace(tokenizer=tok, name="t")
    fake.chat_template = TorchBackend.chat_template.fget(fake)
    text = TorchBackend.apply_chat_template(fake, template_messages(check_messages(FOLLOW_UP[:2])), tools=TOOLS)
    assert text.startswith("TOOL get_weather\nTOOL get_time\nuser: ")
    assert 'CALL {"city": "Paris", "unit": "celsius"}' in text
    assert "TOOL" not in TorchBackend.apply_chat_template(fake, check_messages(ASK))


# --- the default target: its template, and a round trip through the openai client ----------

QWEN = "qwen2.5-coder-1.5b-instruct"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Call a tool when it helps; answer from tool "
                                       "results in plain words."}


@pytest.fixture(scope="module")
def qwen():
    import specdecode

    with specdecode.Decoder(target=QWEN, draft="ngram", num_speculative_tokens=4, n_ctx=2048, progress=False) as dec:
        yield dec


@pytest.mark.qwen
def test_the_qwen_template_renders_tools_and_the_follow_up(qwen):
    assert tool_call_format(qwen.target.chat_template) is HERMES
    first = qwen.target.apply_chat_template(template_messages(check_messages(ASK)), tools=TOOLS)
    assert "# Tools" in first and '"name": "get_weather"' in first and "Get the current weather in a city" in first
    assert "<tools>" in first and first.endswith("<|im_start|>assistant\n")
    assert "# Tools" not in qwen.target.apply_chat_template(check_messages(ASK))
    follow = qwen.target.apply_chat_template(template_messages(check_messages(FOLLOW_UP)), tools=TOOLS)
    # The call as the model writes it (arguments an object, not a quoted string), the result as a tool_response.
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": ' \
           '"celsius"}}\n</tool_call><|im_end|>' in follow
    assert '<tool_response>\n{"temperature": 17, "condition": "sunny"}\n</tool_response>' in follow
    assert len(qwen.prompt_ids(messages=FOLLOW_UP, tools=TOOLS)) > len(qwen.prompt_ids(messages=FOLLOW_UP))


@pytest.mark.qwen
def test_a_tool_round_trip_through_the_openai_client(qwen):
    """tool_choice required on the default target: the call's arguments parse and match the
    schema, streamed (pieces joined) as unstreamed; then the tool's result goes back and the
    answer uses it. Bad tool fields answer 400 over HTTP."""
    with ServerThread(create_app(qwen, warmup=False)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        ask = dict(model=QWEN, messages=[SYSTEM, *ASK], tools=TOOLS, tool_choice="required", temperature=0,
                   max_tokens=80)
        r = client.chat.completions.create(**ask)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, WEATHER)
        assert args["city"] == "Paris" and args["unit"] == "celsius"

        chunks = list(client.chat.completions.create(**ask, stream=True))
        content, calls, finish = join_stream([c.model_dump(exclude_none=True) for c in chunks])
        assert finish == "tool_calls" and content is None
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [("get_weather", call.function.arguments)]
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.tool_calls) > 2  # arguments in pieces

        weather = {"city": "Paris", "temperature": 17, "unit": "celsius", "condition": "sunny"}
        follow = [SYSTEM, *ASK, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps(weather)}]
        answer = client.chat.completions.create(model=QWEN, messages=follow, tools=TOOLS, temperature=0,
                                                max_tokens=60).choices[0]
        assert answer.message.tool_calls is None and answer.finish_reason == "stop", answer
        assert "17" in answer.message.content, answer.message.content

        with httpx.Client(base_url=server.url, timeout=60) as http:
            bad = http.post("/v1/chat/completions", json={"model": QWEN, "messages": ASK, "tools": [
                TOOLS[0], {"type": "function", "function": {"name": "bad name"}}]})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[1].function.name", bad.text
            bad = http.post("/v1/chat/completions", json={"model": QWEN, "messages": ASK, "tools": TOOLS,
                                                          "tool_choice": {"type": "function",
                                                                          "function": {"name": "get_news"}}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice.function.name", bad.text
            broken = {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}
            bad = http.post("/v1/chat/completions", json={"model": QWEN, "messages": ASK, "tools": [TOOLS[0], broken],
                                                          "tool_choice": "required"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[1].function.parameters", bad.text
            assert "%json" not in bad.text and "start:" not in bad.text
