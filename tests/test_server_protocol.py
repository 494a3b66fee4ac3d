"""The server's request parsing (specdecode.server.protocol) as pure functions: no model,
no HTTP. tests/test_server.py checks the same inputs through a live server."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from specdecode.errors import ContextOverflowError, SpecDecodeError
from specdecode.limits import MAX_LOGPROBS, MAX_N
from specdecode.request import GenerationOptions
from specdecode.sampling import SamplingParams
from specdecode.server import APIError, GenRequest, add_serve_parser, parse_request
from specdecode.server.cli import API_KEY_ENV, api_key_from
from specdecode.server.config import DEFAULT_MAX_BODY_BYTES, ServerOptions
from specdecode.server.protocol import (DEFAULT_COMPLETION_MAX_TOKENS, DEFAULT_TEMPERATURE, MAX_JSON_DEPTH,
                                        MAX_TEMPERATURE, from_specdecode_error, parse_json_body, resolve_max_tokens)

MODEL = "smollm2-135m-instruct"
N_CTX = 512
CHAT = [{"role": "user", "content": "Name three primary colours, briefly."}]


def parse(endpoint: str, body, n_ctx: int = N_CTX) -> GenRequest:
    return parse_request(body, "completion" if endpoint == "c" else "chat", MODEL, n_ctx)


def fails(endpoint: str, body) -> APIError:
    with pytest.raises(APIError) as e:
        parse(endpoint, body)
    err = e.value
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err


# ------------------------------------------------------------------ bad input

BAD = [
    # (endpoint, body, status, param, fragment of the message)
    ("c", {"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens", "max_tokens = -5 is out of range"),
    ("c", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens = 0 is out of range"),
    ("c", {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens",
     f"expected 1 <= max_tokens <= {N_CTX} (the context size)"),
    ("c", {"model": MODEL, "prompt": "hi", "max_tokens": "8"}, 400, "max_tokens", 'max_tokens must be an integer, got "8"'),
    ("c", {"model": MODEL, "prompt": "hi", "max_tokens": 8.5}, 400, "max_tokens", "max_tokens must be an integer"),
    ("c", {"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens", "max_tokens must be an integer"),
    ("x", {"model": MODEL, "messages": CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens",
     "max_completion_tokens = -1 is out of range"),
    ("x", {"model": MODEL, "messages": CHAT, "max_tokens": 5, "max_completion_tokens": 6}, 400,
     "max_completion_tokens", "disagree"),
    ("c", {"model": MODEL, "prompt": "hi", "temperature": 3.5}, 400, "temperature", "temperature = 3.5 is out of range"),
    ("c", {"model": MODEL, "prompt": "hi", "temperature": -0.1}, 400, "temperature", "temperature = -0.1 is out of range"),
    ("c", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature", "temperature must be a number"),
    ("c", {"model": MODEL, "prompt": "hi", "temperature": True}, 400, "temperature", "temperature must be a number"),
    ("c", {"model": MODEL, "prompt": "hi", "temperature": float("inf")}, 400, "temperature",
     "temperature must be a number"),
    # an integer beyond float's range (JSON allows any length): a 400, not an OverflowError's 500
    ("x", {"model": MODEL, "messages": CHAT, "temperature": 10 ** 400}, 400, "temperature",
     "temperature must be a number, got 1000"),
    ("x", {"model": MODEL, "messages": CHAT, "top_p": -10 ** 400}, 400, "top_p", "top_p must be a number"),
    ("x", {"model": MODEL, "messages": CHAT, "max_tokens": 10 ** 400}, 400, "max_tokens", "..."),
    # Ranges owned by SamplingParams: the message is its own, so only the field is asserted.
    ("c", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ("c", {"model": MODEL, "prompt": "hi", "top_k": -1}, 400, "top_k", "top_k"),
    ("c", {"model": MODEL, "prompt": "hi", "top_k": 2.5}, 400, "top_k", "top_k must be an integer"),
    ("c", {"model": MODEL, "prompt": "hi", "min_p": 1.5}, 400, "min_p", "min_p"),
    ("c", {"model": MODEL, "prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty", "presence_penalty"),
    ("x", {"model": MODEL, "messages": CHAT, "frequency_penalty": -3}, 400, "frequency_penalty", "frequency_penalty"),
    ("c", {"model": MODEL, "prompt": "hi", "seed": -1}, 400, "seed", "seed"),
    ("c", {"model": MODEL, "prompt": "hi", "n": MAX_N + 1}, 400, "n",
     f"n = {MAX_N + 1} is out of range: expected 1 <= n <= {MAX_N}"),
    ("x", {"model": MODEL, "messages": CHAT, "n": 0}, 400, "n", "n = 0 is out of range"),
    ("c", {"model": MODEL, "prompt": "hi", "n": "2"}, 400, "n", 'n must be an integer, got "2"'),
    ("c", {"model": MODEL, "prompt": "hi", "n": 2.0}, 400, "n", "n must be an integer"),
    ("c", {"model": MODEL, "prompt": "hi", "n": 4, "max_tokens": 200}, 400, "n",
     f"n = 4 choices of max_tokens = 200 ask for 800 tokens, more than a request may (n * max_tokens <= {N_CTX}"),
    ("x", {"model": MODEL, "messages": CHAT, "n": 2, "max_completion_tokens": N_CTX // 2 + 1}, 400, "n",
     "n * max_tokens"),
    ("c", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop", "stop must be a non-empty string or a list"),
    ("c", {"model": MODEL, "prompt": "hi", "stop": ""}, 400, "stop", "stop must be a non-empty string or a list"),
    ("c", {"model": MODEL, "prompt": "hi", "stop": 5}, 400, "stop", "got 5"),
    ("c", {"model": MODEL, "prompt": "hi", "stop": ["a", 1]}, 400, "stop", "stop must be"),
    ("c", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream", 'stream must be a boolean, got "yes"'),
    ("c", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed when stream is true"),
    ("c", {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options", "is not supported"),
    ("c", {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage", "stream_options.include_usage must be a boolean"),
    ("c", {"model": MODEL, "prompt": "hi", "logprobs": 50}, 400, "logprobs",
     f"logprobs = 50 is out of range: expected 0 <= logprobs <= {MAX_LOGPROBS}"),
    ("c", {"model": MODEL, "prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, 400, "logprobs", "out of range"),
    ("c", {"model": MODEL, "prompt": "hi", "logprobs": -1}, 400, "logprobs", "out of range"),
    ("c", {"model": MODEL, "prompt": "hi", "logprobs": True}, 400, "logprobs", "logprobs must be an integer"),
    ("x", {"model": MODEL, "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "top_logprobs = 2 needs logprobs"),
    ("x", {"model": MODEL, "messages": CHAT, "logprobs": False, "top_logprobs": 2}, 400, "top_logprobs",
     "needs logprobs = true"),
    ("x", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, 400, "top_logprobs",
     f"expected 0 <= top_logprobs <= {MAX_LOGPROBS}"),
    ("x", {"model": MODEL, "messages": CHAT, "logprobs": 3}, 400, "logprobs", "logprobs must be a boolean, got 3"),
    ("c", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo", "echo = true (only false is accepted)"),
    ("c", {"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "best_of", "best_of = 2 (only 1 is accepted)"),
    ("c", {"model": MODEL, "prompt": "hi", "logit_bias": {"50": -100}}, 400, "logit_bias",
     'logit_bias = {"50": -100} (only {} is accepted)'),
    ("c", {"model": MODEL, "prompt": "hi", "suffix": 5}, 400, "suffix", "suffix must be a string"),
    ("x", {"model": MODEL, "messages": CHAT, "suffix": "x"}, 400, "suffix", "unsupported field(s): suffix."),
    ("c", {"model": MODEL, "prompt": "hi", "temprature": 0.5}, 400, "temprature", "unsupported field(s): temprature"),
    ("c", {"model": MODEL, "prompt": "hi", "stream_options": {}, "echo": True, "seed": "x"}, 400, "echo",
     "unsupported field(s): echo = true"),
    # smollm's chat template teaches no tool-call format (parse() passes none):
    ("x", {"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     "no known tool-call format"),
    ("c", {"model": MODEL, "prompt": "hi", "user": 5}, 400, "user", "user must be a string"),
    ("c", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "prompt must be a string"),
    ("c", {"model": MODEL, "prompt": 123}, 400, "prompt", "got 123"),
    ("c", {"model": MODEL}, 400, "prompt", "prompt is required"),
    ("c", {"model": MODEL, "prompt": None}, 400, "prompt", "prompt is required"),
    ("c", {"prompt": "hi"}, 400, "model", f'model is required: this server serves "{MODEL}"'),
    ("c", {"model": 7, "prompt": "hi"}, 400, "model", "model must be a string, got 7"),
    ("x", {"model": MODEL}, 400, "messages", "messages is required"),
    ("x", {"model": MODEL, "messages": "hi"}, 400, "messages", "messages must be a non-empty list"),
    ("x", {"model": MODEL, "messages": []}, 400, "messages", "messages must be a non-empty list"),
    ("x", {"model": MODEL, "messages": ["hi"]}, 400, "messages[0]", 'messages[0] must be an object, got "hi"'),
    ("x", {"model": MODEL, "messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role",
     'messages[0].role = "function" is not supported: expected one of system, user, assistant, tool'),
    ("x", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id",
     "messages[0].tool_call_id must be the id of the tool call"),
    ("x", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     "messages[0].content must be a string or a list of text parts, got 5"),
    ("x", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]", "messages[0].content[0] = "),
    ("x", {"model": MODEL, "messages": [*CHAT, {"role": "assistant", "content": "x", "name": "bob"}]}, 400,
     "messages[1].name", "messages[1]: unsupported field(s) name"),
    ("x", {"model": MODEL, "prompt": "hi"}, 400, "prompt", "unsupported field(s): prompt"),
    ("c", {"model": MODEL, "messages": CHAT}, 400, "messages", "unsupported field(s): messages"),
    ("c", {"model": "gpt-4", "prompt": "hi"}, 404, "model", f'the model "gpt-4" does not exist: this server serves "{MODEL}"'),
    ("x", {"model": "gpt-4", "messages": CHAT}, 404, "model", '"gpt-4" does not exist'),
]


@pytest.mark.parametrize("endpoint,body,status,param,fragment", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_raises_api_error_naming_the_field(endpoint, body, status, param, fragment):
    err = fails(endpoint, body)
    assert (err.status, err.param) == (status, param), err.body()
    assert fragment in err.message, err.message
    assert err.type == "invalid_request_error"
    assert err.code == ("model_not_found" if status == 404 else None)


@pytest.mark.parametrize("body", [[1, 2], "hi", 3, None])
def test_body_must_be_an_object(body):
    err = fails("c", body)
    assert (err.status, err.param) == (400, None)
    assert "the request body must be a JSON object" in err.message


@pytest.mark.parametrize("raw", [b'{"model": ', b'{"model": NaN}', b'{"t": Infinity}', b"\xff\xfe", b""])
def test_malformed_json_is_a_400(raw):
    with pytest.raises(APIError) as e:
        parse_json_body(raw)
    assert e.value.status == 400 and "the request body is not valid JSON" in e.value.message


def test_json_body_decodes():
    assert parse_json_body(b'{"model": "m", "n": 1}') == {"model": "m", "n": 1}
    # A surrogate pair escaped in JSON is one character, not two lone surrogates.
    assert parse_json_body(b'{"prompt": "caf\\u00e9 \\ud83d\\ude00"}') == {"prompt": "caf\u00e9 \U0001f600"}


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "a\\ud800b"}', "prompt"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    (b'{"stop": ["ok", "\\udc00"]}', "stop[1]"),
    (b'{"\\ud800": 1}', None),
    (b'{"response_format": {"json_schema": {"\\ud800": 1}}}', "response_format.json_schema"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(raw, param):
    with pytest.raises(APIError) as e:
        parse_json_body(raw)
    assert (e.value.status, e.value.param) == (400, param) and "lone surrogate" in e.value.message
    assert param is None or param in e.value.message


def test_nesting_is_bounded():
    assert parse_json_body(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
    for raw in (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), b"[" * 100_000,
                b'{"user": ' + b'{"a": ' * 500 + b"1" + b"}" * 501):
        with pytest.raises(APIError) as e:
            parse_json_body(raw)
        assert e.value.status == 400 and "nested too deeply" in e.value.message
    assert e.value.param == "user"


# ------------------------------------------------------------------ good input


def test_minimal_completion():
    req = parse("c", {"model": MODEL, "prompt": "hi"})
    assert req == GenRequest(kind="completion", prompt="hi", messages=None, max_tokens=None,
                             options=GenerationOptions(sampling=SamplingParams(temperature=DEFAULT_TEMPERATURE)),
                             stream=False, include_usage=False, n=1)
    assert req.logprobs is None


def test_missing_temperature_is_openais_default_of_1():
    assert DEFAULT_TEMPERATURE == 1.0
    for body in ({}, {"temperature": None}):
        assert parse("c", {"model": MODEL, "prompt": "hi", **body}).options.sampling.temperature == 1.0
        assert parse("x", {"model": MODEL, "messages": CHAT, **body}).options.sampling.temperature == 1.0
    assert parse("c", {"model": MODEL, "prompt": "hi", "temperature": 0}).options.sampling.temperature == 0.0


def test_n_choices_and_their_seeds():
    req = parse("x", {"model": MODEL, "messages": CHAT, "n": MAX_N, "max_tokens": N_CTX // MAX_N, "seed": 7})
    assert req.n == MAX_N
    choices = [req.choice_options(i, 5) for i in range(3)]
    assert [c.sampling.seed for c in choices] == [7, 8, 9]
    assert all(c.max_tokens == 5 for c in choices)
    # Only the seed differs between choices, and the request's own options are unchanged.
    assert choices[1] == replace(choices[0], sampling=replace(choices[0].sampling, seed=8))
    assert req.options.sampling.seed == 7 and choices[0] == replace(req.options, max_tokens=5)
    unseeded = parse("c", {"model": MODEL, "prompt": "hi", "n": 3})
    assert all(unseeded.choice_options(i, 5).sampling.seed is None for i in range(3))
    wraps = parse("c", {"model": MODEL, "prompt": "hi", "n": 2, "seed": 2**64 - 1})
    assert wraps.choice_options(1, 5).sampling.seed == 0
    assert parse("c", {"model": MODEL, "prompt": "hi"}).n == 1


def test_completion_sampling_stop_and_logprobs():
    req = parse("c", {"model": MODEL, "prompt": "hi", "max_tokens": 7, "temperature": 1, "top_p": 0.9, "top_k": 40,
                      "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                      "seed": 3, "stop": "\n", "logprobs": 3})
    assert req.max_tokens == 7 and req.logprobs == 3
    assert req.options == GenerationOptions(
        sampling=SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
                                frequency_penalty=-0.5, top_k=40, seed=3), stop=("\n",), logprobs=3)
    sampling = req.options.sampling
    assert type(sampling.temperature) is float and type(sampling.top_k) is int


def test_range_edges_are_accepted():
    req = parse("c", {"model": MODEL, "prompt": "hi", "max_tokens": N_CTX, "temperature": MAX_TEMPERATURE,
                      "logprobs": MAX_LOGPROBS})
    assert (req.max_tokens, req.options.sampling.temperature, req.logprobs) == (N_CTX, MAX_TEMPERATURE, MAX_LOGPROBS)
    assert parse("c", {"model": MODEL, "prompt": "hi", "logprobs": 0}).logprobs == 0


def test_nulls_harmless_defaults_and_empty_stop_are_no_ops():
    req = parse("c", {"model": MODEL, "prompt": "hi", "max_tokens": None, "temperature": None, "stop": [],
                      "stream_options": None, "n": 1, "echo": False, "best_of": 1, "logit_bias": {},
                      "response_format": {"type": "text"}, "tools": [], "user": "u", "suffix": None})
    assert req.options == GenerationOptions(sampling=SamplingParams(temperature=1.0))
    assert req.max_tokens is None and req.stream is False


def test_max_completion_tokens_is_max_tokens():
    assert parse("x", {"model": MODEL, "messages": CHAT, "max_completion_tokens": 9}).max_tokens == 9
    assert parse("x", {"model": MODEL, "messages": CHAT, "max_tokens": 9, "max_completion_tokens": 9}).max_tokens == 9
    assert parse("c", {"model": MODEL, "prompt": "hi", "max_tokens": 4}).max_tokens == 4


def test_stream_options():
    req = parse("c", {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}})
    assert (req.stream, req.include_usage) == (True, True)
    req = parse("c", {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {}})
    assert (req.stream, req.include_usage) == (True, False)


def test_chat_messages_and_logprobs():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
             "name": None}]
    req = parse("x", {"model": MODEL, "messages": msgs, "logprobs": True, "top_logprobs": 2})
    assert req.kind == "chat" and req.prompt is None
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert req.logprobs == 2 and req.options == GenerationOptions(sampling=SamplingParams(temperature=1.0), logprobs=2)
    # logprobs alone: the chosen token's logprob, no alternatives.
    assert parse("x", {"model": MODEL, "messages": CHAT, "logprobs": True}).logprobs == 0
    req = parse("x", {"model": MODEL, "messages": CHAT, "logprobs": False})
    assert req.logprobs is None and req.options.logprobs is None


# ------------------------------------------------------------------ errors from the library


def test_specdecode_error_with_param_keeps_it():
    err = from_specdecode_error(SpecDecodeError("top_p = 2.0 is out of range", param="top_p"), "prompt")
    assert (err.status, err.param, err.message, err.code) == (400, "top_p", "top_p = 2.0 is out of range", None)
    assert err.type == "invalid_request_error"


def test_specdecode_error_without_param_takes_the_default():
    assert from_specdecode_error(SpecDecodeError("the prompt is empty"), "messages").param == "messages"
    assert from_specdecode_error(SpecDecodeError("the prompt is empty")).param is None


def test_context_overflow_has_its_code():
    err = from_specdecode_error(ContextOverflowError("the prompt does not fit"), "prompt")
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")


@pytest.mark.parametrize("field, value", [("top_p", 0.0), ("min_p", 2.0), ("repetition_penalty", 0.0),
                                          ("presence_penalty", 3.0), ("top_k", -1), ("seed", -1)])
def test_sampling_errors_name_the_field(field, value):
    err = fails("c", {"model": MODEL, "prompt": "hi", "temperature": 0.5, field: value})
    assert (err.status, err.param) == (400, field) and f"{field} = " in err.message


# ------------------------------------------------------------------ max_tokens against the prompt


def req(kind: str, max_tokens: int | None, n: int = 1) -> GenRequest:
    return GenRequest(kind=kind, prompt="p" if kind == "completion" else None,
                      messages=None if kind == "completion" else CHAT, max_tokens=max_tokens, n=n)


def test_resolve_max_tokens_defaults():
    assert resolve_max_tokens(req("completion", None), 10, N_CTX) == DEFAULT_COMPLETION_MAX_TOKENS
    assert resolve_max_tokens(req("completion", None), N_CTX - 3, N_CTX) == 3
    assert resolve_max_tokens(req("chat", None), 10, N_CTX) == N_CTX - 10
    assert resolve_max_tokens(req("chat", 5), 10, N_CTX) == 5
    assert resolve_max_tokens(req("completion", N_CTX - 10), 10, N_CTX) == N_CTX - 10
    # n choices: the default keeps n * max_tokens within the context size.
    assert resolve_max_tokens(req("chat", None, n=4), 10, N_CTX) == N_CTX // 4
    assert resolve_max_tokens(req("chat", None, n=4), N_CTX - 5, N_CTX) == 5
    assert resolve_max_tokens(req("completion", None, n=MAX_N), 10, N_CTX) == DEFAULT_COMPLETION_MAX_TOKENS
    assert resolve_max_tokens(req("completion", None, n=MAX_N), 10, 64) == 64 // MAX_N


@pytest.mark.parametrize("kind,param", [("completion", "prompt"), ("chat", "messages")])
def test_prompt_filling_the_context(kind, param):
    with pytest.raises(APIError) as e:
        resolve_max_tokens(req(kind, None), N_CTX, N_CTX)
    err = e.value
    assert (err.status, err.param, err.code) == (400, param, "context_length_exceeded")
    assert f"the prompt has {N_CTX} tokens but the context holds {N_CTX}" in err.message


def test_max_tokens_past_the_context():
    with pytest.raises(APIError) as e:
        resolve_max_tokens(req("completion", 300), 400, N_CTX)
    err = e.value
    assert (err.status, err.param, err.code) == (400, "max_tokens", "context_length_exceeded")
    assert "lower max_tokens to at most 112" in err.message


# ------------------------------------------------------------------ the package and the CLI


def test_importing_the_server_does_not_import_fastapi():
    code = ("import sys, specdecode.server, specdecode.cli; specdecode.cli.build_parser(); "
            "heavy = {'fastapi', 'starlette', 'uvicorn', 'prometheus_client'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serve_parser_uses_the_shared_model_options():
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--target", MODEL, "--draft", "ngram", "-k", "3", "--backend", "llama.cpp",
                         "--ctx-size", "1024", "--threads", "2", "--port", "9000", "--max-queue", "4"])
    assert (args.target, args.draft, args.num_speculative_tokens, args.backend, args.ctx_size, args.threads,
            args.port, args.max_queue, args.host) == (MODEL, "ngram", 3, "llama.cpp", 1024, 2, 9000, 4, "127.0.0.1")
    assert (args.api_key, args.max_body_bytes) == (None, DEFAULT_MAX_BODY_BYTES) and DEFAULT_MAX_BODY_BYTES == 4 << 20
    assert args.func.__name__ == "cmd_serve"
    args = p.parse_args(["serve", "--target", MODEL, "--api-key", "sk-1", "--max-body-bytes", "1000"])
    assert (args.api_key, args.max_body_bytes) == ("sk-1", 1000)


def test_api_key_from_the_option_or_the_environment(monkeypatch):
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_from(p.parse_args(["serve", "--target", MODEL])) is None
    assert api_key_from(p.parse_args(["serve", "--target", MODEL, "--api-key", "flag"])) == "flag"
    monkeypatch.setenv(API_KEY_ENV, "env")
    assert api_key_from(p.parse_args(["serve", "--target", MODEL])) == "env"
    assert api_key_from(p.parse_args(["serve", "--target", MODEL, "--api-key", "flag"])) == "flag"  # the flag wins
    monkeypatch.setenv(API_KEY_ENV, "")
    assert api_key_from(p.parse_args(["serve", "--target", MODEL])) is None  # empty: unset


@pytest.mark.parametrize("argv,param", [(["--port", "70000"], "--port"), (["--max-queue", "0"], "--max-queue"),
                                        (["-k", "33"], "--num-speculative-tokens"),
                                        (["--max-body-bytes", "0"], "--max-body-bytes"),
                                        (["--api-key", ""], "--api-key")])
def test_serve_refuses_bad_options_before_loading(argv, param):
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--target", "/nonexistent.gguf", "--draft", "none", *argv])
    with pytest.raises(SpecDecodeError) as e:
        args.func(args)
    assert e.value.param == param


def test_response_format_becomes_a_grammar():
    from specdecode.grammar import Grammar

    def parsed(rf):
        return parse_request({"model": MODEL, "messages": CHAT, "response_format": rf}, "chat", MODEL, 4096)

    assert parsed({"type": "text"}).options.grammar is None
    assert parsed({"type": "json_object"}).options.grammar == Grammar("json_object", name="response_format")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g = parsed({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}).options.grammar
    assert g.kind == "json_schema" and json.loads(g.source) == schema and g.name == "response_format"
    # As OpenAI's chat: name is required (issue 43), schema is not (none: any JSON value).
    g = parsed({"type": "json_schema", "json_schema": {"name": "x"}}).options.grammar
    assert g.kind == "json_schema" and json.loads(g.source) == {}


@pytest.mark.parametrize("rf, param", [
    ({"type": "xml"}, "response_format"),
    ({"type": "json_object", "extra": 1}, "response_format"),
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"schema": []}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x" * 65}}, "response_format.json_schema.name"),
    ("json", "response_format"),
])
def test_bad_response_format(rf, param):
    with pytest.raises(APIError) as e:
        parse_request({"model": MODEL, "messages": CHAT, "response_format": rf}, "chat", MODEL, 4096)
    assert (e.value.status, e.value.param) == (400, param)


# ------------------------------------------------------------------ the server's options


@pytest.mark.parametrize("field, value, fragment", [
    ("max_queue", 0, "max_queue = 0 is out of range: expected an integer >= 1"),
    ("max_body_bytes", True, "max_body_bytes = True is out of range"),
    ("port", 70000, "port = 70000 is out of range: expected an integer 0..65535"),
    ("metrics_port", 0, "metrics_port = 0 is out of range: expected an integer 1..65535"),
    ("replicas", 0, "replicas = 0 is out of range"),
    ("api_key", "", "api_key is not valid: expected a non-empty string"),
    ("model_name", "", "model_name = '' is not valid"),
    ("autoscaling", [1], "autoscaling = [1] is not valid"),
    ("num_cpus", -1, "num_cpus = -1 is out of range"),
    ("warmup", "yes", "warmup = 'yes' is not valid"),
])
def test_server_options_are_checked_once_naming_the_option(field, value, fragment):
    with pytest.raises(SpecDecodeError) as e:
        ServerOptions(**{field: value})
    assert e.value.param == field and fragment in str(e.value)


def test_server_options_from_the_command_line_name_the_flag(monkeypatch):
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--target", MODEL, "--max-queue", "3", "--max-body-bytes", "100", "--port", "9"])
    opts = ServerOptions.from_args(args, "k")
    assert (opts.model_name, opts.max_queue, opts.max_body_bytes, opts.port, opts.api_key, opts.warmup, opts.on_ray) \
        == (MODEL, 3, 100, 9, "k", True, False)
    with pytest.raises(SpecDecodeError) as e:
        ServerOptions.from_args(p.parse_args(["serve", "--replicas", "0"]), None)
    assert (e.value.param, str(e.value)) == ("--replicas", "--replicas 0 is out of range: expected an integer >= 1")
    with pytest.raises(SpecDecodeError) as e:
        ServerOptions.from_args(p.parse_args(["serve", "--autoscaling", "[1]"]), None)
    assert e.value.param == "--autoscaling"


def test_server_options_from_key_value_strings():
    opts = ServerOptions.from_strings({"max_queue": "4", "api_key": "k", "autoscaling": '{"min_replicas": 1}',
                                       "num_cpus": "1.5", "warmup": "false", "metrics_port": 9100, "replicas": "2"})
    assert (opts.max_queue, opts.api_key, opts.autoscaling, opts.num_cpus, opts.warmup, opts.metrics_port,
            opts.replicas) == (4, "k", {"min_replicas": 1}, 1.5, False, 9100, 2)
    for bad, param in [({"max_queue": "many"}, "max_queue"), ({"max_queue": "0"}, "max_queue"),
                       ({"autoscaling": "{"}, "autoscaling"), ({"max_qeue": "4"}, "max_qeue")]:
        with pytest.raises(SpecDecodeError) as e:
            ServerOptions.from_strings(bad)
        assert e.value.param == param


def test_a_requests_options_are_checked_once_per_choice(monkeypatch):
    """Issue 44: the options are made (and checked) by the parse, then once per choice with its
    max_tokens, seed and inputs; the Decoder and the engine take them as they are."""
    from specdecode.api import Decoder

    made = []
    check = GenerationOptions.__post_init__
    monkeypatch.setattr(GenerationOptions, "__post_init__", lambda self: (made.append(1), check(self))[1])
    req = parse_request({"model": "m", "prompt": "def f(", "max_tokens": 2, "n": 2, "seed": 5}, "completion", "m", 64)
    assert len(made) == 1
    choices = [req.choice_options(i, 2) for i in range(req.n)]
    assert len(made) == 3 and choices[1].sampling.seed == 6
    # a Decoder of its own model: closing a Decoder closes its target (the session fixture's must stay open)
    with Decoder(target="smollm2-135m-instruct", draft="ngram", n_ctx=512, progress=False) as dec:
        made.clear()
        dec.generate(prompt_ids=dec.prompt_ids("def f("), options=choices[0])
        assert made == []
