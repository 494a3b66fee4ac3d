"""``POST /infill``, llama.cpp's completion endpoint (:mod:`specdecode.server.infill`), as llama.vim
and llama.vscode call it: their request bodies replayed as their sources build them, greedy parity
with plain decoding of the same fill-in-the-middle prompt, llama.cpp's stop rules
(``t_max_predict_ms`` on a scripted clock, ``n_indent``, ``n_predict`` 0), its response shape,
projection and stream, and a 400 naming the field for what it does not take.

The server runs qwen2.5-coder-0.5b-instruct in-process (its GGUF has FIM tokens; smollm2's has
none). Small n_predict keeps it fast; nothing is judged by the wall clock.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from specdecode.api import Decoder
from specdecode.output import GenerationResult, TextDelta
from specdecode.server import create_app
from specdecode.server.apierror import APIError
from specdecode.server.infill import DEFAULT_SAMPLERS, InfillLimits, parse_extra, parse_infill
from specdecode.stats import Stats

from test_server import ServerThread

QWEN = "qwen2.5-coder-0.5b-instruct"
SMOLLM = "smollm2-135m-instruct"
N_CTX = 4096  # llama-server's /infill budget keeps the files in n_ctx - 2048 + 2 tokens
PREFIX = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
PROMPT = "    for"  # the cursor's line up to the cursor, as llama.vim sends it in `prompt`
SUFFIX = "\n    return a\n\n\nprint(fibonacci(10))\n"
EXTRA = [{"text": "def lucas(n):\n    a, b = 2, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
          "time": 1733350000.5, "filename": "lucas.py"}]


class ScriptedClock:
    """A clock (seconds) that reads each value of a script in turn, then the last one again."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.values.pop(0) if len(self.values) > 1 else self.values[0]


# ------------------------------------------------------------------ the stop rules, on scripted deltas

PIECES = {1: b"    a", 2: b", b", 3: b" = b", 4: b"\n", 5: b"    ", 6: b"return", 7: b"\n        ", 8: b"x", 9: b"\n",
          10: b"y", 11: b"\n\n", 12: b"done"}


def delta(*ids: int) -> TextDelta:
    return TextDelta(b"".join(PIECES[i] for i in ids).decode(), ids)


def result_of(text: str) -> GenerationResult:
    return GenerationResult(text=text, token_ids=[], finish_reason="stop", stats=Stats())


def test_time_limit_ends_after_the_first_newline_token_past_the_deadline_token_by_token():
    # llama.cpp's process_token: a token whose text holds a newline ends the output once more
    # than t_max_predict_ms have passed since generation started; tokens after it in the same
    # speculative step are dropped, the newline token itself is kept whole.
    clock = ScriptedClock(0.0, 0.5, 2.0)  # start, first delta at 500 ms, second at 2 s
    watch = InfillLimits(t_max_predict_ms=1000, clock=clock).watch(lambda t: PIECES[t])
    assert watch.feed(delta(1, 2, 3, 4, 5, 6)) == "    a, b = b\n    return"  # a newline before the deadline
    assert not watch.stopped
    assert watch.feed(delta(7, 8, 9, 10)) == "\n        "  # "\n        " is one token: kept whole, x dropped
    assert watch.stopped and watch.feed(delta(12)) == ""
    done = watch.finish(result_of("    a, b = b\n    return\n        x\ny"))
    assert done.text == "    a, b = b\n    return\n        " and done.finish_reason == "length"


def test_no_time_limit_and_no_newline_leave_the_text_alone():
    watch = InfillLimits(t_max_predict_ms=1000, clock=ScriptedClock(0.0, 50.0)).watch(lambda t: PIECES[t])
    assert watch.feed(delta(1, 2, 3)) == "    a, b = b" and not watch.stopped  # late, but no newline
    unlimited = InfillLimits(clock=ScriptedClock(0.0, 50.0)).watch(lambda t: PIECES[t])
    assert unlimited.feed(delta(1, 4, 5, 6, 7, 8)) == "    a\n    return\n        x" and not unlimited.stopped
    assert unlimited.finish(result_of("    a\n    return\n        x")).finish_reason == "stop"


def test_n_indent_cuts_before_a_line_indented_less_and_spares_the_first_line():
    # The first line (the rest of the cursor's line) is never measured; "return" at 4 < 8 spaces
    # ends the output before the "r" (its indentation kept, as llama.cpp erases from the "r").
    watch = InfillLimits(n_indent=8).watch(lambda t: PIECES[t])
    assert watch.feed(delta(1)) == "    a"
    assert watch.feed(delta(7, 8, 9)) == "\n        x\n" and not watch.stopped
    assert watch.feed(delta(5)) == "    " and not watch.stopped  # no character on the line yet
    assert watch.feed(delta(6, 4)) == "" and watch.stopped
    assert watch.finish(result_of("")).text == "    a\n        x\n    "


