"""The ``anthropic`` SDK, unchanged, against a real ``specdecode serve --api-key`` on the default
pair's small model (issue 59): create, stream, count_tokens, a forced tool call and its result
turn, and errors as the SDK's own exception classes. The server runs qwen2.5-coder-0.5b-instruct
(its chat template teaches tool calls) with prompt-lookup drafts, as a subprocess; the requests
ask temperature 0 (the 2026 SDK has no parameter for it: ``extra_body``). What is judged is what
the client reads, never the wall clock; the scripted-model tests of the same API are
tests/test_anthropic.py.
"""

from __future__ import annotations

import anthropic
import pytest

from test_clients import MODEL, serve

KEY = "sk-anthropic-test"
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """``specdecode serve --api-key`` on the small model, as a user starts it; an SDK client."""
    with serve(tmp_path_factory, "--api-key", KEY) as url:
        yield anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


def test_create_stream_and_count_tokens(client):
    msg = client.messages.create(model=MODEL, max_tokens=16, system="Be brief.",
                                 messages=[{"role": "user", "content": "Say hello."}], extra_body=GREEDY)
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and 0 < msg.usage.output_tokens <= 16
    with client.messages.stream(model=MODEL, max_tokens=16, system="Be brief.",
                                messages=[{"role": "user", "content": "Say hello."}], extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == msg.content[0].text
    assert final.usage.output_tokens == msg.usage.output_tokens
    # The same prompt, read or reused (a fresh server may measure its costs between the two
    # requests, which overwrites a short prompt's cache: reuse is tests/test_anthropic.py's).
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    n = client.messages.count_tokens(model=MODEL, system="Be brief.",
                                     messages=[{"role": "user", "content": "Say hello."}]).input_tokens
    assert n == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_a_forced_tool_call_and_its_result_turn(client):
    msg = client.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
    turn = ASK + [{"role": "assistant", "content": msg.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "sunny, 21 C"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=40, messages=turn, tools=[WEATHER], extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


def test_errors_are_the_sdks_classes(client):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=str(client.base_url), api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_llama_cpp_utility_endpoints_on_the_real_model(client):
    """/tokenize, /detokenize and /props as llama.cpp's server renders them: a control token
    (``<|im_end|>``) as its text, and the GGUF's own end token in /props."""
    import httpx

    url, headers = str(client.base_url).rstrip("/"), {"x-api-key": KEY}
    tokens = httpx.post(url + "/tokenize", json={"content": "hi<|im_end|>", "with_pieces": True},
                        headers=headers).json()["tokens"]
    assert tokens[-1]["piece"] == "<|im_end|>" and "".join(t["piece"] for t in tokens) == "hi<|im_end|>"
    ids = [t["id"] for t in tokens]
    assert httpx.post(url + "/detokenize", json={"tokens": ids}, headers=headers).json() == {"content": "hi<|im_end|>"}
    plain = httpx.post(url + "/tokenize", json={"content": "hi<|im_end|>", "parse_special": False},
                       headers=headers).json()["tokens"]
    assert len(plain) > len(ids)  # read as text, the marker is several tokens
    props = httpx.get(url + "/props", headers=headers).json()
    assert props["eos_token"] == "<|im_end|>" and props["default_generation_settings"]["n_ctx"] == 4096
    assert "<|im_start|>" in props["chat_template"] and props["model_alias"] == MODEL
