"""The OpenAI-compatible server (specdecode.server) on smollm2-135m-instruct, served by
uvicorn in a background thread and driven by the official openai client (httpx where
the client cannot send what a test needs)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specdecode.api import Decoder
from specdecode.cli import build_parser
from specdecode.errors import SpecDecodeError
from specdecode.limits import MAX_N
from specdecode.server import create_app

MODEL = "smollm2-135m-instruct"
N_CTX = 512
MAX_QUEUE = 6  # small, so that the load test sees both served and refused requests

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a list of three fruits:",
    "Once upon a time, in a small village,",
]
CHAT = [{"role": "user", "content": "Name three primary colours, briefly."}]


class ServerThread:
    """uvicorn serving an app on a free loopback port, in a daemon thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def decoder():
    # One thread: on 2 shared cores, llama.cpp's OpenMP team spins badly when a core is busy,
    # and the test thread also calls the decoder directly (see test_completion_...).
    dec = Decoder(target=MODEL, draft=MODEL, num_speculative_tokens=4, n_ctx=N_CTX, n_threads=1, progress=False)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def server(decoder):
    with ServerThread(create_app(decoder, max_queue=MAX_QUEUE, warmup=True)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def metrics(http) -> dict[tuple[str, tuple], float]:
    text = http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(m: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and want <= set(lab))


def greedy_completion(client, prompt: str, max_tokens: int) -> openai.types.Completion:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)


# ------------------------------------------------------------------ basics



def counts(usage) -> dict:
    """A usage's token counts, without how much of the prompt a slot's cache held (which
    depends on the requests before)."""
    return {k: v for k, v in usage.model_dump().items() if k != "prompt_tokens_details"}

def test_health_and_models(client, http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_stream_matches_plain_call_and_usage_is_exact(client, decoder):
    prompt = PROMPTS[1]
    r = greedy_completion(client, prompt, 24)
    choice = r.choices[0]
    n_prompt = len(decoder.prompt_ids(prompt))
    assert r.model == MODEL and r.object == "text_completion"
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 24
    spec = r.speculation
    for key in ("drafted", "accepted", "acceptance_rate", "mean_accepted_length"):
        assert key in spec
    assert spec["completion_tokens"] == r.usage.completion_tokens
    assert spec["drafted"] > 0 and spec["accepted"] > 0  # the model drafts for itself

    # The server adds nothing: same text as the library called directly.
    direct = decoder.generate(prompt, max_tokens=24)
    assert direct.text == choice.text and direct.finish_reason == choice.finish_reason

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == choice.finish_reason
    assert finals[0].speculation["completion_tokens"] == r.usage.completion_tokens
    last = chunks[-1]
    assert last.choices == [] and counts(last.usage) == counts(r.usage)
    assert last.speculation["drafted"] > 0


def test_chat_stream_matches_nonstream_and_usage_is_exact(client, decoder):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert r.usage.prompt_tokens == len(decoder.prompt_ids(messages=CHAT))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 20
    assert r.speculation["accepted"] <= r.speculation["drafted"]

    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].speculation["completion_tokens"] == r.usage.completion_tokens
    # Usage only when stream_options.include_usage asks for it (as OpenAI): on no chunk here.
    assert all(c.usage is None for c in chunks)


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], temperature=0)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (16, "length")


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) <= 3 and max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs, lp.token_logprobs))

    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert b"".join(bytes(t.bytes) for t in content).decode() == c.choices[0].message.content

    # Streamed: each chunk carries the logprobs of the tokens its text completes.
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert chunks[-1].choices[0].finish_reason and chunks[-1].choices[0].logprobs is None


def joined_completion_logprobs(chunks) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs:
            for key in out:
                out[key] += getattr(ch.choices[0].logprobs, key)
    return out


