"""Anthropic's Messages API on ``specdecode serve`` (issue 59): the translation of its bodies
onto chat (system blocks and Claude Code's billing line, system entries in messages, tool_use
and tool_result blocks, tool_choice, max_tokens past the context, refused images, errors in
the Messages field names), and the real ``anthropic`` SDK against a real server (uvicorn on
loopback) around tests/test_server_responses.py's scripted byte model (a fixed answer, a
Hermes tool call when tools are given): create, stream, count_tokens, a tool call and its
result turn, the key as x-api-key or Bearer, errors as the SDK's own classes, and the cached
prefix of a session's second turn. Judged on what the client reads and counts, never the clock.
The same SDK against the real small model is tests/test_clients_anthropic.py.
"""

from __future__ import annotations

import contextlib
import json
import logging

import anthropic
import httpx
import pytest

from specdecode.api import Decoder
from specdecode.server import create_app
from specdecode.server.anthropic import BILLING_HEADER, chat_messages, parse_messages, system_text
from specdecode.server.apierror import APIError
from specdecode.server.toolcalls import HermesFormat

from test_server import ServerThread
from test_server_responses import ANSWER, CALL, MODEL, ScriptBackend

KEY = "sk-test-key"
N_CTX = 4096
WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
HI = [{"role": "user", "content": "hi"}]
# The SDK calls ask temperature 0 (the 2026 SDK has no parameter for it: extra_body): the
# default, 1, samples, and the scripted model's fixed answer is only its most likely text.
GREEDY = {"temperature": 0}


@contextlib.contextmanager
def caplog_at(level: int):
    """The lines the server's logger ("specdecode.server") writes meanwhile."""
    lines: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("specdecode.server")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def parse(body: dict, **kw):
    return parse_messages({"model": MODEL, "max_tokens": 64, **body}, MODEL, N_CTX, HermesFormat(), **kw)


def refused(body: dict, param: str, status: int = 400) -> str:
    with pytest.raises(APIError) as e:
        parse(body)
    assert (e.value.status, e.value.param) == (status, param), e.value.message
    return e.value.message


# ------------------------------------------------------------------ the translation, pure

def test_system_blocks_join_and_the_billing_line_is_left_out():
    billing = f"{BILLING_HEADER}: cc_version=2.1.197; cc_entrypoint=sdk-cli; cch=4f2a1;"
    system = [{"type": "text", "text": billing}, {"type": "text", "text": "You are Claude Code.",
                                                  "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Be brief."}]
    assert system_text(system) == "You are Claude Code.\n\nBe brief."
    assert system_text("Plain.") == "Plain."
    assert system_text([{"type": "text", "text": billing}]) is None
    with pytest.raises(APIError) as e:
        system_text([{"type": "image"}])
    assert e.value.param == "system"


