"""What other agents send (issue 59, item 4), each as the agent sends it, on Chat Completions
through the openai client against a real server (uvicorn on loopback) around
tests/test_server_responses.py's scripted byte model (its answer is a Hermes tool call when
tools are given): Roo Code's ``parallel_tool_calls: false``, Goose's tool schemas without
``type`` or with only ``required`` (llama.cpp answers 500), a model name the server does not
serve for side calls (``--served-model-name`` aliases), and ``system`` messages mid
conversation, merged into the first where the chat template refuses them (and kept in place
where it takes them). Judged on what the client reads, never the clock.
"""

from __future__ import annotations

import json
from typing import Sequence

import openai
import pytest

from specdecode.api import Decoder
from specdecode.errors import SpecDecodeError
from specdecode.server import create_app
from specdecode.server.protocol import parse_request
from specdecode.server.toolcalls import HermesFormat

from test_server import ServerThread
from test_server_responses import ANSWER, MODEL, ScriptBackend

ASK = [{"role": "user", "content": "Weather in Paris?"}]


def tool(parameters: dict | None) -> dict:
    fn = {"name": "get_weather", "description": "The weather of a city"}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


class FirstSystemOnly(ScriptBackend):
    """The scripted model with a chat template that, like many, takes a system message only
    first (its raise_exception); ``rendered`` keeps what it rendered."""

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        if any(m["role"] == "system" for m in messages[1:]):
            raise SpecDecodeError("the chat template rejected the messages: System role only first")
        return super().apply_chat_template(messages, tools)


@pytest.fixture(scope="module", params=["in place", "first only"])
def setup(request):
    backend = ScriptBackend() if request.param == "in place" else FirstSystemOnly()
    dec = Decoder(target=backend, draft="ngram", num_speculative_tokens=4, progress=False)
    with ServerThread(create_app(dec, max_queue=4, served_model_names=("claude-haiku-4-5",))) as s:
        yield backend, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    dec.close()


def test_roo_codes_parallel_tool_calls_false_gives_one_call(setup):
    _, client = setup
    req = parse_request({"model": MODEL, "messages": ASK, "tools": [tool(WEATHER)], "tool_choice": "required",
                         "parallel_tool_calls": False}, "chat", MODEL, 4096, HermesFormat())
    assert req.tools.parallel is False
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool(WEATHER)], tool_choice="required",
                                         parallel_tool_calls=False, temperature=0)
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == {"city": "Paris"}


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("parameters", [{"required": ["city"]}, {"properties": {"city": {"type": "string"}}},
                                        {}, None], ids=["only required", "no type", "empty", "absent"])
def test_gooses_schemas_without_type_are_served(setup, parameters):
    _, client = setup
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool(parameters)], tool_choice="required",
                                         temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    if parameters is not None:  # (no parameters: the call takes none)
        assert args == {"city": "Paris"}


def test_a_side_calls_model_name_is_an_alias(setup):
    _, client = setup
    out = client.chat.completions.create(model="claude-haiku-4-5", messages=ASK, temperature=0)
    assert out.model == MODEL and out.choices[0].message.content == ANSWER.decode()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="claude-opus-4", messages=ASK)


def test_system_messages_mid_conversation(setup):
    backend, client = setup
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "Hello."}, {"role": "system", "content": "Now answer in French."},
             {"role": "user", "content": "again"}]
    out = client.chat.completions.create(model=MODEL, messages=convo, temperature=0)
    assert out.choices[0].message.content == ANSWER.decode()
    prompt = backend.prompts[-1]
    if isinstance(backend, FirstSystemOnly):  # merged into the first system message, in order
        assert prompt.startswith("system: Be brief.\n\nNow answer in French.\nuser: hi\nassistant: Hello.\nuser: again")
    else:  # kept where it was: the earlier turns stay the cached prefix
        assert "assistant: Hello.\nsystem: Now answer in French.\nuser: again" in prompt


def test_a_schema_keyword_llguidance_lacks_keeps_the_other_tools_constrained():
    """Claude Code's TaskCreate schema has ``propertyNames``, which llguidance does not
    implement: compiled strictly it failed the whole lazy grammar, and every call of every tool
    went unconstrained (a Grep call without its required ``pattern`` reached Claude Code).
    Compiled leniently, the keyword constrains nothing and the rest still holds."""
    from specdecode.grammar import Grammar, GrammarConstraint, check_grammar
    from specdecode.errors import SpecDecodeError

    backend = ScriptBackend()
    task = {"type": "object", "properties": {"subject": {"type": "string"}, "metadata": {
        "type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {}}},
            "required": ["subject"], "additionalProperties": False}
    with pytest.raises(SpecDecodeError, match="propertyNames"):  # the negative control: strictly, no grammar
        check_grammar(Grammar.json_schema(task), backend)
    tools = [tool(WEATHER), {"type": "function", "function": {"name": "TaskCreate", "parameters": task}}]
    req = parse_request({"model": MODEL, "messages": ASK, "tools": tools}, "chat", MODEL, 4096, HermesFormat())
    constraint = GrammarConstraint(req.options.grammar, backend)
    assert not constraint.retired

    def allowed(text: str) -> bool:
        ids = backend.tokenize(text)
        return GrammarConstraint(req.options.grammar, backend).valid_prefix(ids) == len(ids)

    assert allowed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert not allowed('<tool_call>\n{"name": "get_weather", "arguments": {"query": "Paris"}}\n</tool_call>')
    assert allowed('<tool_call>\n{"name": "TaskCreate", "arguments": {"subject": "a", "metadata": {"k": 1}}}\n</tool_call>')
    assert not allowed('<tool_call>\n{"name": "TaskCreate", "arguments": {"title": "a"}}\n</tool_call>')
