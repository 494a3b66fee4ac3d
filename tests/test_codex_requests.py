"""Codex CLI's requests against ``POST /v1/responses`` (issue 46, items 1 and 8).

tests/data/codex_0.171.0_requests.json holds the bodies Codex CLI 0.171.0 (npm
``@openai/codex``, ``codex exec --json``) sent to a stub Responses server on one task: the
first turn, and the turn after its ``exec_command`` call ran (a ``function_call`` and a
``function_call_output`` item). Codex builds them in openai/codex
``codex-rs/codex-api/src/common.rs`` (``ResponsesApiRequest``: model, instructions, input,
tools, tool_choice, parallel_tool_calls, reasoning, store, stream, include, service_tier,
prompt_cache_key, text, client_metadata). Its long input texts (the developer prompt) are
cut and its ids replaced; every field and tool is as sent: ``reasoning: {"summary":
"auto"}``, ``include: ["reasoning.encrypted_content"]``, ``client_metadata``, a ``namespace``
tool (``multi_agent_v1``) and a hosted ``web_search``.

The replay runs a real server around the scripted byte model of tests/test_server_responses.py,
so it judges what the server answers and what reaches the prompt, never the wall clock.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from specdecode.api import Decoder
from specdecode.server import create_app
from specdecode.server.apierror import APIError
from specdecode.server.responses_api import ResponseStore, parse_responses
from specdecode.server.responses_tools import tool_set
from specdecode.server.toolcalls import HermesFormat

from test_server import ServerThread
from test_server_responses import EOS, MODEL, ScriptBackend

CAPTURE = json.loads((Path(__file__).parent / "data" / "codex_0.171.0_requests.json").read_text())
FIRST, AFTER_CALL = CAPTURE["turns"]
EXEC = b'<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'
SPAWN = b'<tool_call>\n{"name": "spawn_agent", "arguments": {"message": "hi"}}\n</tool_call>'
DONE = b"The repository holds calc.py."
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {
        "message": {"type": "string"}}, "required": ["message"]}},
    {"type": "custom", "name": "freeform"}]}


class AgentBackend(ScriptBackend):
    """Calls ``exec_command`` (``spawn_agent`` when the prompt offers it and no exec_command)
    until a tool's output is in the conversation, then answers DONE. Codex sends no
    temperature, so the server samples at 1: the scripted byte's logit is 100 rather than the
    byte model's 10, whose 256 rivals would take one byte in a hundred."""

    def forward(self, token_ids, logits_for, seq: int = 0):
        return super().forward(token_ids, logits_for, seq) * 10

    def _next(self, upto: int) -> int:
        text = bytes(t for t in self.tokens[:upto] if t < EOS)
        start = text.rfind(b"assistant:") + len(b"assistant:")
        tools = text.split(b"\n", 1)[0] if text.startswith(b"tools: ") else b""
        call = EXEC if b"exec_command" in tools else SPAWN
        answer = DONE if b"\ntool: " in text or not tools else call
        i = upto - start
        return answer[i] if i < len(answer) else EOS


@pytest.fixture(scope="module")
def backend():
    return AgentBackend(n_ctx=16384)


@pytest.fixture(scope="module")
def server(backend):
    dec = Decoder(target=backend, draft="ngram", num_speculative_tokens=4, progress=False)
    with ServerThread(create_app(dec, max_queue=4)) as s:
        yield s
    dec.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def events(r: httpx.Response) -> list[dict]:
    """A stream's events, each checked to name its own type."""
    out = []
    for block in r.text.split("\n\n"):
        if block.strip():
            name, data = block.split("\n", 1)
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            out.append(event)
    return out


