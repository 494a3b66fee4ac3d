"""The Responses API (``POST /v1/responses``, issue 34): the translation of its requests onto
chat (errors naming the Responses fields), the response object and its stream of events as the
openai client reads them, function calls both ways, the store behind ``previous_response_id``,
``context_length`` in the model cards, and ``speculative.strict`` / ``serve --strict``.

The HTTP tests run a real server (uvicorn on loopback) around a scripted text model of bytes
that answers a fixed text (a tool call when tools are given), so they judge what the clients
read, never the wall clock. The real clients against a real ``specdecode serve`` are
tests/test_clients.py; strict mode's numerics on a real model are tests/test_strict.py.
"""

from __future__ import annotations

import json
from typing import Sequence

import httpx
import openai
import pytest

from specdecode.api import Decoder
from specdecode.server import create_app
from specdecode.server.apierror import APIError
from specdecode.server.protocol import parse_request
from specdecode.server.responses_api import ResponseStore, input_messages, parse_responses
from specdecode.server.toolcalls import HermesFormat

from test_server import ServerThread
from test_server_access import ByteBackend

MODEL = "script"
EOS = 256
ANSWER = b"Hello there, friend."
CALL = b'<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


class ScriptBackend(ByteBackend):
    """The byte model of tests/test_server_access.py, scripted otherwise: its greedy answer
    after the last "assistant:" is ANSWER, or CALL when the prompt presents tools, and its
    chat template teaches Hermes tool calls. ``prompts`` records every prompt it rendered."""

    chat_template = "{{ messages }} <tool_call> (Hermes)"

    def __init__(self, n_ctx: int = 4096) -> None:
        super().__init__(n_ctx)
        self.name = MODEL
        self.prompts: list[str] = []

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        lines = [f"{m['role']}: {m.get('content') or ''}{json.dumps(m.get('tool_calls')) if m.get('tool_calls') else ''}"
                 for m in messages]
        text = ("tools: " + ",".join(t["function"]["name"] for t in tools) + "\n" if tools else "") + \
            "\n".join(lines) + "\nassistant:"
        self.prompts.append(text)
        return text

    def _next(self, upto: int) -> int:
        text = bytes(t for t in self.tokens[:upto] if t < EOS)
        start = text.rfind(b"assistant:") + len(b"assistant:")
        answer = CALL if text.startswith(b"tools: ") else ANSWER
        i = upto - start
        return answer[i] if i < len(answer) else EOS


@pytest.fixture(scope="module")
def backend():
    return ScriptBackend()


@pytest.fixture(scope="module")
def server(backend):
    dec = Decoder(target=backend, draft="ngram", num_speculative_tokens=4, progress=False)
    with ServerThread(create_app(dec, max_queue=4)) as s:
        yield s
    dec.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def refused(http: httpx.Client, body: dict, param: str, status: int = 400) -> str:
    r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


# ------------------------------------------------------------------ the translation, pure


def test_input_items_become_the_chat_conversation():
    messages, origin = input_messages([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny and rain.", "annotations": []}]},
    ])
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Sunny and rain."},
    ]
    assert origin == ["input[0]", "input[1]", "input[2]", "input[4]", "input[5]", "input[6]"]
    assert input_messages("hi") == ([{"role": "user", "content": "hi"}], ["input"])


def test_a_request_runs_as_the_chat_request_it_translates_to():
    store = ResponseStore()
    rr = parse_responses({"model": MODEL, "input": "hi", "instructions": "Be brief.", "max_output_tokens": 9,
                          "temperature": 0, "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"},
                          "speculative": {"draft": "ngram"}, "store": False}, MODEL, 512, HermesFormat(), store)
    chat = parse_request({"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "hi"}],
                          "max_tokens": 9, "temperature": 0, "speculative": {"draft": "ngram"},
                          "tools": [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}],
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                         "chat", MODEL, 512, HermesFormat())
    assert rr.req.messages == chat.messages and rr.req.max_tokens == 9 and rr.req.options == chat.options
    assert rr.req.tools.tools == chat.tools.tools and rr.req.tools.name == "get_weather" and not rr.store
    assert rr.history == [{"role": "user", "content": "hi"}]  # instructions are not carried on
    json_rr = parse_responses({"model": MODEL, "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}}}, MODEL, 512, None, store)
    assert json_rr.req.options.grammar is not None and json_rr.echo["text"]["format"]["name"] == "p"


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": ["hi", {"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "nope", "output": "x"}]},
     "input[1].tool_call_id"),
    ({"input": []}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "hi", "store": "yes"}, "store"),
    ({"input": "hi", "metadata": {"k": 3}}, "metadata"),
    ({"input": "hi", "speculative": {"strict": "yes"}}, "speculative.strict"),
    ({}, "input"),
])
def test_refusals_name_the_responses_field(body, param):
    with pytest.raises(APIError) as e:
        parse_responses({"model": MODEL, **body}, MODEL, 512, HermesFormat(), ResponseStore())
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    assert "messages" not in e.value.message and "max_tokens" not in e.value.message, e.value.message


