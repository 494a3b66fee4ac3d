"""The server with several slots (--parallel): concurrent requests share batched steps;
each output equals its solo run (or differs first at a near-tie of the solo run: a batch's
kernels differ from a lone sequence's); the queue bound, disconnects and slot reuse."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specdecode.api import Decoder
from specdecode.cli import build_parser
from specdecode.errors import SpecDecodeError
from specdecode.parity import NEAR_TIE_GAP
from specdecode.server import create_app

from test_server import MODEL, PROMPTS, ServerThread, metrics, total

SLOTS = 4


@pytest.fixture(scope="module")
def decoder():
    dec = Decoder(target=MODEL, draft="ngram", num_speculative_tokens=4, n_ctx=512, n_threads=1, progress=False,
                  parallel=SLOTS)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def server(decoder):
    with ServerThread(create_app(decoder, max_queue=8, warmup=True)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


# Eight requests of different lengths, stop conditions and sampling.
REQUESTS = [
    dict(prompt=PROMPTS[0], max_tokens=1, temperature=0),
    dict(prompt=PROMPTS[1], max_tokens=40, temperature=0),
    dict(prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=["\n"]),
    dict(prompt=PROMPTS[3], max_tokens=32, temperature=0.8, seed=7),
    dict(prompt="def add(a, b):\n    return a + b\n\ndef sub(a, b):", max_tokens=30, temperature=0),
    dict(prompt=PROMPTS[1], max_tokens=16, temperature=0.7, seed=3, top_p=0.9),
    dict(prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0, stop=["9"]),
    dict(prompt=PROMPTS[0], max_tokens=12, temperature=0),
]


def run(client, req: dict):
    return client.completions.create(model=MODEL, logprobs=2, **req)


def equal_or_near_tie(batched, solo) -> bool:
    """Same tokens; or the first differing token is one where the solo run's two most likely
    tokens were within NEAR_TIE_GAP (logprob gap = logit gap): the batch's slightly
    different logits flipped a near-tie."""
    a, b = batched.choices[0].logprobs.tokens, solo.choices[0].logprobs.tokens
    if a == b:
        return True
    j = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    if j >= len(b):
        return False
    values = sorted(solo.choices[0].logprobs.top_logprobs[j].values(), reverse=True)
    return len(values) > 1 and values[0] - values[1] <= NEAR_TIE_GAP


def test_eight_concurrent_requests_equal_their_solo_runs(server, client):
    solo = [run(client, r) for r in REQUESTS]  # one at a time: the batch of one
    http = httpx.Client(base_url=server.url, timeout=30)
    before = metrics(http)
    barrier = threading.Barrier(len(REQUESTS) + 1)
    peak = []

    def watch():
        barrier.wait()
        end = time.monotonic() + 60
        while time.monotonic() < end and len(peak) < 400:
            peak.append(http.get("/health").json()["running"])
            time.sleep(0.05)

    def one(req):
        barrier.wait()
        return run(openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120), req)

    with ThreadPoolExecutor(len(REQUESTS) + 1) as pool:
        w = pool.submit(watch)
        futures = [pool.submit(one, r) for r in REQUESTS]
        together = [f.result() for f in futures]
        peak.append(-1)  # stop the watcher
        w.result()
    # Greedy requests: equal to their solo runs or a near-tie. Sampled ones ran beside them
    # (their seeds make them repeatable alone); on llama.cpp a batch's logits differ from a
    # lone sequence's by ~0.1, which moves a seeded draw wherever it falls near the boundary
    # between two tokens, so they are compared in distribution, not draw by draw (exact
    # equality where logits are bit-identical: test_batching.py on the fakes).
    exact = 0
    for req, b, s in zip(REQUESTS, together, solo):
        if req["temperature"] == 0:
            assert equal_or_near_tie(b, s), (req, b.choices[0].text, s.choices[0].text)
            exact += b.choices[0].text == s.choices[0].text
        else:
            assert b.choices[0].finish_reason == "length" and b.usage.completion_tokens == req["max_tokens"]
    # Which requests share a step (and so whose logits move by ~0.1) depends on timing, and
    # on a loaded machine more of them flip a near-tie (CI measured 4 of 6 exact): each
    # difference is checked above to start at a near-tie; at least half stay exact.
    assert exact >= 3
    assert max(peak) == SLOTS  # four ran at once: no request waited while a slot was free
    after = metrics(http)
    assert total(after, "specdecode:request_success_total") - total(before, "specdecode:request_success_total") == 8
    assert total(after, "specdecode:num_requests_running") == 0


def test_the_queue_bound_answers_429_beyond_slots_and_queue(server):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0}
    barrier = threading.Barrier(20)

    def one(_):
        with httpx.Client(base_url=server.url, timeout=120) as h:
            barrier.wait()
            return h.post("/v1/completions", json=body).status_code

    with ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(one, range(20)))
    # At most 8 wait (besides the 4 running): at least 8 served, the rest refused.
    assert codes.count(200) >= 8 and set(codes) <= {200, 429} and 429 in codes, codes


def test_a_disconnect_frees_the_slot(server, client):
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
            assert h.get("/health").json()["running"] == 1
        deadline = time.monotonic() + 30
        while h.get("/health").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.get("/health").json()["running"] == 0
    # The slot it held serves the next request exactly.
    a = run(client, REQUESTS[3])
    assert a.choices[0].text == run(client, REQUESTS[3]).choices[0].text


def test_parallel_option_is_checked():
    args = build_parser().parse_args(["serve", "--parallel", "4"])
    assert args.parallel == 4
    with pytest.raises(SpecDecodeError, match="parallel = 0 is out of range"):
        Decoder(target=MODEL, draft="none", parallel=0, progress=False)


def test_ray_serve_options_are_checked_before_anything_starts(capsys):
    from specdecode.cli import main

    assert main(["serve", "--replicas", "0"]) != 0
    assert "--replicas 0 is out of range" in capsys.readouterr().err
    assert main(["serve", "--autoscaling", "{not json"]) != 0
    assert "--autoscaling is not valid JSON" in capsys.readouterr().err