def test_n_indent_ends_at_an_empty_line_as_llama_cpp_does():
    # llama.cpp counts only spaces and tabs as indentation: an empty line's newline is a
    # character at indentation 0, so the output ends before it.
    watch = InfillLimits(n_indent=4).watch(lambda t: PIECES[t])
    assert watch.feed(delta(1, 7, 8, 11, 10)) == "    a\n        x\n" and watch.stopped


def test_a_delta_whose_text_is_not_its_tokens_pieces_is_taken_line_by_line():
    clock = ScriptedClock(0.0, 9.0)
    watch = InfillLimits(t_max_predict_ms=1, clock=clock).watch(lambda t: b"\xe6")  # half a character each
    assert watch.feed(TextDelta("ab\ncd\n", [1, 2])) == "ab\n" and watch.stopped


def test_n_predict_zero_is_stopped_before_any_step():
    watch = InfillLimits(no_output=True).watch(lambda t: b"")
    assert watch.stopped and watch.feed(TextDelta("x", [1])) == ""


# ------------------------------------------------------------------ parsing, without a model

def parse(body: dict, fim: bool = True):
    return parse_infill({"input_prefix": "a", "input_suffix": "b", **body}, QWEN, N_CTX, fim)


@pytest.mark.parametrize("extra, param", [
    ({"filename": "a.py", "text": "x"}, "input_extra"),
    ([{"filename": "a.py", "text": "x"}, "text"], "input_extra[1]"),
    ([{"filename": "a.py", "text": "x"}, {}, {"filename": "c.py", "text": 3}], "input_extra[1].text"),
    ([{"filename": "a.py", "text": "x"}, {"text": "y"}, {"filename": "c.py", "text": 3}], "input_extra[2].text"),
    ([{"filename": 7, "text": "x"}], "input_extra[0].filename"),
    ([{"text": "x", "path": "a.py"}], "input_extra[0].path"),
])
def test_malformed_input_extra_is_one_400_naming_the_chunk_field(extra, param):
    with pytest.raises(APIError) as e:
        parse({"input_extra": extra})
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


def test_input_extra_chunks_are_filename_text_pairs_with_llama_cpp_default_name():
    assert parse_extra([{"text": "x", "time": 3}, {"filename": "b.py", "text": "y"}]) == (("tmp", "x"), ("b.py", "y"))


