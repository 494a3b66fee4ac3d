"""Ollama's API on ``specdecode serve`` (issue 45, items 4 and 6): the translation of its bodies
onto the server's requests (options, format, messages and tool calls, load calls, errors in
Ollama's field names), its answers as the ``ollama`` Python client reads them (list, show, ps,
chat streamed and not, tool calls, ``generate`` with ``suffix``, ``format``), Ollama's error
shape and status, and the access checks.

The HTTP tests run a real server (uvicorn on loopback, tests/test_server.py's ServerThread):
around tests/test_server_responses.py's scripted byte model (it answers a fixed text, a Hermes
tool call when tools are given, and has no FIM tokens), and around qwen2.5-coder-0.5b-instruct,
the default pair's small model (FIM tokens, a template that teaches tool calls). What is judged
is what the client reads and the counts, never the wall clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import jsonschema
import ollama
import pytest

from specdecode.api import Decoder
from specdecode.backends.fim import FimInput
from specdecode.messages import check_messages, template_messages
from specdecode.server import create_app
from specdecode.server.apierror import APIError
from specdecode.server.ollama_models import ModelCard, describe_template, gguf_metadata
from specdecode.server.jobs import Delta, Failed
from specdecode.server.ollama import GENERATE, OllamaStream, _Answer
from specdecode.server.runner import write_stream
from specdecode.server.ollama_protocol import OllamaRequest, chat_messages, parse_chat, parse_generate
from specdecode.server.toolcalls import HermesFormat

from test_server import ServerThread
from test_server_responses import ANSWER, ScriptBackend

SCRIPT = "script"
QWEN = "qwen2.5-coder-0.5b-instruct"
N_CTX = 4096
CARD = ModelCard(name=SCRIPT, format="", size=0, digest="0" * 64, modified_at="2026-01-01T00:00:00Z", family="",
                 parameter_size="", quantization="", basename="", n_ctx=N_CTX, capabilities=("completion",),
                 template=describe_template(None))
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city",
                                           "parameters": WEATHER}}]
HI = [{"role": "user", "content": "hi"}]
PREFIX = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
SUFFIX = "\n    return a\n\n\nprint(fibonacci(10))\n"


def chat(body: dict, tools: bool = True):
    return parse_chat({"model": SCRIPT, **body}, CARD, N_CTX, HermesFormat() if tools else None)


def generate(body: dict):
    return parse_generate({"model": SCRIPT, **body}, CARD, N_CTX, None)


def refused(parse, body: dict, param: str, status: int = 400) -> str:
    with pytest.raises(APIError) as e:
        parse(body)
    assert e.value.status == status and e.value.param == param, (e.value.status, e.value.param, e.value.message)
    return e.value.message


# ------------------------------------------------------------------ the translation, pure


def test_options_become_the_requests_sampling_and_bounds():
    req = chat({"messages": HI, "options": {
        "temperature": 0.2, "top_k": 5, "top_p": 0.5, "min_p": 0.1, "seed": 7, "num_predict": 10, "stop": ["\n"],
        "repeat_penalty": 1.2, "repeat_last_n": 32, "presence_penalty": 0.5, "frequency_penalty": 0.25,
        "num_ctx": 10**6, "num_thread": 2, "num_gpu": 99, "use_mmap": True, "mirostat": 0, "typical_p": 1.0,
        "tfs_z": None}}).req
    s = req.options.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.seed) == (0.2, 5, 0.5, 0.1, 7)
    assert (s.repetition_penalty, s.penalty_last_n, s.presence_penalty, s.frequency_penalty) == (1.2, 32, 0.5, 0.25)
    assert req.options.stop == ("\n",) and req.max_tokens == 10 and req.stream and req.fit_context
    # Ollama's defaults where the options leave them out; num_predict a bound up to the context's end.
    req = chat({"messages": HI, "stream": False, "options": {"seed": -1, "num_predict": -1}}).req
    s = req.options.sampling
    assert (s.temperature, s.top_k, s.top_p, s.seed, s.penalty_last_n) == (0.8, 40, 0.9, None, 64)
    assert req.max_tokens == N_CTX and req.fit_context and not req.stream
    assert chat({"messages": HI, "options": {"num_predict": 10**6}}).req.max_tokens == N_CTX


@pytest.mark.parametrize("options, param, words", [
    ({"temperature": "hot"}, "options.temperature", "must be a number"),
    ({"temperature": 5}, "options.temperature", "options.temperature = 5"),
    ({"top_p": 0}, "options.top_p", "options.top_p"),
    ({"num_predict": 1.5}, "options.num_predict", "must be an integer"),
    ({"num_ctx": 0}, "options.num_ctx", "positive"),
    ({"stop": [1]}, "options.stop", "options.stop must be"),
    ({"repeat_last_n": -5}, "options.repeat_last_n", "options.repeat_last_n = -5"),
    ({"mirostat": 2}, "options.mirostat", "only 0 is accepted"),
    ({"frobnicate": 1}, "options.frobnicate", "unsupported option(s): frobnicate"),
    # Issue 61: options accepted without effect took any type.
    ({"num_gpu": "all"}, "options.num_gpu", "must be an integer"),
    ({"use_mmap": "yes"}, "options.use_mmap", "must be a boolean"),
    ({"mirostat_tau": [5]}, "options.mirostat_tau", "must be a number"),
])
def test_bad_options_are_400s_naming_the_option(options, param, words):
    assert words in refused(chat, {"messages": HI, "options": options}, param)
    assert words in refused(generate, {"prompt": "x", "options": options}, param)


def test_format_is_the_grammar():
    assert chat({"messages": HI, "format": "json"}).req.options.grammar.kind == "json_object"
    grammar = chat({"messages": HI, "format": WEATHER}).req.options.grammar
    assert grammar.kind == "json_schema" and json.loads(grammar.source) == WEATHER
    assert chat({"messages": HI, "format": ""}).req.options.grammar is None
    assert "format must be" in refused(chat, {"messages": HI, "format": "yaml"}, "format")
    # With tools, as on the OpenAI route: the calls follow the tools' schemas instead.
    assert "format cannot be combined with tools" in refused(chat, {"messages": HI, "format": "json", "tools": TOOLS},
                                                             "format")


def test_messages_carry_tool_calls_as_objects_and_tool_results_by_name():
    messages = chat_messages([
        {"role": "USER", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "mine", "function": {"name": "get_time", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "12:00", "tool_name": "get_time"},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather", "thinking": ""},
    ])
    assert messages[0] == {"role": "user", "content": "Weather in Paris and Rome?"}
    calls = messages[1]["tool_calls"]
    assert [c["id"] for c in calls] == ["call_1_0", "mine"]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert [m["tool_call_id"] for m in messages[2:]] == ["mine", "call_1_0"]
    check_messages(messages)  # what the OpenAI route accepts
    assert "answers no earlier tool call" in refused(chat, {"messages": [{"role": "tool", "content": "x"}]},
                                                     "messages[0].role")
    # Issue 61: a tool_name no waiting call has answered the first pending call; now named.
    words = refused(chat, {"messages": [HI[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "12:00", "tool_name": "get_time"}]}, "messages[2].tool_name")
    assert '"get_time"' in words and '"get_weather"' in words
    assert "must be a string" in refused(chat, {"messages": [HI[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {}}}]}, {"role": "tool", "content": "x", "tool_name": 5}]},
        "messages[2].tool_name")
    assert "reads text only" in refused(chat, {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
                                        "messages[0].images")
    refused(chat, {"messages": [{"role": "user", "content": "x", "name": "me"}]}, "messages[0].name")
    refused(chat, {"messages": [{"role": "user", "content": 3}]}, "messages[0].content")
    # A conversation with tool calls, for a model whose template teaches none: refused as on /v1.
    refused(lambda b: chat(b, tools=False), {"messages": [HI[0], {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {}}}]}]}, "messages[1].tool_calls")


def test_generate_builds_fim_raw_and_chat_prompts():
    fim = generate({"prompt": PREFIX, "suffix": SUFFIX, "system": "ignored, as Ollama does"}).req
    assert fim.fim == FimInput(PREFIX, SUFFIX) and fim.kind == "completion" and fim.fit_context
    # A cursor at the top of a file (no prefix) is still a fill-in-the-middle request, and raw keeps the suffix.
    assert generate({"prompt": "", "suffix": SUFFIX}).req.fim == FimInput("", SUFFIX)
    assert generate({"prompt": PREFIX, "suffix": SUFFIX, "raw": True}).req.fim == FimInput(PREFIX, SUFFIX)
    raw = generate({"prompt": "[INST] hi [/INST]", "raw": True}).req
    assert raw.prompt == "[INST] hi [/INST]" and raw.messages is None and raw.fim is None
    templated = generate({"prompt": "hi", "system": "Be brief.", "suffix": ""}).req
    assert templated.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for body in ({}, {"prompt": ""}, {"prompt": None, "keep_alive": 0}):
        p = generate(body)
        assert p.req is None and p.model == SCRIPT  # Ollama's "load the model" call
    assert chat({}).req is None and chat({"messages": []}).req is None
    assert "raw mode" in refused(generate, {"prompt": "x", "raw": True, "system": "s"}, "system")
    assert "template" in refused(generate, {"prompt": "x", "template": "{{ .Prompt }}"}, "template")
    refused(generate, {"prompt": "x", "context": [1, 2, 3]}, "context")
    refused(generate, {"prompt": "x", "images": ["aGk="]}, "images")
    refused(generate, {"prompt": 3}, "prompt")


def test_fields_model_and_think():
    assert chat({"messages": HI}).model == SCRIPT
    assert parse_chat({"model": SCRIPT + ":latest", "messages": HI}, CARD, N_CTX, None).model == SCRIPT + ":latest"
    assert "not found" in refused(chat, {"model": "llama3.2", "messages": HI}, "model", 404)
    refused(chat, {"model": None, "messages": HI}, "model")
    assert chat({"messages": HI, "think": False, "keep_alive": "5m", "truncate": True, "logprobs": False}).req
    assert "does not support thinking" in refused(chat, {"messages": HI, "think": True}, "think")
    refused(chat, {"messages": HI, "think": "high"}, "think")
    refused(chat, {"messages": HI, "keep_alive": [5]}, "keep_alive")
    refused(chat, {"messages": HI, "logprobs": True}, "logprobs")
    assert "unsupported field" in refused(chat, {"messages": HI, "tool_choice": "required"}, "tool_choice")
    # This server's own extensions ride along, as on the OpenAI routes.
    req = chat({"messages": HI, "speculative": {"draft": "none"}}).req
    assert req.options.draft == "none"
    refused(chat, {"messages": HI, "speculative": {"draft": 3}}, "speculative.draft")


def test_gguf_metadata_is_read_from_the_header(smollm_path, tmp_path):
    meta = gguf_metadata(smollm_path)
    assert meta["general.architecture"] == "llama" and meta["general.size_label"] == "135M"
    assert isinstance(meta["general.file_type"], int)
    (tmp_path / "no.gguf").write_bytes(b"GGML" + bytes(100))
    assert gguf_metadata(tmp_path / "no.gguf") == {} and gguf_metadata(tmp_path / "absent.gguf") == {}
    (tmp_path / "cut.gguf").write_bytes(smollm_path.read_bytes()[:4096])  # truncated inside the vocabulary
    assert gguf_metadata(tmp_path / "cut.gguf") == {}


def test_an_error_after_the_stream_began_is_its_last_line():
    class Job:
        events = asyncio.Queue()

    p = OllamaRequest("generate", SCRIPT, generate({"prompt": "x"}).req)
    Job.events.put_nowait(Delta(0, "He"))
    Job.events.put_nowait(Failed(APIError(400, "max_tokens = 3 is wrong", param="max_tokens")))

    async def lines() -> list[dict]:
        rename = lambda e: GENERATE.rename(e, p)  # noqa: E731
        return [json.loads(line) async for line in write_stream(OllamaStream(_Answer(p, 0.0)), Job, 1, rename)]

    opening, first, last = asyncio.run(lines())
    assert opening["response"] == "" and not opening["done"]  # sent before the prompt is read
    assert first["response"] == "He" and not first["done"]
    assert last == {"error": "options.num_predict = 3 is wrong"}


# ------------------------------------------------------------------ over HTTP, a scripted model


@pytest.fixture(scope="module")
def script_server():
    dec = Decoder(target=ScriptBackend(), draft="ngram", num_speculative_tokens=4, progress=False)
    with ServerThread(create_app(dec, max_queue=4)) as s:
        yield s
    dec.close()


@pytest.fixture(scope="module")
def script(script_server):
    return ollama.Client(host=script_server.url, timeout=60)


def test_the_client_lists_shows_and_reads_chat_streamed_or_not(script, script_server):
    (model,) = script.list().models
    assert model.model == SCRIPT and model.size == 0 and len(model.digest) == 64
    shown = script.show(SCRIPT + ":latest")
    assert shown.capabilities == ["completion", "tools"]  # no FIM tokens: no "insert", no .Suffix
    assert ".Suffix" not in shown.template and shown.modelinfo["unknown.context_length"] == N_CTX
    assert "num_ctx 4096" in shown.parameters
    (running,) = script.ps().models
    assert running.context_length == N_CTX and running.expires_at.year > 2100
    version = httpx.get(script_server.url + "/api/version").json()["version"]
    assert tuple(map(int, version.split("."))) >= (0, 6, 4)  # VS Code Copilot's Ollama provider asks for it
    # Continue asks /api/show with "name".
    assert httpx.post(script_server.url + "/api/show", json={"name": SCRIPT}).json()["capabilities"]
    whole = script.chat(model=SCRIPT, messages=HI, options={"temperature": 0})
    assert whole.message.content == ANSWER.decode() and whole.done and whole.done_reason == "stop"
    assert whole.eval_count == len(ANSWER) and whole.total_duration >= whole.eval_duration > 0
    chunks = list(script.chat(model=SCRIPT, messages=HI, stream=True, options={"temperature": 0}))
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True] and chunks[-1].done_reason == "stop"
    # The same prompt again: all but its last token were in a slot's cache, and are not counted as evaluated.
    assert chunks[-1].prompt_eval_count == 1
    # The speculation statistics ride along (the client keeps only Ollama's own fields: read as JSON).
    raw = httpx.post(script_server.url + "/api/chat", json={"model": SCRIPT, "messages": HI, "stream": False,
                                                             "options": {"temperature": 0}}).json()
    spec = raw["speculation"]
    assert spec["completion_tokens"] == raw["eval_count"] == len(ANSWER) and spec["draft"] == "ngram"
    assert raw["prompt_eval_count"] == spec["prompt_tokens"] - spec["prompt_cached"] == 1
    cut = script.generate(model=SCRIPT, prompt="hi", options={"temperature": 0, "num_predict": 3})
    assert cut.response == ANSWER.decode()[:3] and cut.done_reason == "length" and cut.eval_count == 3
    assert script.generate(model=SCRIPT).done_reason == "load"
    assert script.chat(model=SCRIPT, messages=[]).done_reason == "load"


def test_tool_calls_come_back_as_objects_and_go_back_in(script):
    whole = script.chat(model=SCRIPT, messages=HI, tools=TOOLS, options={"temperature": 0})
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert whole.message.content == "" and whole.done_reason == "stop"
    chunks = list(script.chat(model=SCRIPT, messages=HI, tools=TOOLS, stream=True, options={"temperature": 0}))
    streamed = [c for c in chunks if c.message.tool_calls]
    assert len(streamed) == 1 and streamed[0].message.tool_calls == whole.message.tool_calls and not streamed[0].done
    assert chunks[-1].done and "".join(c.message.content for c in chunks) == ""
    # The client sends the call back, and the tool's answer by the tool's name.
    follow = script.chat(model=SCRIPT, messages=[*HI, whole.message, {"role": "tool", "content": "sunny",
                                                                       "tool_name": "get_weather"}],
                         options={"temperature": 0})
    assert follow.message.content == ANSWER.decode()


def test_errors_are_ollamas_shape_with_the_right_status(script_server):
    url = script_server.url
    for path, body, status, words in [
        ("/api/chat", {"model": "llama3.2", "messages": HI}, 404, 'model "llama3.2" not found'),
        ("/api/generate", {"model": "llama3.2"}, 404, "not found"),
        ("/api/show", {"model": "llama3.2"}, 404, "not found"),
        ("/api/generate", {"model": SCRIPT, "prompt": "x", "options": {"top_k": "many"}}, 400, "options.top_k"),
        ("/api/generate", {"model": SCRIPT, "prompt": "x", "images": ["aGk="]}, 400, "text only"),
        ("/api/chat", {"model": SCRIPT, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400,
         "messages[0].images"),
        # Found when the prompt is prepared: a model without FIM tokens, a prompt longer than the context.
        ("/api/generate", {"model": SCRIPT, "prompt": "x", "suffix": "y"}, 400, "fill-in-the-middle"),
        ("/api/generate", {"model": SCRIPT, "prompt": "x" * 5000, "raw": True}, 400, "context"),
        # Issue 61: a bare "Not Found"; now what this server serves under /api/.
        ("/api/embed", {"model": SCRIPT, "input": "x"}, 404, "no such endpoint; under /api/ this server serves"),
        ("/api/pull", {"model": SCRIPT}, 404, "/api/chat"),
    ]:
        r = httpx.post(url + path, json=body)
        assert r.status_code == status and set(r.json()) == {"error"}, (path, r.text)
        assert isinstance(r.json()["error"], str) and words in r.json()["error"], (path, r.text)
    r = httpx.post(url + "/api/chat", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    # Streamed: an error found before the first token still gets its status.
    r = httpx.post(url + "/api/generate", json={"model": SCRIPT, "prompt": "x", "suffix": "y", "stream": True})
    assert r.status_code == 400 and "suffix" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).chat(model="llama3.2", messages=HI)
    assert e.value.status_code == 404 and "not found" in e.value.error


def test_the_api_key_and_host_checks_guard_the_ollama_routes():
    dec = Decoder(target=ScriptBackend(), draft="none", progress=False)
    with ServerThread(create_app(dec, api_key="sesame")) as s:
        for path in ("/api/tags", "/api/version", "/api/ps"):
            r = httpx.get(s.url + path)
            assert r.status_code == 401 and isinstance(r.json()["error"], str), r.text
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=s.url).chat(model=SCRIPT, messages=HI)
        assert e.value.status_code == 401 and "API key" in e.value.error
        keyed = ollama.Client(host=s.url, headers={"Authorization": "Bearer sesame"})
        assert keyed.chat(model=SCRIPT, messages=HI, options={"temperature": 0}).message.content == ANSWER.decode()
        r = httpx.get(s.url + "/api/tags", headers={"Authorization": "Bearer sesame", "Host": "rebind.evil.example"})
        assert r.status_code == 403 and "Host" in r.json()["error"]
        # The OpenAI routes keep OpenAI's error body.
        assert httpx.get(s.url + "/v1/models").json()["error"]["code"] == "invalid_api_key"
    dec.close()


# ------------------------------------------------------------------ the ollama client on a real model


@pytest.fixture(scope="module")
def qwen():
    dec = Decoder(target=QWEN, draft="ngram", n_ctx=2048, n_threads=2, progress=False)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def qwen_client(qwen):
    with ServerThread(create_app(qwen, warmup=False)) as s:
        yield ollama.Client(host=s.url, timeout=300)


def test_qwen_is_listed_and_shown_with_its_gguf_details_and_fim(qwen, qwen_client):
    (model,) = qwen_client.list().models
    assert model.model == QWEN and model.size == qwen.target.path.stat().st_size
    assert model.digest == qwen.target.known_sha256
    d = model.details
    assert (d.format, d.family, d.parameter_size, d.quantization_level) == ("gguf", "qwen2", "0.5B", "Q4_K_M")
    shown = qwen_client.show(QWEN)
    assert shown.capabilities == ["completion", "tools", "insert"]
    assert "{{ .Suffix }}" in shown.template and "<|fim_prefix|>" in shown.template  # Continue offers FIM on it
    assert shown.modelinfo["qwen2.context_length"] == 2048 and shown.modelinfo["general.architecture"] == "qwen2"


def test_qwen_fills_the_middle_as_the_decoder_does(qwen, qwen_client):
    want = qwen.generate(PREFIX, suffix=SUFFIX, max_tokens=16, plain=True).text
    r = qwen_client.generate(model=QWEN, prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 16})
    assert r.response == want and r.eval_count == 16 and r.done_reason == "length"
    assert r.prompt_eval_count <= len(qwen.prompt_ids(PREFIX, suffix=SUFFIX))
    pieces = list(qwen_client.generate(model=QWEN, prompt=PREFIX, suffix=SUFFIX, stream=True,
                                       options={"temperature": 0, "num_predict": 16}))
    assert "".join(p.response for p in pieces) == want
    # The editor's next request: the prompt's tokens a slot already held are not evaluated again.
    assert pieces[-1].prompt_eval_count == 1
    # A cursor at the top of a file: no prefix, still a fill-in-the-middle request (Ollama would take it for a load).
    top = qwen_client.generate(model=QWEN, prompt="", suffix=SUFFIX, options={"temperature": 0, "num_predict": 4})
    assert top.done_reason != "load" and top.eval_count >= 1


def test_qwen_chats_streamed_as_whole_in_json_and_with_tool_history(qwen, qwen_client):
    ask = [{"role": "user", "content": "Say hello."}]
    whole = qwen_client.chat(model=QWEN, messages=ask, options={"temperature": 0, "num_predict": 12})
    chunks = list(qwen_client.chat(model=QWEN, messages=ask, stream=True, options={"temperature": 0,
                                                                                   "num_predict": 12}))
    assert whole.message.content and "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].eval_count == whole.eval_count
    city = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
            "required": ["name", "country"]}
    r = qwen_client.chat(model=QWEN, format=city, options={"temperature": 0, "num_predict": 40},
                         messages=[{"role": "user", "content": "Paris: give its name and country."}])
    jsonschema.validate(json.loads(r.message.content), city)
    r = qwen_client.chat(model=QWEN, format="json", options={"temperature": 0, "num_predict": 40},
                         messages=[{"role": "user", "content": "Paris: give its name and country as JSON."}])
    assert isinstance(json.loads(r.message.content), dict)
    # A call the client sends back in Ollama's shape is the template's own tool call and tool response.
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "17 degrees celsius, sunny", "tool_name": "get_weather"}]
    card = dataclasses.replace(CARD, name=QWEN)
    req = parse_chat({"model": QWEN, "messages": history, "tools": TOOLS}, card, 2048, HermesFormat()).req
    prompt = qwen.target.apply_chat_template(template_messages(req.messages), tools=list(req.tools.tools))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n17 degrees celsius, sunny\n</tool_response>" in prompt
    r = qwen_client.chat(model=QWEN, messages=history, tools=TOOLS, options={"temperature": 0, "num_predict": 24})
    assert r.done and r.prompt_eval_count > 0 and r.eval_count > 0