@pytest.mark.parametrize("stop", [None, "stop"])
def test_streamed_logprobs_ride_on_their_chunks_and_concatenate_to_the_full_ones(client, stop):
    # Seeded sampling: the stream and the full response generate the same tokens.
    kw = dict(model=MODEL, max_tokens=24, temperature=0.8, seed=99)
    if stop:  # a stop string inside the text: tokens cut by it are reported by neither
        full = client.completions.create(prompt=PROMPTS[3], **kw).choices[0].text
        kw["stop"] = full[len(full) // 2:len(full) // 2 + 3]
        assert kw["stop"].strip(), full
    r = client.completions.create(prompt=PROMPTS[3], logprobs=2, **kw)
    chunks = list(client.completions.create(prompt=PROMPTS[3], logprobs=2, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert joined_completion_logprobs(chunks) == r.choices[0].logprobs.model_dump()
    with_logprobs = [c for c in chunks if c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    assert len(with_logprobs) > 1 or stop, "logprobs must be spread over the chunks, not sent at the end"
    for c in with_logprobs:  # a chunk's tokens are those its text (or text held before it) completes
        assert c.choices[0].text or c is with_logprobs[-1]
    assert chunks[-1].choices[0].finish_reason and chunks[-1].choices[0].logprobs is None

    cr = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=2, **kw)
    cchunks = list(client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=2, stream=True, **kw))
    streamed = [t.model_dump() for ch in cchunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert streamed == [t.model_dump() for t in cr.choices[0].logprobs.content]
    assert len(streamed) == cr.usage.completion_tokens
    assert sum(1 for ch in cchunks if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content) > 1


def test_stop_strings(client):
    full = greedy_completion(client, PROMPTS[3], 32).choices[0].text
    stop = full[12:16]
    assert stop.strip(), full
    cut = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=32, temperature=0,
                                  stop=[stop, "\u2603never"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=32, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    def sample(seed, stream=False):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a short story about a cat."}],
                  max_tokens=16, temperature=0.8, top_p=0.95, seed=seed)
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))

    a = sample(1234)
    assert sample(1234) == a
    assert sample(1234, stream=True) == a
    assert len({a, sample(1), sample(2)}) > 1


def test_missing_temperature_samples_as_openai(client):
    # OpenAI's default temperature is 1: unseeded requests differ, seeded ones repeat.
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=16)
    texts = [client.completions.create(**kw).choices[0].text for _ in range(4)]
    assert len(set(texts)) > 1, texts
    seeded = [client.completions.create(seed=5, **kw).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    # Unseeded choices of one request draw independently too.
    choices = [c.text for c in client.completions.create(n=3, **kw).choices]
    assert len(set(choices)) > 1, choices
    chat = [client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16).choices[0].message.content
            for _ in range(3)]
    assert len(set(chat)) > 1, chat


# ------------------------------------------------------------------ n choices


