"""The server with several slots (--parallel): concurrent requests share batched steps; each
strict greedy output equals its solo run token for token (``speculative.strict``: without it a
batch's kernels over the shared KV cache can move a greedy answer, by how the requests happened
to share steps); the queue bound, disconnects and slot reuse."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import httpx
import openai
import pytest

from specdecode.api import Decoder
from specdecode.cli import build_parser
from specdecode.errors import SpecDecodeError
from specdecode.server import create_app

from test_server import MODEL, PROMPTS, ServerThread, metrics, total

SLOTS = 4


@pytest.fixture(scope="module")
def decoder():
    # A KV cache per slot, as serve --strict loads: the greedy requests ask for strict mode.
    dec = Decoder(target=MODEL, draft="ngram", num_speculative_tokens=4, n_ctx=512, n_threads=1, progress=False,
                  parallel=SLOTS, kv_per_sequence=True)
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
    """The request; a greedy one in strict mode (exact whatever shares its steps)."""
    strict = {"extra_body": {"speculative": {"strict": True}}} if req["temperature"] == 0 else {}
    return client.completions.create(model=MODEL, logprobs=2, **req, **strict)


class StepGate:
    """The decoder's step (the worker's one call per batched step) wrapped: it records how
    many generations each step carries, and holds the worker (steps and admissions alike)
    until the test opens it, so that what is queued when the steps begin is known by count
    rather than by how fast the machine happened to be."""

    def __init__(self, decoder, monkeypatch) -> None:
        self.sizes: list[int] = []
        self.opened = threading.Event()
        real = decoder.step

        def step(gens):
            self.sizes.append(len(gens))
            if not self.opened.wait(120):
                raise RuntimeError("the test never opened the step gate")
            return real(gens)

        monkeypatch.setattr(decoder, "step", step)


def wait_until(done, what: str, timeout: float = 120) -> None:
    """Poll until done() (an event the test waits for, not a time it judges); the timeout
    only bounds a hang."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def in_server(http) -> int:
    """Requests the server holds: running plus waiting."""
    h = http.get("/health").json()
    return h["running"] + h["waiting"]


def test_eight_concurrent_requests_equal_their_solo_runs(server, client, decoder, monkeypatch):
    solo = [run(client, r) for r in REQUESTS]  # one at a time: the batch of one
    http = httpx.Client(base_url=server.url, timeout=30)
    before = metrics(http)
    gate = StepGate(decoder, monkeypatch)  # the worker holds at its first step until all 8 are in

    def one(req):
        return run(openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120), req)

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        futures = [pool.submit(one, r) for r in REQUESTS]
        try:
            wait_until(lambda: in_server(http) == len(REQUESTS) or any(f.done() for f in futures), "8 requests in")
        finally:
            gate.opened.set()
        together = [f.result() for f in futures]
    # Greedy (strict) requests: exactly their solo runs, tokens and logprobs, however the
    # requests shared steps. Sampled ones ran beside them without strict mode (their seeds make
    # them repeatable alone; beside others a batch's logits move a seeded draw that falls near
    # the boundary between two tokens, so only their lengths are judged here; exact equality
    # where logits are bit-identical: test_batching.py on the fakes).
    for req, b, s in zip(REQUESTS, together, solo):
        if req["temperature"] == 0:
            assert b.choices[0].logprobs.tokens == s.choices[0].logprobs.tokens, (req, b.choices[0].text,
                                                                                 s.choices[0].text)
            assert b.choices[0].text == s.choices[0].text and b.speculation["strict"]
        else:
            assert b.choices[0].finish_reason == "length" and b.usage.completion_tokens == req["max_tokens"]
    # No request waited while a slot was free: with 8 in and 4 slots, every step after the
    # held first one carries all 4 slots until the queue is empty, then fewer as they finish.
    after_gate = gate.sizes[1:]
    assert gate.sizes and 1 <= gate.sizes[0] <= SLOTS and after_gate and after_gate[0] == SLOTS, gate.sizes
    assert all(x >= y for x, y in pairwise(after_gate)), gate.sizes
    after = metrics(http)
    assert total(after, "specdecode:request_success_total") - total(before, "specdecode:request_success_total") == 8
    assert total(after, "specdecode:num_requests_running") == 0


def test_the_queue_bound_answers_429_beyond_slots_and_queue(server, decoder, monkeypatch):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0}
    http = httpx.Client(base_url=server.url, timeout=30)
    gate = StepGate(decoder, monkeypatch)  # nothing finishes until all 20 are answered or held
    codes: list[int] = []

    def one(_):
        with httpx.Client(base_url=server.url, timeout=120) as h:
            code = h.post("/v1/completions", json=body).status_code
            codes.append(code)
            return code

    with ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(one, i) for i in range(20)]
        try:
            wait_until(lambda: len(codes) + in_server(http) == 20, "all 20 answered or held")
            refused_while_held = list(codes)
        finally:
            gate.opened.set()
        final = [f.result() for f in futures]
    # 4 running and 8 waiting are held; the other 8 are refused at once; the held ones are served.
    assert sorted(refused_while_held) == [429] * 8, refused_while_held
    assert final.count(200) == SLOTS + 8 and final.count(429) == 8, final


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
    # Ray Serve's own check of the config, before Ray starts (it took 10 s and ended in pydantic's traceback)
    for config, needle in (('{"min_replicas": -1}', "min_replicas: Input should be greater than or equal to 0"),
                           ('{"min_replicas": 5, "max_replicas": 1}', "must be greater than or equal to min_replicas"),
                           ('{"foo": 1}', "unknown: foo")):
        assert main(["serve", "--autoscaling", config]) != 0
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--autoscaling" in err and needle in err, err


def test_an_api_key_no_client_can_send_is_refused(capsys, monkeypatch):
    from specdecode.cli import main

    for key in (" ", "two words", "line\nbreak", "ключ"):
        assert main(["serve", "--api-key", key]) != 0
        assert "--api-key is not valid: expected a non-empty string of printable ASCII" in capsys.readouterr().err
        monkeypatch.setenv("SPECDECODE_API_KEY", key)
        assert main(["serve"]) != 0
        err = capsys.readouterr().err
        assert "$SPECDECODE_API_KEY is not a key a client can send" in err and (key.strip() == "" or key not in err)
        monkeypatch.delenv("SPECDECODE_API_KEY")
