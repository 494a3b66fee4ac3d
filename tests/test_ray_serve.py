"""Scale-out on Ray Serve: a local Ray instance on 127.0.0.1, two replicas of smollm2 behind
Ray's HTTP proxy, driven by the openai client: completions, chat, streaming, and outputs
equal to the single server's (the same app on one process)."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest
import ray

from specdecode.api import Decoder
from specdecode.server import ServerOptions, create_app

from test_server import CHAT, MODEL, PROMPTS, ServerThread

KW = dict(target=MODEL, draft="ngram", num_speculative_tokens=4, n_ctx=512, n_threads=1, parallel=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_url():
    from specdecode.server.ray_serve import serve_replicas, shutdown

    port, metrics = free_port(), free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        options = ServerOptions(model_name=MODEL, host="127.0.0.1", port=port, replicas=2, max_queue=8,
                                max_body_bytes=1 << 20, metrics_port=metrics, warmup=True)
        serve_replicas(dict(KW, progress=False), options, block=False)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:  # the replicas load their models and warm up
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the Ray Serve replicas did not come up"
            time.sleep(1)
        yield url, metrics
    finally:
        shutdown()


@pytest.fixture(scope="module")
def single():
    dec = Decoder(**KW, progress=False)
    with ServerThread(create_app(dec, warmup=True)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
    dec.close()


def test_two_replicas_answer_the_openai_client_as_the_single_server(ray_url, single):
    url, metrics_port = ray_url
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == [MODEL]
    for prompt in PROMPTS[:2]:
        a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        b = single.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert a.choices[0].text == b.choices[0].text
        assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens, b.usage.completion_tokens)
        assert a.speculation["draft"] == "ngram"  # the app's own response, through Ray's proxy
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    ref = single.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == ref.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.choices[0].message.content
    # Both replicas serve, and each one's own metrics stay reachable on its port.
    seen = {httpx.get(url + "/health", timeout=30).json()["replica"] for _ in range(20)}
    assert len(seen) == 2, seen
    served = 0.0
    for rank in range(2):
        text = httpx.get(f"http://127.0.0.1:{metrics_port + rank}/metrics", timeout=10).text
        assert "specdecode:request_success_total" in text
        served += sum(float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith("specdecode:request_success_total"))
    assert served == 4  # the four requests above, wherever the router sent them


def test_app_builder_reads_key_value_strings(monkeypatch):
    """``serve run ...:app_builder key=value``: the Decoder's options and the server's,
    each converted from its string to its option's type."""
    from specdecode.server import ray_serve

    seen = {}
    monkeypatch.setattr(ray_serve, "build_deployment",
                        lambda kwargs, options: seen.update(kwargs=kwargs, options=options))
    ray_serve.app_builder({"target": MODEL, "num_speculative_tokens": "4", "n_ctx": "512", "parallel": "2",
                           "replicas": "2", "max_queue": "8", "max_body_bytes": "1000", "autoscaling": '{"max_replicas": 3}'})
    assert seen["kwargs"] == {"target": MODEL, "num_speculative_tokens": 4, "n_ctx": 512, "parallel": 2}
    o = seen["options"]
    assert (o.model_name, o.replicas, o.max_queue, o.max_body_bytes, o.autoscaling, o.warmup) == (
        MODEL, 2, 8, 1000, {"max_replicas": 3}, True)
    ray_serve.app_builder({"num_speculative_tokens": "auto"})
    assert seen["kwargs"] == {"num_speculative_tokens": "auto"}