def test_the_store_is_bounded():
    store = ResponseStore(max_responses=3, max_bytes=100)
    for i in range(5):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x" * 10}])
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 95}])  # 95 + 10 > 100: r2..r4 make room
    assert store.get("big") is not None and store.get("r3") is None
    assert store.delete("big") and not store.delete("big")


# ------------------------------------------------------------------ over HTTP, with the openai client


def test_a_response_whole_and_streamed_as_the_client_reads_them(client):
    whole = client.responses.create(model=MODEL, input="hi", instructions="Be kind.", temperature=0,
                                    metadata={"run": "1"})
    assert whole.status == "completed" and whole.output_text == ANSWER.decode()
    assert whole.output[0].type == "message" and whole.output[0].content[0].type == "output_text"
    assert whole.usage.output_tokens == len(ANSWER) and whole.usage.total_tokens == whole.usage.input_tokens + len(ANSWER)
    assert whole.instructions == "Be kind." and whole.metadata == {"run": "1"} and whole.temperature == 0
    with client.responses.stream(model=MODEL, input="hi", instructions="Be kind.", temperature=0) as stream:
        events = [e for e in stream]
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == ANSWER.decode() == final.output_text and len(deltas) > 1
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {final.output[0].id}
    assert final.model_dump(exclude={"id", "created_at", "output", "speculation"}) == \
        whole.model_dump(exclude={"id", "created_at", "output", "speculation", "metadata"}) | {"metadata": {}}


def test_max_output_tokens_ends_incomplete(client):
    r = client.responses.create(model=MODEL, input="hi", temperature=0, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == ANSWER[:5].decode()
    with client.responses.stream(model=MODEL, input="hi", temperature=0, max_output_tokens=5) as stream:
        kinds = [e.type for e in stream]
    assert kinds[-1] == "response.incomplete"


def test_function_calls_round_trip_through_the_store(client, backend):
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and first.status == "completed"
    second = client.responses.create(model=MODEL, previous_response_id=first.id, temperature=0, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert second.output_text == ANSWER.decode() and second.previous_response_id == first.id
    prompt = backend.prompts[-1]  # the whole conversation, the stored call included
    assert "user: Weather in Paris?" in prompt and call.call_id in prompt and "tool: sunny, 21 C" in prompt
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=TOOLS, temperature=0) as stream:
        events = [e for e in stream]
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * (len(kinds) - 6),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"} and done.name == "get_weather"
    assert final.output[0].call_id == events[2].item.call_id and final.output[0].status == "completed"


def test_stored_responses_are_read_and_deleted(client, http):
    r = client.responses.create(model=MODEL, input="hi", temperature=0)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=MODEL, input="hi", temperature=0, store=False)
    assert http.get(f"/v1/responses/{unstored.id}").status_code == 404
    msg = refused(http, {"input": "hi", "previous_response_id": unstored.id}, "previous_response_id")
    assert unstored.id in msg and "store" in msg


def test_errors_found_later_name_the_responses_field(http):
    msg = refused(http, {"input": "x" * 5000, "max_output_tokens": 10}, "input")
    assert "context" in msg
    refused(http, {"input": "hi", "model": "other"}, "model", status=404)
    refused(http, {"input": "hi", "max_output_tokens": 4095}, "max_output_tokens")


def test_models_give_context_length(client, http):
    card = http.get("/v1/models").json()["data"][0]
    assert card["context_length"] == card["max_model_len"] == 4096
    assert client.models.retrieve(MODEL).model_dump()["context_length"] == 4096


def test_strict_is_asked_per_request_and_by_the_server(backend, client, http):
    loose = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                    "temperature": 0}).json()
    strict = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                     "temperature": 0, "speculative": {"strict": True}}).json()
    assert loose["speculation"]["strict"] is False and strict["speculation"]["strict"] is True
    assert strict["speculation"]["invariant_block"] >= 1 and loose["choices"][0]["message"] == \
        strict["choices"][0]["message"]
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "speculative": {"strict": True}}).json()
    assert r["speculation"]["strict"] is True
    dec = Decoder(target=ScriptBackend(), draft="ngram", num_speculative_tokens=4, progress=False)
    with ServerThread(create_app(dec, strict=True)) as s, httpx.Client(base_url=s.url, timeout=60) as h:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        assert h.post("/v1/chat/completions", json=body).json()["speculation"]["strict"] is True
        opt_out = {**body, "speculative": {"strict": False}}
        assert h.post("/v1/chat/completions", json=opt_out).json()["speculation"]["strict"] is False
    dec.close()