def test_blocks_become_the_chat_conversation():
    messages, origin = chat_messages("Sys.", [
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "...", "signature": "x"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "text", "text": "And Rome?"}]},
        {"role": "system", "content": "Mid-session reminder."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                                           "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "no such city"}]}]},
    ])
    assert messages == [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And Rome?"},
        {"role": "system", "content": "Mid-session reminder."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
    ]
    assert origin.messages == ["system", "messages[0]", "messages[1]", "messages[2].content[0]", "messages[2]",
                               "messages[3]", "messages[4]", "messages[5].content[0]"]
    assert origin.calls[2] == ["messages[1].content[2]"] and origin.calls[6] == ["messages[4].content[0]"]


def test_tool_choice_tools_and_limits():
    r = parse({"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "any"}}).req
    assert r.tools.choice == "required" and r.tools.names == ("get_weather",)
    r = parse({"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather",
                                                                   "disable_parallel_tool_use": True}}).req
    assert r.tools.name == "get_weather" and r.tools.parallel is False
    assert parse({"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "none"}}).req.tools is None
    assert parse({"messages": HI, "tools": [WEATHER]}).req.tools.choice == "auto"
    # A server tool (another type) is left out of the prompt; a choice without tools is no error.
    mr = parse({"messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                "tool_choice": {"type": "auto"}})
    assert mr.req.tools is None and mr.left_out == ["web_search"]
    # Claude Code asks 32000 tokens of a 4096-token context: served up to the context.
    r = parse({"messages": HI, "max_tokens": 32000}).req
    assert r.max_tokens == N_CTX and r.fit_context
    r = parse({"messages": HI, "stop_sequences": ["\n\nHuman:", ""], "temperature": 0, "top_k": 5,
               "metadata": {"user_id": "u"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
               "context_management": {"edits": []}, "output_config": {"effort": "low"},
               "some_future_beta_field": {"x": 1}}).req
    assert r.options.stop == ("\n\nHuman:",) and r.options.sampling.temperature == 0 and r.options.sampling.top_k == 5
    assert parse({"messages": HI}).req.options.sampling.temperature == 1.0  # Anthropic's default
    r = parse({"messages": HI, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}).req
    assert r.options.grammar is not None


def test_bad_bodies_name_the_messages_fields():
    assert "image" in refused({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
        "messages[0].content[0].type")
    refused({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0].type")
    refused({"messages": HI, "max_tokens": 0}, "max_tokens")
    refused({"messages": HI, "temperature": 1.5}, "temperature")
    refused({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role")
    refused({"messages": HI, "tools": [{"name": "f"}]}, "tools[0].input_schema")
    refused({"messages": HI, "tool_choice": {"type": "sometimes"}}, "tool_choice")
    refused({"messages": HI, "stop_sequences": "stop"}, "stop_sequences")
    refused({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope",
                                                        "content": "x"}]}]}, "messages[0].content[0].tool_use_id")
    refused({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                                            "input": {}}]}], "tools": [WEATHER],
             "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name")
    refused({"model": "claude-sonnet-4-5", "messages": HI}, "model", status=404)
    assert "must be a string" in refused({"model": 5, "messages": HI}, "model")
    assert "must be an integer >= 1, got 0" in refused({"messages": HI, "max_tokens": 0}, "max_tokens")
    assert "must be a number" in refused({"messages": HI, "temperature": "1"}, "temperature")
    assert "must be a message" in refused({"messages": ["hi"]}, "messages[0]")
    assert "must be a content block" in refused({"messages": [{"role": "user", "content": ["hi"]}]},
                                                "messages[0].content[0]")
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "x"}
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}
    refused({"messages": [use, {"role": "user", "content": [{**result, "is_error": "yes"}]}]},
            "messages[1].content[0].is_error")
    refused({"messages": [use, {"role": "user", "content": [{**result, "content": [{"type": "tool_use"}]}]}]},
            "messages[1].content[0].content[0].type")
    refused({"messages": HI, "tools": [{"type": 5}]}, "tools[0].type")
    refused({"messages": HI, "metadata": {"user_id": 5}}, "metadata")
    refused({"messages": HI, "tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema.type")
    # A duplicate tool_use id names its block; the chat check found it.
    again = {"role": "assistant", "content": [{"type": "text", "text": "again"}, use["content"][0]]}
    refused({"messages": [use, {"role": "user", "content": [result]}, again], "tools": [WEATHER]},
            "messages[2].content[1].id")


def test_errors_name_the_clients_tools_and_leave_its_values_alone():
    """A server tool left out before the chat check does not shift the index an error names;
    a value the client sent ("stop", "max_completion_tokens") is quoted as sent, not renamed."""
    web = {"type": "web_search_20250305", "name": "web_search"}
    message = refused({"messages": HI, "tools": [web, {"name": "bad name!", "input_schema": {}}]}, "tools[1].name")
    assert "tools[1].name" in message and "tools[0]" not in message
    stop = {"name": "stop", "input_schema": {"type": "object"}}
    message = refused({"messages": HI, "tools": [web, stop, stop]}, "tools[2].name")
    assert '"stop"' in message and "tools[1]" in message and "stop_sequences" not in message
    message = refused({"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "tool",
                                                                          "name": "max_completion_tokens"}},
                      "tool_choice.name")
    assert '"max_completion_tokens"' in message


# ------------------------------------------------------------------ the SDK against a server

@pytest.fixture(scope="module")
def backend():
    return ScriptBackend(n_ctx=N_CTX)


@pytest.fixture(scope="module")
def server(backend):
    dec = Decoder(target=backend, draft="ngram", num_speculative_tokens=4, progress=False)
    with ServerThread(create_app(dec, max_queue=4, api_key=KEY,
                                 served_model_names=("claude-haiku-4-5", "claude-sonnet-4-5"))) as s:
        yield s
    dec.close()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_create_answers_a_message_with_usage_and_speculation(client):
    msg = client.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=20000, system="Be brief.", messages=HI)  # > the context
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ANSWER.decode()
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.output_tokens == len(ANSWER)  # the end token is not counted
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0
    extra = msg.model_extra["speculation"]
    assert extra["completion_tokens"] == msg.usage.output_tokens


def test_a_short_max_tokens_and_a_stop_sequence_say_so(client):
    msg = client.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=5, messages=HI)
    assert msg.stop_reason == "max_tokens" and msg.content[0].text == ANSWER.decode()[:5]
    msg = client.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=64, messages=HI, stop_sequences=["there"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "there"
    assert msg.content[0].text == "Hello "


def test_a_stream_builds_the_same_message(client):
    whole = client.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=64, messages=HI)
    with client.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=64, messages=HI) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens


def test_the_event_sequence_is_anthropics(server):
    body = {"model": MODEL, "max_tokens": 64, "messages": HI, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json=body, headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_forced_tool_call_and_its_result_turn(client):
    msg = client.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=200, messages=[{"role": "user", "content": "Paris?"}],
                                 tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    with client.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=200, messages=[{"role": "user", "content": "Paris?"}],
                                tools=[WEATHER], tool_choice={"type": "any"}) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [{"city": "Paris"}]
    assert streamed.stop_reason == "tool_use"
    turn = [{"role": "user", "content": "Paris?"}, {"role": "assistant", "content": msg.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    answer = client.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=200, messages=turn, tools=[WEATHER],
                                    tool_choice={"type": "none"})
    assert answer.stop_reason == "end_turn" and answer.content[0].text == ANSWER.decode()


def test_a_call_cut_off_by_max_tokens_is_the_same_text_whole_and_streamed(client):
    """max_tokens ends the call inside its arguments: no tool_use block with made-up input in
    either answer, and the text is what the model wrote, nothing added."""
    body = dict(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Paris?"}], tools=[WEATHER],
                extra_body=GREEDY)
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    for msg in (whole, streamed):
        assert msg.stop_reason == "max_tokens" and [b.type for b in msg.content] == ["text"]
    assert whole.content[0].text == streamed.content[0].text
    assert CALL.decode().startswith(whole.content[0].text) and len(whole.content[0].text) > 40


def test_count_tokens_counts_the_prompt_as_read(client, backend):
    n = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=HI).input_tokens
    rendered = backend.apply_chat_template([{"role": "system", "content": "Be brief."}, *HI])
    assert n == len(rendered.encode())
    assert client.messages.count_tokens(model=MODEL, messages=HI, extra_body={"max_tokens": "x"}).input_tokens == \
        client.messages.count_tokens(model=MODEL, messages=HI).input_tokens  # count_tokens takes no max_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=HI, tools=[WEATHER]).input_tokens
    assert with_tools > client.messages.count_tokens(model=MODEL, messages=HI).input_tokens


def test_errors_are_the_sdks_own_classes(server, client):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=HI)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError), caplog_at(logging.WARNING) as log:
        client.messages.create(model="gpt-4o", max_tokens=8, messages=HI)
    # The server's log names what was asked for: what an operator maps with --served-model-name.
    assert any("404 /v1/messages" in line and '"gpt-4o"' in line for line in log)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": e.value.body["error"]["message"]}}
    assert "messages[0].content[0].type" in e.value.body["error"]["message"]
    r = httpx.post(server.url + "/v1/messages/nothing", json={}, headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_the_key_as_bearer_and_the_headers_claude_code_sends(server):
    headers = {"Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "anthropic-dangerous-direct-browser-access": "true"}
    r = httpx.post(server.url + "/v1/messages?beta=true", json={"model": MODEL, "max_tokens": 8, "messages": HI},
                   headers=headers)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": HI})
    assert r.status_code == 401 and r.json()["type"] == "error"
    body = {"model": MODEL, "max_tokens": 2, "messages": HI, "temperature": 0}
    # Both headers: either one right is enough; a wrong one is named; a header twice is refused.
    assert httpx.post(server.url + "/v1/messages", json=body,
                      headers={"x-api-key": KEY, "Authorization": "Bearer wrong"}).status_code == 200
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "wrong", "Authorization": "Basic x"})
    assert r.status_code == 401 and "x-api-key" in r.json()["error"]["message"]
    twice = httpx.Headers([("x-api-key", "wrong"), ("x-api-key", KEY)])
    r = httpx.post(server.url + "/v1/messages", json=body, headers=twice)
    assert r.status_code == 401 and "2 times" in r.json()["error"]["message"]


def test_served_model_names_are_aliases(client, server):
    for name in ("claude-haiku-4-5", "claude-sonnet-4-5"):
        assert client.messages.create(model=name, extra_body=GREEDY, max_tokens=4, messages=HI).model == MODEL
    models = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).json()["data"]
    assert [m["id"] for m in models] == [MODEL, "claude-haiku-4-5", "claude-sonnet-4-5"]  # as vLLM lists them