def codex_turn(http: httpx.Client, body: dict) -> dict:
    """POST a Codex body (model renamed to the served one) as Codex does; the completed response."""
    r = http.post("/v1/responses", json={**body, "model": MODEL}, headers={"accept": "text/event-stream"})
    assert r.status_code == 200, r.text
    stream = events(r)
    kinds = [e["type"] for e in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    return stream[-1]["response"]


def test_codex_first_turn_is_accepted_and_its_tools_reach_the_prompt(http, backend):
    response = codex_turn(http, FIRST)
    prompt = backend.prompts[-1]
    offered = prompt.split("\n", 1)[0].removeprefix("tools: ").split(",")
    functions = [t["name"] for t in FIRST["tools"] if t["type"] == "function"]
    members = [t["name"] for t in FIRST["tools"] if t["type"] == "namespace" for t in t["tools"]]
    assert offered == functions[:4] + members + functions[4:], offered  # in the request's order
    assert "You are a coding agent running in the Codex CLI" in prompt  # the developer message
    assert response["tools_left_out"] == [{"tool": "tools[8]", "type": "web_search"}]
    assert response["tools"] == FIRST["tools"] and response["store"] is False
    assert response["reasoning"] == {"effort": None, "summary": None}
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    [call] = response["output"]
    assert call["type"] == "function_call" and call["name"] == "exec_command" and "namespace" not in call
    assert json.loads(call["arguments"]) == {"cmd": "ls"}


def test_codex_turn_after_a_call_is_accepted_and_carries_the_output(http, backend):
    response = codex_turn(http, AFTER_CALL)
    prompt = backend.prompts[-1]
    assert '"name": "exec_command"' in prompt and "tool: Chunk ID:" in prompt and "calc.py" in prompt
    [message] = response["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == DONE.decode()


def test_namespace_members_are_called_by_their_own_name_and_namespace(http, backend, server):
    """A call of a namespace's member comes back with its namespace, whole and streamed (Codex
    dispatches on both), and the next turn's function_call with that namespace reads back."""
    body = {"model": MODEL, "input": "Ask a sub-agent.", "tools": [NAMESPACE, {"type": "web_search"}]}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    whole = client.responses.create(**body)
    assert backend.prompts[-1].startswith("tools: spawn_agent\n")
    [call] = whole.output
    assert (call.type, call.name, call.namespace) == ("function_call", "spawn_agent", "multi_agent_v1")
    assert whole.model_extra["tools_left_out"] == [{"tool": "tools[0].tools[1]", "type": "custom"},
                                                   {"tool": "tools[1]", "type": "web_search"}]
    with client.responses.stream(**body) as stream:
        done = [e.item for e in stream if e.type == "response.output_item.done"]
    assert [(i.name, i.namespace) for i in done] == [("spawn_agent", "multi_agent_v1")]
    follow = http.post("/v1/responses", json={**body, "input": [
        {"role": "user", "content": "Ask a sub-agent."},
        {"type": "function_call", "call_id": call.call_id, "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "agent 7 started"}]})
    assert follow.status_code == 200, follow.text
    assert follow.json()["output"][0]["content"][0]["text"] == DONE.decode()
    assert '"name": "spawn_agent"' in backend.prompts[-1]


def test_a_member_whose_name_is_taken_is_shown_with_its_namespace():
    tools = tool_set([{"type": "function", "name": "spawn_agent"}, NAMESPACE])
    assert [t["function"]["name"] for t in tools.chat] == ["spawn_agent", "multi_agent_v1__spawn_agent"]
    assert tools.call_fields("multi_agent_v1__spawn_agent") == {"name": "spawn_agent", "namespace": "multi_agent_v1"}
    assert tools.call_fields("spawn_agent") == {"name": "spawn_agent"}
    assert tools.prompt_name("spawn_agent", "multi_agent_v1") == "multi_agent_v1__spawn_agent"
    assert tools.origin == ["tools[0]", "tools[1].tools[0]"]


@pytest.mark.parametrize("namespace", ["mcp.github", "n" * 64])
def test_a_clashing_member_of_any_namespace_gets_a_valid_distinct_name(namespace):
    """Issue 61: ``{namespace}__{name}`` over 64 characters, or with ".", was a 400 blaming a name
    the client never sent. Now a valid function name (cut, with a hash where too long) that
    reads back to both names."""
    body = [{"type": "function", "name": "run"},
            {"type": "namespace", "name": namespace, "tools": [{"type": "function", "name": "run"}]},
            {"type": "namespace", "name": namespace + "2", "tools": [{"type": "function", "name": "run"}]}]
    rr = parse_responses({"model": MODEL, "input": "hi", "tools": body, "tool_choice": "required"}, MODEL, 512,
                         HermesFormat(), ResponseStore())
    tools = tool_set(body)
    names = [t["function"]["name"] for t in tools.chat]
    assert len(set(names)) == 3 and all(len(n) <= 64 and re.fullmatch(r"[A-Za-z0-9_-]+", n) for n in names), names
    assert tools.call_fields(names[1]) == {"name": "run", "namespace": namespace}
    assert tools.prompt_name("run", namespace + "2") == names[2]
    assert rr.req.messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(APIError) as e:  # a clashing member's own bad name is named as the client sent it
        tool_set([{"type": "function", "name": "r un"},
                  {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "r un"}]}])
    assert e.value.param == "tools[1].tools[0].name" and e.value.message.endswith('got "r un"')


@pytest.mark.parametrize("fields", [
    {"reasoning": {"effort": "high", "summary": "detailed"}},
    {"reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content", "file_search_call.results"]},
    {"client_metadata": {"session_id": "s"}},
    {"reasoning": {"generate_summary": "none"}},  # issue 61: documented, and refused
])
def test_what_changes_nothing_here_is_accepted(fields):
    rr = parse_responses({"model": MODEL, "input": "hi", **fields}, MODEL, 512, HermesFormat(), ResponseStore())
    assert rr.req.messages == [{"role": "user", "content": "hi"}]
    assert "client_metadata" not in rr.echo  # read, not echoed


def test_forcing_a_left_out_tool_is_refused():
    with pytest.raises(APIError) as e:
        parse_responses({"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}],
                         "tool_choice": {"type": "web_search"}}, MODEL, 512, HermesFormat(), ResponseStore())
    assert e.value.param == "tool_choice" and "tools[0]" in e.value.message