def test_n_greedy_choices_are_plain_decoding_and_usage_adds_up(client, decoder, http):
    prompt = PROMPTS[0]
    direct = decoder.generate(prompt, max_tokens=10)
    before = metrics(http)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, n=3)
    after = metrics(http)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [direct.text] * 3
    assert r.usage.prompt_tokens == len(decoder.prompt_ids(prompt))  # counted once
    assert r.usage.completion_tokens == 3 * direct.stats.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # n > 1: the statistics are per choice; there is no top-level object.
    assert getattr(r, "speculation", None) is None
    specs = [c.speculation for c in r.choices]
    assert [sp["completion_tokens"] for sp in specs] == [direct.stats.completion_tokens] * 3
    assert all(sp["draft"] == MODEL and sp["drafted"] > 0 for sp in specs)

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("specdecode:request_success_total") == 3  # once per choice
    assert delta("specdecode:generation_tokens_total") == r.usage.completion_tokens
    assert delta("specdecode:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("specdecode:e2e_request_latency_seconds_count") == 1

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, n=2)
    one = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert [c.message.content for c in chat.choices] == [one.choices[0].message.content] * 2
    assert chat.usage.prompt_tokens == one.usage.prompt_tokens
    assert chat.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_n_seeded_choices_use_seed_plus_i_and_stream_in_turn(client):
    kw = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0.9, seed=10)
    r = client.completions.create(n=3, **kw)
    singles = [client.completions.create(**{**kw, "seed": 10 + i}).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == singles
    assert len(set(singles)) > 1, singles  # three seeds, three streams of draws

    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    indexes = [c.choices[0].index for c in chunks if c.choices]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1, 2}  # each choice in turn
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(ch.text for ch in mine) == singles[i]
        assert [ch.finish_reason is not None for ch in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].speculation["completion_tokens"] >= 1
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.usage is not None for c in finals] == [False, False, False]  # the usage comes after them
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(r.usage)

    cchunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, n=2,
                                                  stream=True))
    roles = [c.choices[0].index for c in cchunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    texts = ["".join(c.choices[0].delta.content or "" for c in cchunks if c.choices[0].index == i) for i in (0, 1)]
    assert texts[0] == texts[1] and texts[0]


# ------------------------------------------------------------------ bad input

BAD = [
    # (endpoint, body, status, param)
    ("c", {"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("c", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("c", {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("c", {"model": MODEL, "prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("c", {"model": MODEL, "prompt": "hi", "max_tokens": 8.5}, 400, "max_tokens"),
    ("x", {"model": MODEL, "messages": CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("c", {"model": MODEL, "prompt": "hi", "temperature": 3.5}, 400, "temperature"),
    ("c", {"model": MODEL, "prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("c", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("c", {"model": MODEL, "prompt": "hi", "temperature": True}, 400, "temperature"),
    ("c", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("c", {"model": MODEL, "prompt": "hi", "top_k": -1}, 400, "top_k"),
    ("c", {"model": MODEL, "prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("c", {"model": MODEL, "prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    ("x", {"model": MODEL, "messages": CHAT, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("c", {"model": MODEL, "prompt": "hi", "seed": -1}, 400, "seed"),
    ("c", {"model": MODEL, "prompt": "hi", "n": MAX_N + 1}, 400, "n"),
    ("x", {"model": MODEL, "messages": CHAT, "n": 0}, 400, "n"),
    ("c", {"model": MODEL, "prompt": "hi", "n": 2, "max_tokens": N_CTX // 2 + 1}, 400, "n"),
    ("c", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("c", {"model": MODEL, "prompt": "hi", "stop": 5}, 400, "stop"),
    ("c", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("c", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("c", {"model": MODEL, "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("x", {"model": MODEL, "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("x", {"model": MODEL, "messages": CHAT, "logprobs": 3}, 400, "logprobs"),
    ("c", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
    ("c", {"model": MODEL, "prompt": "hi", "logit_bias": {"50": -100}}, 400, "logit_bias"),
    ("c", {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("c", {"model": MODEL, "prompt": "hi", "temprature": 0.5}, 400, "temprature"),
    ("x", {"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("c", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("c", {"model": MODEL, "prompt": 123}, 400, "prompt"),
    ("c", {"model": MODEL}, 400, "prompt"),
    ("c", {"prompt": "hi"}, 400, "model"),
    ("c", {"model": 7, "prompt": "hi"}, 400, "model"),
    ("x", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("x", {"model": MODEL, "messages": []}, 400, "messages"),
    ("x", {"model": MODEL, "messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role"),
    ("x", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("x", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]"),
    ("x", {"model": MODEL, "prompt": "hi"}, 400, "prompt"),
    ("c", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("x", {"model": "gpt-4", "messages": CHAT}, 404, "model"),
    # Found only when the prompt is tokenized (in the worker):
    ("c", {"model": MODEL, "prompt": "word " * 700, "max_tokens": 4}, 400, None),
    ("x", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 700}], "stream": True}, 400, None),
    ("c", {"model": MODEL, "prompt": "word " * 400, "max_tokens": 300}, 400, "max_tokens"),
]


def check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("endpoint,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_4xx_with_openai_error(http, endpoint, body, status, param):
    path = "/v1/completions" if endpoint == "c" else "/v1/chat/completions"
    err = check_error(http.post(path, json=body), status, param)
    if param is not None:
        assert param.split("[")[0] in err["message"], err  # the message names the field ...
    if param in body and not isinstance(body[param], (dict, list)) and "unsupported" not in err["message"]:
        assert str(body[param]).lower()[:8] in err["message"].lower(), err  # ... and its value
    if status == 404:
        assert "gpt-4" in err["message"] and MODEL in err["message"]
    if body.get("prompt") == "word " * 700 or "messages" in body and "word word" in json.dumps(body):
        assert err["code"] == "context_length_exceeded"
    assert http.get("/health").status_code == 200


def test_malformed_requests_and_routes(http, client):
    check_error(http.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"}), 400)
    check_error(http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    check_error(http.post("/v1/chat/completions", content=b'{"model": NaN}', headers={"content-type": "application/json"}), 400)
    check_error(http.post("/v1/chat/completions", content=b"\xff\xfe", headers={"content-type": "application/json"}), 400)
    check_error(http.get("/v1/nothing-here"), 404)
    check_error(http.get("/v1/completions"), 405)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    # Still serving.
    assert http.get("/health").json()["status"] == "ok"
    assert greedy_completion(client, PROMPTS[0], 4).usage.completion_tokens >= 1


# ------------------------------------------------------------------ who may call, and how much


KEY = "sk-test-0123456789abcdef"
SMALL_BODY = 4096


@pytest.fixture(scope="module")
def guarded(decoder):
    """A second server on the same decoder (the tests run one at a time): an API key and a
    small body limit. Its worker's submit is counted, to show what never reaches it."""
    app = create_app(decoder, max_queue=2, api_key=KEY, max_body_bytes=SMALL_BODY)
    worker = app.state.worker
    submitted = []
    submit = worker.submit
    worker.submit = lambda job: submitted.append(job) or submit(job)
    with ServerThread(app) as s:
        s.submitted = submitted
        yield s


def test_api_key_is_required_on_v1_and_checked_before_anything(guarded, server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    wrong = KEY[:-1] + ("0" if KEY[-1] != "0" else "1")  # differs in the last character only
    with httpx.Client(base_url=guarded.url, timeout=60) as h:
        before = metrics(h)
        n_before = len(guarded.submitted)
        attempts = [
            h.post("/v1/completions", json=body),
            h.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-wrong"}),
            h.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {wrong}"}),
            h.post("/v1/completions", json=body, headers={"Authorization": KEY}),  # no scheme
            h.post("/v1/completions", json=body, headers={"Authorization": f"Basic {KEY}"}),
            h.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}x"}),
            # Refused before the body is read: neither its size nor its syntax is looked at.
            h.post("/v1/chat/completions", content=b"{not json" * 1000, headers={"Authorization": "Bearer nope"}),
            h.get("/v1/models"),
            h.get("/v1/nothing-here"),
        ]
        for r in attempts:
            err = check_error(r, 401)
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error", err
            assert r.headers["www-authenticate"] == "Bearer"
            assert KEY not in r.text
        after = metrics(h)
        # /health and /metrics stay open.
        assert h.get("/health").json()["status"] == "ok"
        assert h.get("/metrics").status_code == 200
        # The scheme's case does not matter (RFC 7235).
        ok = h.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL
    assert len(guarded.submitted) == n_before  # the worker never saw them

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("specdecode:request_rejected_total", reason="unauthorized") == len(attempts)
    assert delta("specdecode:request_rejected_total") == len(attempts)
    for name in ("specdecode:request_success_total", "specdecode:request_queue_time_seconds_count",
                 "specdecode:request_aborted_total"):
        assert delta(name) == 0, name

    # The official client with the right key works, and gives what the open server gives.
    good = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = good.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    open_server = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert r.choices[0].text == greedy_completion(open_server, PROMPTS[0], 6).choices[0].text
    assert [m.id for m in good.models.list().data] == [MODEL]
    assert len(guarded.submitted) == n_before + 1
    bad = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY[:-1], max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert e.value.code == "invalid_api_key"


def test_oversized_body_gets_413_and_the_server_stays_healthy(guarded, http, client):
    auth = {"Authorization": f"Bearer {KEY}"}
    big = json.dumps({"model": MODEL, "prompt": "x" * SMALL_BODY, "max_tokens": 2}).encode()
    with httpx.Client(base_url=guarded.url, timeout=60, headers=auth) as h:
        before = metrics(h)
        n_before = len(guarded.submitted)
        err = check_error(h.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
        assert err["code"] == "request_too_large" and str(SMALL_BODY) in err["message"]

        def chunked():  # no Content-Length: the limit is found while reading
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]

        err = check_error(h.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}), 413)
        assert err["code"] == "request_too_large"
        assert h.get("/health").json()["status"] == "ok"
        after = metrics(h)
        # A body just within the limit is read and served, on the same connection.
        fits = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
        fits["user"] = "u" * (SMALL_BODY - len(json.dumps(fits)) - 20)
        assert len(json.dumps(fits)) <= SMALL_BODY
        assert h.post("/v1/completions", json=fits).status_code == 200
    assert len(guarded.submitted) == n_before + 1
    assert (total(after, "specdecode:request_rejected_total", reason="too_large")
            - total(before, "specdecode:request_rejected_total", reason="too_large")) == 2

    # The default limit, 4 MiB, on the open server.
    huge = b'{"model": "' + b"m" * (4 << 20) + b'"}'
    check_error(http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}), 413)
    assert http.get("/health").json()["status"] == "ok"
    assert greedy_completion(client, PROMPTS[0], 2).usage.completion_tokens >= 1


def test_create_app_validates_the_key_and_the_body_limit(decoder):
    with pytest.raises(SpecDecodeError) as e:
        create_app(decoder, api_key="")
    assert e.value.param == "api_key"
    with pytest.raises(SpecDecodeError) as e:
        create_app(decoder, max_body_bytes=0)
    assert e.value.param == "max_body_bytes"


# ------------------------------------------------------------------ concurrency


def test_load_16_clients(server, client, http):
    # Three greedy prompts and one seeded sampling request; each must give its solo result.
    kinds = [(p, {"temperature": 0}) for p in PROMPTS[:3]] + [(PROMPTS[3], {"temperature": 0.8, "seed": 42})]
    solo = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, **kw) for p, kw in kinds}
    before = metrics(http)
    barrier = threading.Barrier(16)

    def run_client(i: int) -> list[tuple]:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        out = []
        barrier.wait()
        for j in range(4):
            prompt, kw = kinds[(i + j) % len(kinds)]
            try:
                if (i // 4 + j) % 2:
                    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True,
                                                       stream_options={"include_usage": True}, **kw))
                    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
                    out.append(("ok", prompt, text, chunks[-1].usage))
                else:
                    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **kw)
                    out.append(("ok", prompt, r.choices[0].text, r.usage))
            except openai.RateLimitError as e:
                out.append(("429", prompt, e.response.json(), None))
        return out

    with ThreadPoolExecutor(16) as pool:
        results = [r for rs in pool.map(run_client, range(16)) for r in rs]
    after = metrics(http)

    assert len(results) == 64
    ok = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "429"]
    assert len(ok) + len(refused) == 64
    assert ok and refused, (len(ok), len(refused))
    for _, prompt, text, usage in ok:
        assert text == solo[prompt].choices[0].text
        assert counts(usage) == counts(solo[prompt].usage)
    for _, _, body, _ in refused:
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == "queue_full"

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("specdecode:request_success_total") == len(ok)
    assert delta("specdecode:request_rejected_total", reason="queue_full") == len(refused)
    assert delta("specdecode:generation_tokens_total") == sum(u.completion_tokens for *_, u in ok)
    assert delta("specdecode:prompt_tokens_total") == sum(u.prompt_tokens for *_, u in ok)
    assert delta("specdecode:time_to_first_token_seconds_count") == len(ok)
    assert delta("specdecode:num_accepted_tokens_total") == delta("specdecode:num_accepted_tokens_per_pos_total")
    assert delta("specdecode:num_accepted_tokens_total") <= delta("specdecode:num_draft_tokens_total")
    assert delta("specdecode:num_drafts_total") > 0
    assert after[("specdecode:num_requests_waiting", ())] == 0


def test_client_disconnect_cancels_and_frees_the_worker(server, client, http):
    solo = greedy_completion(client, PROMPTS[2], 8)
    before = metrics(http)
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            line = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(line[6:])["choices"][0]["text"] is not None
    # A non-streaming request whose client gives up waiting.
    with httpx.Client(base_url=server.url, timeout=0.5) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/completions", json={**body, "stream": False})

    again = greedy_completion(client, PROMPTS[2], 8)
    assert again.choices[0].text == solo.choices[0].text
    assert counts(again.usage) == counts(solo.usage)
    after = metrics(http)
    # Counted as aborted, not as finished: both were stopped before their end.
    assert total(after, "specdecode:request_aborted_total") - total(before, "specdecode:request_aborted_total") == 2
    assert total(after, "specdecode:request_success_total") - total(before, "specdecode:request_success_total") == 1
    assert (total(after, "specdecode:generation_tokens_total") - total(before, "specdecode:generation_tokens_total")
            == again.usage.completion_tokens)


# ------------------------------------------------------------------ construction and CLI


def test_create_app_validates_max_queue(decoder):
    with pytest.raises(SpecDecodeError, match="max_queue = 0"):
        create_app(decoder, max_queue=0)


def test_serve_subcommand_options():
    args = build_parser().parse_args(["serve", "--target", MODEL, "--draft", "ngram"])
    assert (args.host, args.port, args.max_queue, args.num_speculative_tokens) == ("127.0.0.1", 8000, 16, "auto")
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "9001", "--max-queue", "3",
                                      "--ctx-size", "1024", "--threads", "2", "-k", "6"])
    assert (args.host, args.port, args.max_queue, args.ctx_size, args.threads, args.num_speculative_tokens) == (
        "0.0.0.0", 9001, 3, 1024, 2, 6)
    assert args.func.__name__ == "cmd_serve"


def test_serve_names_a_host_or_port_it_cannot_listen_on_before_loading_anything():
    import socket

    from specdecode.server.cli import check_listen_address

    with pytest.raises(SpecDecodeError, match=r"--host evil\.invalid: not an address of this machine"):
        check_listen_address("evil.invalid", 8000)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SpecDecodeError, match=rf"--port {port}: cannot listen there .*in use"):
            check_listen_address("127.0.0.1", port)
    check_listen_address("127.0.0.1", port)  # free again
    check_listen_address("127.0.0.1", 0)  # any free port


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_through_the_openai_client(client, stream):
    for rf, content, check in [
        ({"type": "json_object"}, 'Reply with the JSON object {"ok": true} and nothing else.',
         lambda obj: isinstance(obj, dict)),
        ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
         "Give a person as JSON.", lambda obj: set(obj) == {"name", "age"} and isinstance(obj["age"], int)),
    ]:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=64, temperature=0,
                  response_format=rf)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        else:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        assert check(json.loads(text)), text


def test_a_schema_that_cannot_be_compiled_answers_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert e.value.body["param"] == "response_format" and "nonsense" in e.value.body["message"]