def test_a_changing_billing_line_keeps_the_second_turn_cached(client):
    """Claude Code's billing line changes every request: the second turn still reuses the
    first turn's prompt; a changing first system line that is no billing line does not
    (the negative control: the same request shape, a prefix that differs at its start)."""
    def turns(first_line: str, second_line: str) -> tuple[int, int, int]:
        system = [{"type": "text", "text": first_line}, {"type": "text", "text": "You are a coding agent. " * 20}]
        convo = [{"role": "user", "content": "Write a haiku about caches."}]
        one = client.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=64, system=system, messages=convo)
        system[0]["text"] = second_line
        convo += [{"role": "assistant", "content": one.content[0].text}, {"role": "user", "content": "Again."}]
        two = client.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=64, system=system, messages=convo)
        first = one.usage.input_tokens + one.usage.cache_read_input_tokens
        return first, two.usage.cache_read_input_tokens, two.usage.input_tokens

    first, cached, fresh = turns(f"{BILLING_HEADER}: cc_version=2.1; cch=aaaa1;", f"{BILLING_HEADER}: cc_version=2.1; cch=bbbb2;")
    assert cached >= first - 1 and fresh < 60  # the answer and "Again." with their markers
    first, cached, fresh = turns("session: cch=aaaa1;", "session: cch=bbbb2;")
    assert cached < 30 and fresh > first  # ("system: session: cch=" is shared)


# ------------------------------------------------------------------ llama.cpp's utility endpoints

def test_tokenize_detokenize_and_props(server):
    h = {"x-api-key": KEY}
    r = httpx.post(server.url + "/tokenize", json={"content": "hé"}, headers=h)
    assert r.json() == {"tokens": list("hé".encode())}
    r = httpx.post(server.url + "/tokenize", json={"content": "hé", "with_pieces": True}, headers=h).json()
    assert r["tokens"][0] == {"id": ord("h"), "piece": "h"} and r["tokens"][1]["piece"] == list("é".encode()[:1])
    assert httpx.post(server.url + "/detokenize", json={"tokens": list("hé".encode())}, headers=h).json() == \
        {"content": "hé"}
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [1, 10**9]}, headers=h)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    assert httpx.post(server.url + "/tokenize", json={"text": "x"}, headers=h).status_code == 400
    props = httpx.get(server.url + "/props", headers=h).json()
    assert props["default_generation_settings"]["n_ctx"] == N_CTX and props["n_ctx"] == N_CTX
    assert props["model_alias"] == MODEL and props["total_slots"] == 1
    assert props["chat_template"] == ScriptBackend.chat_template
    assert props["speculative"]["draft"] == "ngram" and props["speculative"]["n_max"] == 4
    assert props["default_generation_settings"]["params"]["speculative.n_max"] == 4
    assert httpx.get(server.url + "/props").status_code == 401  # behind the key like every route


# ------------------------------------------------------------------ the stream while a prompt is read

def test_pings_while_nothing_comes_and_an_error_ends_the_stream():
    """A stream sends a ping every keepalive_s while the job posts nothing (its prompt being
    read), then the events; a failure is an ``error`` event in Anthropic's shape, the last."""
    import asyncio
    from types import SimpleNamespace

    from specdecode.server.anthropic_events import MessageBuilder, MessagesStream
    from specdecode.server.jobs import Delta, Failed
    from specdecode.server.runner import write_stream

    mr = parse({"messages": HI, "stream": True})
    writer = MessagesStream(MessageBuilder(mr, MODEL, lambda r: {}), n_prompt=10)
    writer.keepalive_s = 0.01

    async def go() -> list[str]:
        job = SimpleNamespace(events=asyncio.Queue())
        loop = asyncio.get_running_loop()
        # The first event comes after 20 intervals: at least one ping must go out before it.
        loop.call_later(0.2, job.events.put_nowait, Delta(0, "Hel"))
        loop.call_later(0.2, job.events.put_nowait, Failed(APIError(503, "the server is shutting down")))
        return [chunk async for chunk in write_stream(writer, job, 1)]

    chunks = asyncio.run(go())
    names = [c.split("\n", 1)[0][len("event: "):] for c in chunks]
    assert names[:2] == ["message_start", "ping"] and names.count("ping") >= 2
    first = names.index("content_block_start")
    assert set(names[2:first]) == {"ping"} and names[first:] == ["content_block_start", "content_block_delta", "error"]
    error = json.loads(chunks[-1].split("data: ", 1)[1])
    assert error == {"type": "error", "error": {"type": "overloaded_error", "message": "the server is shutting down"}}