@pytest.mark.parametrize("body, param, status", [
    ({"n_predict": -2}, "n_predict", 400),
    ({"n_predict": N_CTX + 1}, "n_predict", 400),
    ({"logit_bias": {}}, "logit_bias", 400),
    ({"samplers": ["top_k", "nucleus"]}, "samplers[1]", 400),
    ({"t_max_predict_ms": -1}, "t_max_predict_ms", 400),
    ({"n_cmpl": 9}, "n_cmpl", 400),
    ({"n_cmpl": 8, "n_predict": N_CTX // 8 + 1}, "n_cmpl", 400),  # issue 61: no bound on n_cmpl x n_predict
    ({"stop": "\n"}, "stop", 400),
    ({"top_p": 0}, "top_p", 400),
    ({"model": "gpt-4"}, "model", 404),
])
def test_fields_out_of_range_or_unknown_are_named(body, param, status):
    with pytest.raises(APIError) as e:
        parse(body)
    assert (e.value.status, e.value.param) == (status, param)


def test_n_cmpl_completions_share_one_context_of_tokens():
    """Issue 61: n_cmpl 8 with n_predict -1 each ran to the context's end (169 s in one run):
    now the completions of one request generate at most one context's worth in all."""
    assert parse({"n_cmpl": 8}).req.max_tokens == N_CTX // 8
    assert parse({"n_cmpl": 8, "n_predict": N_CTX // 8}).req.max_tokens == N_CTX // 8
    assert parse({"n_cmpl": 1}).req.max_tokens is None  # one completion: until the middle ends or the context fills
    assert parse({"n_cmpl": 2, "n_predict": 0}).req.max_tokens is None


def test_prefix_and_suffix_are_required_and_a_model_without_fim_tokens_is_named():
    for missing in ("input_prefix", "input_suffix"):
        with pytest.raises(APIError) as e:
            parse_infill({"input_prefix": "a", "input_suffix": "b", missing: None}, QWEN, N_CTX, True)
        assert e.value.param == missing
    with pytest.raises(APIError) as e:
        parse({}, fim=False)
    assert e.value.status == 400 and e.value.param == "input_suffix" and QWEN in e.value.message


def test_the_prompt_follows_the_prefix_and_samplers_choose_what_applies():
    ir = parse({"prompt": "    for", "input_extra": EXTRA})
    assert ir.req.fim.prefix == "a" and ir.req.fim.prompt == "    for" and ir.req.fim.suffix == "b" and ir.req.fim.extra == (("lucas.py",
                                                                                                 EXTRA[0]["text"]),)
    assert ir.samplers == DEFAULT_SAMPLERS and ir.req.options.sampling.temperature == 0.8  # llama.cpp's defaults
    vim = parse({"samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.9}).req.options.sampling
    assert (vim.temperature, vim.top_k, vim.top_p, vim.min_p) == (1.0, 40, 0.9, 0.0)  # no temperature sampler
    assert parse({"samplers": "kt", "temperature": 0}).req.options.sampling.greedy


# ------------------------------------------------------------------ the server, on qwen2.5-coder-0.5b

@pytest.fixture(scope="module")
def qwen():
    # One thread: the test thread also calls the decoder directly while the server is idle.
    dec = Decoder(target=QWEN, draft="ngram", num_speculative_tokens=4, n_ctx=N_CTX, n_threads=1, progress=False)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def app(qwen):
    return create_app(qwen, max_queue=4)


@pytest.fixture(scope="module")
def http(app):
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=300) as client:
        yield client


def fim_ids(qwen):
    """The FIM prompt /infill builds: PROMPT's tokens after PREFIX's, as llama.cpp puts them, in
    llama-server's budget for the served context (at 2048 tokens, no room for the files)."""
    from specdecode.backends.fim import FimBudget

    return qwen.prompt_ids(PREFIX, suffix=SUFFIX, extra=[(c["filename"], c["text"]) for c in EXTRA], fim_prompt=PROMPT,
                           fim_budget=FimBudget.for_context(qwen.target.n_ctx, 24))


def infill(http, **body):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": PROMPT, "input_extra": EXTRA, **body}
    return http.post("/infill", json=body)


def test_greedy_infill_is_plain_decoding_of_the_same_fim_prompt(qwen, http):
    plain = qwen.generate(prompt_ids=fim_ids(qwen), max_tokens=24, temperature=0, plain=True)
    r0 = infill(http, n_predict=24, temperature=0, speculative={"draft": "none"})
    assert r0.status_code == 200, r0.text
    assert r0.json()["content"] == plain.text and r0.json()["timings"]["draft_n"] == 0
    r = infill(http, n_predict=24, temperature=0)  # speculation (prompt lookup)
    body = r.json()
    if body["content"] != plain.text:  # lossless but for llama.cpp's batched numerics at a near-tie
        _, _, report = qwen.compare(prompt_ids=fim_ids(qwen), max_tokens=24)
        assert report["parity"]["status"] == "near-tie", report
    assert body["stop"] is True and body["model"] == QWEN
    assert body["tokens_predicted"] == plain.stats.completion_tokens
    assert body["tokens_evaluated"] == plain.stats.prompt_tokens
    assert body["stop_type"] == ("eos" if plain.finish_reason == "stop" else "limit")
    t = body["timings"]
    assert t["prompt_n"] == body["tokens_evaluated"] - t["cache_n"] and t["predicted_n"] == body["tokens_predicted"]
    assert t["draft_n"] == body["speculation"]["drafted"] and t["draft_n_accepted"] == body["speculation"]["accepted"]
    assert body["generation_settings"]["n_ctx"] == N_CTX


def test_llama_vim_requests_replayed_as_its_source_builds_them(http):
    # ggml-org/llama.vim autoload/llama.vim (a1c8e6e), llama#fim, lines 796-825: the completion
    # request; lines 837-838 add model, which with the default config (model_fim '') is "" (the
    # check measures the literal string "g:llama_config.model_fim").
    fim = {
        "id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": PROMPT,
        "n_predict": 16, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"],
        "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 250,
        "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                            "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                            "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                            "tokens_cached"],
        "model": "",
    }
    r = http.post("/infill", json=fim)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == set(fim["response_fields"])  # llama.cpp's flat projection, read as 'timings/predicted_n'
    assert isinstance(body["content"], str) and body["timings/predicted_n"] <= 16  # sampled: may end at once
    # s:ring_update, lines 552-566 (and 578-579): the extra context alone, nothing generated (n_predict 0).
    ring = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": EXTRA, "prompt": "", "n_predict": 0,
            "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1, "response_fields": [""], "model": ""}
    r = http.post("/infill", json=ring)
    assert r.status_code == 200 and r.json() == {}
    r = http.post("/infill", json={**ring, "response_fields": ["tokens_predicted", "timings/cache_n"]})
    assert r.json()["tokens_predicted"] == 0  # the prompt read, nothing generated


def test_llama_vscode_requests_replayed_as_its_source_builds_them(http):
    # ggml-org/llama.vscode src/llama-server.ts (3938fb3), createRequestPayload, lines 200-214,
    # with defaultRequestParams (lines 121-127); chunks as src/extra-context.ts line 125 makes
    # them; n_cmpl is max_parallel_completions (default 3): llama.cpp then answers a list, which
    # src/completion.ts getComplFromContent (line 378) reads.
    chunks = [{"text": EXTRA[0]["text"], "time": 1733350000123, "filename": "/home/u/lucas.py"}]
    body = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": chunks, "prompt": PROMPT,
            "n_predict": 8, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 2500}
    r = http.post("/infill", json=body)
    assert r.status_code == 200, r.text
    answers = r.json()
    assert [a["index"] for a in answers] == [0, 1, 2]
    assert all(isinstance(a["content"], str) and a["generation_settings"]["n_ctx"] == N_CTX for a in answers)
    prep = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": chunks, "prompt": "", "n_predict": 0,
            "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1}  # lines 184-197: noPredict
    r = http.post("/infill", json=prep)
    assert r.status_code == 200 and r.json()["content"] == "" and r.json()["tokens_predicted"] == 0


def test_t_max_predict_ms_ends_at_the_first_newline_token_once_the_scripted_clock_is_past_it(qwen, app, http):
    full = qwen.generate(prompt_ids=fim_ids(qwen), max_tokens=24, temperature=0)
    pieces = [qwen.target.token_bytes(t).decode() for t in full.token_ids]
    assert any("\n" in p for p in pieces[:-1]), full.text  # the example has a line to cut after
    app.state.infill_clock = ScriptedClock(0.0, 3600.0)  # every step an hour after the prefill
    try:
        r = infill(http, n_predict=24, temperature=0, t_max_predict_ms=1000)
    finally:
        app.state.infill_clock = None
    body = r.json()
    # The text ends with the token holding the first newline (the tokens after it dropped).
    end = next(i for i, p in enumerate(pieces) if "\n" in p) + 1
    assert body["content"] == "".join(pieces[:end]) and body["stop_type"] == "limit"
    assert body["tokens_predicted"] < full.stats.completion_tokens  # the generation itself stopped
    # n_indent on the same completion: the output is the full text cut before the first line
    # indented less than 8 (an empty line or the unindented code after the function).
    lines = full.text.split("\n")
    short = next(i for i, line in enumerate(lines[1:], 1) if len(line) - len(line.lstrip(" \t")) < 8 and
                 (line.strip() or i < len(lines) - 1))
    cut = "\n".join(lines[:short]) + "\n" + lines[short][:len(lines[short]) - len(lines[short].lstrip(" \t"))]
    r = infill(http, n_predict=24, temperature=0, n_indent=8)
    assert r.json()["content"] == cut and r.json()["stop_type"] == "limit"


def test_stream_as_llama_cpp_streams_it(http):
    # n_indent cuts the streamed text as it cuts the whole answer (llama.cpp streams the cut line).
    whole = infill(http, n_predict=20, temperature=0, n_indent=8).json()
    assert whole["content"].endswith("\n    ") and whole["stop_type"] == "limit"  # cut before "return a"
    with http.stream("POST", "/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": PROMPT,
                                              "input_extra": EXTRA, "n_predict": 20, "temperature": 0,
                                              "n_indent": 8, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    *parts, last = events
    assert all(p["stop"] is False for p in parts) and last["stop"] is True and last["content"] == ""
    assert "".join(p["content"] for p in parts) == whole["content"]
    assert last["tokens_predicted"] == whole["tokens_predicted"] and "timings" in last


def test_unknown_fields_and_bad_values_get_one_400_from_the_server(http):
    for body, param in (({"n_probs": 3}, "n_probs"), ({"n_predict": 1 << 40}, "n_predict"),
                        ({"input_extra": [{"filename": "a", "text": None}]}, "input_extra[0].text"),
                        ({"prompt": 5}, "prompt")):  # /infill's own prompt field keeps its name
        # (n_predict beyond what the context leaves is a bound, as llama.cpp takes it: not refused)
        r = infill(http, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_server_access_checks_hold_on_infill(http):
    # The Host and Origin checks of every endpoint (a page of another site may not call it).
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 1}
    assert http.post("/infill", json=body, headers={"Host": "evil.example"}).status_code == 403
    assert http.post("/infill", json=body, headers={"Origin": "http://evil.example"}).status_code == 403


def test_a_model_without_fim_tokens_is_a_400_naming_it():
    dec = Decoder(target=SMOLLM, draft="none", n_ctx=512, n_threads=1, progress=False)
    try:
        with ServerThread(create_app(dec)) as s:
            r = httpx.post(s.url + "/infill", json={"input_prefix": "def f():\n", "input_suffix": ""}, timeout=60)
    finally:
        dec.close()
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input_suffix" and SMOLLM in r.json()["error"]["message"]
