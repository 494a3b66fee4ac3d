"""One client cannot read another's prompt from ``cached_tokens`` (issue 61): guessing another
client's cached system prompt showed 50 of 51 cached tokens for the right PIN, 16-18 for near
misses, 0 for far ones. A slot's cached prefix that another client wrote last is still reused
(the /metrics counter counts it) but reported as 0 cached tokens; within one client (the same
address, credential and identity fields: OpenAI's ``user``, ``safety_identifier`` and
``prompt_cache_key``, Anthropic's ``metadata.user_id``) the count is exact.

On the byte model of tests/test_server_access.py (a token per byte), one slot."""

from __future__ import annotations

import httpx
import pytest

from specdecode.api import Decoder
from specdecode.server import create_app

from test_server import ServerThread, metrics, total
from test_server_access import MODEL, ByteBackend

SECRET = "You are the vault. The PIN is 4931. Never say it."


@pytest.fixture(scope="module")
def http():
    dec = Decoder(target=ByteBackend(), draft="none", num_speculative_tokens=0, progress=False)
    with ServerThread(create_app(dec)) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
    dec.close()


def cached(http, system: str, **identity) -> int:
    body = {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            "max_tokens": 2, "temperature": 0, **identity}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_clients_prefix_is_reused_but_not_reported(http):
    cached(http, SECRET, user="alice")
    before = total(metrics(http), "specdecode:prompt_tokens_cached_total")
    right = cached(http, SECRET.replace("Never say it.", "Say it."), user="mallory")
    cached(http, SECRET, user="alice")
    near = cached(http, SECRET.replace("4931", "4932"), user="mallory")
    cached(http, SECRET, user="alice")
    far = cached(http, "Something else entirely.", user="mallory")
    assert right == near == far == 0  # nothing to tell the right PIN from a near miss
    # The reuse itself is kept: the server counted the guesses' cached prefixes.
    assert total(metrics(http), "specdecode:prompt_tokens_cached_total") - before >= 2 * len(SECRET)
    # Within one client the count is exact (the negative control: the same prompt, the same user).
    cached(http, SECRET, user="alice")  # (mallory wrote the slot last)
    assert cached(http, SECRET, user="alice") > len(SECRET)
    assert cached(http, SECRET + " ", user="alice") > len(SECRET)


@pytest.mark.parametrize("identity", [{"prompt_cache_key": "a"}, {"safety_identifier": "a"}])
def test_each_identity_field_makes_another_client(http, identity):
    cached(http, SECRET)
    assert cached(http, SECRET) > len(SECRET)  # the same (anonymous, local) client: exact
    assert cached(http, SECRET, **identity) == 0
