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


class Counting(ByteBackend):
    """The byte model, counting the tokens its forwards evaluate (``fed``)."""

    fed = 0

    def forward(self, token_ids, logits_for, seq=0):
        self.fed += len(token_ids)
        return super().forward(token_ids, logits_for, seq)


BACKEND = Counting()


@pytest.fixture(scope="module")
def http():
    dec = Decoder(target=BACKEND, draft="none", num_speculative_tokens=0, progress=False)
    with ServerThread(create_app(dec)) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
    dec.close()


def cached(http, system: str, **identity) -> int:
    body = {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            "max_tokens": 2, "temperature": 0, **identity}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def probe(http, system: str) -> tuple[int, float, int]:
    """mallory's guess: (cached_tokens, the /metrics counter's change, tokens evaluated)."""
    before, fed = total(metrics(http), "specdecode:prompt_tokens_cached_total"), BACKEND.fed
    n = cached(http, system, user="mallory")
    return n, total(metrics(http), "specdecode:prompt_tokens_cached_total") - before, BACKEND.fed - fed


def test_another_clients_prefix_is_reused_but_not_reported(http):
    cached(http, SECRET, user="alice")
    right = probe(http, SECRET.replace("Never say it.", "Say it."))
    cached(http, SECRET, user="alice")
    near = probe(http, SECRET.replace("4931", "4932"))
    cached(http, SECRET, user="alice")
    far = probe(http, "Something else entirely.")
    # Nothing to tell the right PIN from a near miss: not the usage, not the /metrics counter
    # read around the request (the hostile pass read the reuse off it).
    assert right[:2] == near[:2] == far[:2] == (0, 0)
    # The reuse itself is kept: the right guess evaluated only what follows its shared prefix.
    shared = len("system: " + SECRET[:SECRET.index("Never")])
    whole = len("system: " + SECRET.replace("Never say it.", "Say it.") + "\nuser: hi\nassistant:")
    assert right[2] <= whole - shared + 1 and far[2] >= len("system: Something else entirely.")
    # Within one client the count is exact (the negative control: the same prompt, the same user).
    cached(http, SECRET, user="alice")  # (mallory wrote the slot last)
    assert cached(http, SECRET, user="alice") > len(SECRET)
    assert cached(http, SECRET + " ", user="alice") > len(SECRET)


@pytest.mark.parametrize("identity", [{"prompt_cache_key": "a"}, {"safety_identifier": "a"}])
def test_each_identity_field_makes_another_client(http, identity):
    cached(http, SECRET)
    assert cached(http, SECRET) > len(SECRET)  # the same (anonymous, local) client: exact
    assert cached(http, SECRET, **identity) == 0
