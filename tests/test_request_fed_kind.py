"""A drafter fed by the request is one class and one row of the kinds table (issue 33): the toy
added here drafts from a request field of its own, ``hint`` (as ``prediction`` feeds the
prediction drafter), and works through the Python API and the server with nothing else
changed: the row names the field, the server accepts and tokenizes it, and the drafter takes
it through its one door, ``configure``."""

from __future__ import annotations

from typing import Sequence

import httpx
import openai
import pytest

from specdecode.api import Decoder
from specdecode.drafters import Draft, DrafterBase, kinds
from specdecode.drafters.base import DraftingRequest
from specdecode.drafters.kinds import MODEL, DrafterKind
from specdecode.errors import SpecDecodeError
from specdecode.server import create_app

from conftest import SMOLLM
from test_server import ServerThread

CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
MAX_TOKENS = 48


class HintDrafter(DrafterBase):
    """Drafts the request's hint: after the last committed token where it occurs in the hint,
    what follows it there (nothing before a hint is given). ``took`` records each hint."""

    name = "hint"
    request_fields = ("hint",)
    took: list = []

    def __init__(self) -> None:
        self.hint: list[int] = []

    def start(self, prompt_ids, sampler) -> None:
        self.hint = []

    def take_inputs(self, request: DraftingRequest) -> None:
        self.hint = list(request.inputs["hint"])
        HintDrafter.took.append(len(self.hint))

    def propose(self, context: Sequence[int], k: int) -> Draft:
        h = self.hint
        for j in range(len(h) - 1, -1, -1):
            if h[j] == context[-1]:
                return Draft(h[j + 1: j + 1 + k])
        return Draft([])


HINT_ROW = DrafterKind("hint", "hint", "the request's hint", lambda req: HintDrafter(), in_auto=True,
                       request_field="hint")


@pytest.fixture(scope="module")
def with_hint():
    """The table with the one new row, as the toy's file would add it."""
    mp = pytest.MonkeyPatch()
    mp.setattr(kinds, "KINDS", kinds.KINDS[:-1] + (HINT_ROW, MODEL))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def decoder(with_hint):
    dec = Decoder(target=SMOLLM, draft="hint", num_speculative_tokens=4, n_ctx=1024, n_threads=1, progress=False)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def plain(decoder):
    return decoder.generate(messages=CHAT, max_tokens=MAX_TOKENS, plain=True)


def test_the_python_api_hands_the_field_to_the_new_kind(decoder, plain):
    HintDrafter.took.clear()
    r = decoder.generate(messages=CHAT, max_tokens=MAX_TOKENS, inputs={"hint": plain.text})
    assert r.token_ids == plain.token_ids  # lossless: the target's own tokens
    assert HintDrafter.took and HintDrafter.took[0] > 0
    assert r.stats.accepted > 0 and r.stats.target_forward_passes < len(plain.token_ids)
    # The field as ids works the same way.
    ids = decoder.input_ids(plain.text, "hint")
    assert decoder.generate(messages=CHAT, max_tokens=MAX_TOKENS, inputs={"hint": ids}).token_ids == plain.token_ids


def test_the_kind_named_without_its_field_or_another_kind_given_it_is_refused(decoder):
    with pytest.raises(SpecDecodeError) as e:
        decoder.generate(messages=CHAT, max_tokens=4, draft="hint")
    assert e.value.param == "hint" and "none was given" in str(e.value)
    # Plain decoding ignores request-fed inputs (the page's "Compare with plain" sends them along).
    assert decoder.generate(messages=CHAT, max_tokens=4, draft="none", inputs={"hint": "x"}).stats.drafted == 0
    # A field none of its drafters follows is ignored where the request named no drafter ...
    assert decoder.generate(messages=CHAT, max_tokens=4, prediction="def add(a, b):").stats.accepted_prediction_tokens \
        is None
    # ... and refused where it named one that does not follow it.
    with pytest.raises(SpecDecodeError) as e:
        decoder.generate(messages=CHAT, max_tokens=4, draft="hint", inputs={"hint": "x"}, prediction="def add(a, b):")
    assert e.value.param == "prediction" and "hint" in str(e.value)


def test_the_server_takes_the_new_field_and_drafts_from_it(decoder, plain):
    with ServerThread(create_app(decoder, max_queue=2)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        HintDrafter.took.clear()
        r = c.chat.completions.create(model=SMOLLM, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"hint": {"type": "content", "content": plain.text}})
        assert r.choices[0].message.content == plain.text
        assert HintDrafter.took and r.model_extra["speculation"]["accepted"] > 0
        # Its shape is checked and its size bounded as a prediction's, naming the field.
        with httpx.Client(base_url=s.url, timeout=60) as h:
            bad = h.post("/v1/chat/completions", json={"model": SMOLLM, "messages": CHAT, "hint": "not content"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "hint"
            big = {"type": "content", "content": "x" * (16 * 1024 * 16 + 1)}
            over = h.post("/v1/chat/completions", json={"model": SMOLLM, "messages": CHAT, "hint": big})
            assert over.status_code == 400 and over.json()["error"]["param"] == "hint"


def test_the_controller_offers_the_new_kind_to_auto(with_hint):
    """draft "auto" builds its controller from the table's in_auto rows: the new kind is a
    source, and a request's field reaches it through the controller's door."""
    with Decoder(target=SMOLLM, draft="auto", num_speculative_tokens="auto", n_ctx=1024, n_threads=1,
                 progress=False) as dec:
        assert "hint" in dec.drafter.names()
        HintDrafter.took.clear()
        r = dec.generate(messages=CHAT, max_tokens=8, inputs={"hint": "def add(a, b):\n    return a + b"})
        assert HintDrafter.took and len(r.token_ids) >= 1
        with pytest.raises(SpecDecodeError) as e:
            dec.generate(messages=CHAT, max_tokens=4, draft="ngram", inputs={"hint": "x"})
        assert e.value.param == "hint"


def test_without_the_row_the_field_is_unknown_to_the_server(monkeypatch):
    """Nothing but the row makes the server take the field."""
    from specdecode.server.protocol import parse_request
    from specdecode.server.apierror import APIError

    monkeypatch.setattr(kinds, "KINDS", tuple(k for k in kinds.KINDS if k is not HINT_ROW))
    with pytest.raises(APIError) as e:
        parse_request({"model": "m", "messages": CHAT, "hint": {"type": "content", "content": "x"}}, "chat", "m", 512)
    assert e.value.status == 400 and e.value.param == "hint"
