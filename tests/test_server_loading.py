"""A server that answers while it starts (issue 46, item 3): the port is bound at once, every
request gets 503 with a JSON "loading" body and Retry-After until the models are loaded, then
the real app (its lifespan run) answers. The load is held by an event (in process) or by the
documented test gate, SPECDECODE_TEST_LOAD_GATE (a process): never by the clock."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from specdecode.errors import SpecDecodeError
from specdecode.server.config import ServerOptions
from specdecode.server.loading import LOAD_GATE_ENV, RETRY_AFTER_S, LoadingApp

MODEL = "smollm2-135m-instruct"
WAIT_S = 120  # only a bound on a hang: how long anything took is never judged


class Toy:
    """What ``load`` returns: a real app (Starlette) whose lifespan is recorded."""

    def __init__(self) -> None:
        import contextlib

        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.events: list[str] = []

        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.events.append("startup")
            yield
            self.events.append("shutdown")

        async def health(request):
            return JSONResponse({"status": "ok"})

        self.app = Starlette(routes=[Route("/health", health)], lifespan=lifespan)


class Harness:
    """A LoadingApp whose load waits for ``release`` and then returns ``result`` (or raises it)."""

    def __init__(self, result) -> None:
        self.release, self.ready, self.failed = threading.Event(), threading.Event(), threading.Event()
        self.stopped: list = []
        self.result = result
        self.clock = [100.0]

        def load():
            assert self.release.wait(WAIT_S)
            if isinstance(self.result, BaseException):
                raise self.result
            return self.result

        self.loading = LoadingApp(load, MODEL, ServerOptions(), on_ready=self.ready.set,
                                  on_failed=lambda e: self.failed.set(), stop=self.stopped.append,
                                  clock=lambda: self.clock[0])


def loading_error(r: httpx.Response) -> dict:
    assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S), (r.status_code, r.headers)
    return r.json()


def test_every_endpoint_answers_503_loading_until_the_real_app_has_started():
    from starlette.testclient import TestClient

    toy = Toy()
    h = Harness(toy.app)
    with TestClient(h.loading, base_url="http://127.0.0.1") as client:
        h.clock[0] = 103.25
        body = loading_error(client.get("/health"))
        assert body["status"] == "loading" and body["model"] == MODEL and body["loading_s"] == 3.2
        assert body["error"]["code"] == "model_loading" and MODEL in body["error"]["message"]
        err = loading_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}))["error"]
        assert err == {"message": f"the model {MODEL} is loading: try again in a few seconds",
                       "type": "server_error", "param": None, "code": "model_loading"}
        assert loading_error(client.get("/v1/models"))["error"]["code"] == "model_loading"
        # Ollama's routes in Ollama's shape.
        assert loading_error(client.post("/api/chat", json={})) == {"error": err["message"]}
        # The Host and Origin checks hold while loading too.
        r = client.get("/v1/models", headers={"Host": "rebind.evil.example"})
        assert r.status_code == 403 and r.json()["error"]["param"] == "Host"
        r = client.post("/v1/completions", json={}, headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["param"] == "Origin"
        assert toy.events == [] and not h.ready.is_set()

        h.release.set()
        assert h.ready.wait(WAIT_S)
        assert toy.events == ["startup"]  # the real app's lifespan ran before it got a request
        r = client.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"} and "retry-after" not in r.headers
        h.loading.closing()  # what SIGTERM does: the real app is told to stop at once
        assert h.stopped == [toy.app]
    assert toy.events == ["startup", "shutdown"]  # and its lifespan shutdown ran with the server's
    h.loading.join()


def test_a_failed_load_is_reported_and_the_answers_stay_loading():
    from starlette.testclient import TestClient

    h = Harness(SpecDecodeError("model file /x.gguf does not exist"))
    with TestClient(h.loading, base_url="http://127.0.0.1") as client:
        h.release.set()
        assert h.failed.wait(WAIT_S)
        assert isinstance(h.loading.error, SpecDecodeError) and "/x.gguf" in str(h.loading.error)
        assert loading_error(client.get("/health"))["status"] == "loading"  # serve stops the server now
    h.loading.join()
    assert not h.ready.is_set()


def test_a_shutdown_during_the_load_never_starts_the_real_app():
    from starlette.testclient import TestClient

    toy = Toy()
    h = Harness(toy.app)
    with TestClient(h.loading, base_url="http://127.0.0.1") as client:
        assert loading_error(client.get("/health"))["status"] == "loading"
        h.loading.closing()
    h.release.set()  # the load returns after the server stopped (llama.cpp cannot be interrupted)
    h.loading.join()
    assert toy.events == [] and not h.ready.is_set() and h.loading.app is None and h.loading.error is None


# ------------------------------------------------------------------ the process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(tmp_path, *extra: str, target: str = MODEL, gate: bool = True):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if gate:
        env[LOAD_GATE_ENV] = str(tmp_path / "gate")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "specdecode", "serve", "--target", target, "--draft", "none",
                             "--ctx-size", "1024", "--threads", "1", "--port", str(port), *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}", log


def poll_health(proc, url: str, tmp_path) -> httpx.Response:
    deadline = time.monotonic() + WAIT_S
    while True:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        try:
            return httpx.get(url + "/health", timeout=5)
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the port was never bound"
            time.sleep(0.1)


def finish(proc, log, sig: int | None = None) -> int:
    try:
        if sig is not None:
            proc.send_signal(sig)
        return proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_serve_answers_loading_then_serves_and_sigterm_exits_0(tmp_path):
    proc, url, log = serve(tmp_path)
    try:
        body = loading_error(poll_health(proc, url, tmp_path))  # the port answers while the load is held
        assert body["status"] == "loading" and body["error"]["code"] == "model_loading"
        from openai import InternalServerError, OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(InternalServerError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "model_loading"
        assert "specdecode: serving" not in (tmp_path / "serve.log").read_text()

        (tmp_path / "gate").touch()
        deadline = time.monotonic() + WAIT_S
        while (r := poll_health(proc, url, tmp_path)).status_code == 503:
            assert time.monotonic() < deadline, "the model never became ready"
            time.sleep(0.1)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert out.usage.completion_tokens >= 1
        rc = finish(proc, log, signal.SIGTERM)
    finally:
        finish(proc, log)
    text = (tmp_path / "serve.log").read_text()
    assert rc == 0 and "Traceback" not in text, text
    assert text.index("answers 503 (model_loading)") < text.index("specdecode: serving"), text


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_signal_during_the_load_exits_cleanly(tmp_path, sig, status):
    proc, url, log = serve(tmp_path)
    try:
        assert loading_error(poll_health(proc, url, tmp_path))["status"] == "loading"
        rc = finish(proc, log, sig)
    finally:
        finish(proc, log)
    text = (tmp_path / "serve.log").read_text()
    assert rc == status and "Traceback" not in text and "specdecode: serving" not in text, (rc, text)
    assert "specdecode: error" not in text and (sig != signal.SIGINT or "specdecode: interrupted" in text), text


def test_sigint_once_serving_exits_130(tmp_path):
    proc, url, log = serve(tmp_path)
    try:
        (tmp_path / "gate").touch()
        deadline = time.monotonic() + WAIT_S
        while poll_health(proc, url, tmp_path).status_code == 503:
            assert time.monotonic() < deadline, "the model never became ready"
            time.sleep(0.1)
        rc = finish(proc, log, signal.SIGINT)
    finally:
        finish(proc, log)
    text = (tmp_path / "serve.log").read_text()
    assert rc == 130 and "specdecode: interrupted" in text and "Traceback" not in text, (rc, text)


def test_a_missing_model_file_still_exits_non_zero_with_one_error_line(tmp_path):
    missing = tmp_path / "missing.gguf"
    proc, url, log = serve(tmp_path, target=str(missing), gate=False)
    rc = finish(proc, log)
    text = (tmp_path / "serve.log").read_text()
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    assert rc != 0 and "Traceback" not in text, text
    assert errors == [f"specdecode: error: model file {missing} does not exist"], text
