"""Predicted outputs and speculation per request through the server, driven by the official
openai client: the output never changes, usage.completion_tokens_details counts the
prediction's tokens (streamed and not), and the ``speculative`` extension chooses among
what the server loaded (400 naming the field otherwise)."""

from __future__ import annotations

import pytest

from specdecode.api import Decoder
from specdecode.server import create_app

from test_server import ServerThread, client, http  # noqa: F401 (fixtures over this module's server)

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Write a Python function that returns the squares of a list of numbers."}]


@pytest.fixture(scope="module")
def decoder():
    dec = Decoder(target=MODEL, draft="auto", num_speculative_tokens="auto", n_ctx=1024, n_threads=1, progress=False)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def server(decoder):
    with ServerThread(create_app(decoder, max_queue=4)) as s:
        yield s


@pytest.fixture(scope="module")
def plain(client):
    return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=80, temperature=0,
                                          extra_body={"speculative": {"draft": "none"}})


def test_plain_per_request_drafts_nothing(plain):
    spec = plain.model_extra["speculation"]
    assert spec["drafted"] == 0 and spec["target_forward_passes"] == plain.usage.completion_tokens
    assert plain.usage.completion_tokens_details is None  # no prediction: no details


def test_prediction_keeps_the_output_and_is_counted(client, plain):
    text = plain.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=80, temperature=0,
                                       prediction={"type": "content", "content": text})
    assert r.choices[0].message.content == text
    d = r.usage.completion_tokens_details
    assert d.accepted_prediction_tokens >= r.usage.completion_tokens // 2
    assert d.rejected_prediction_tokens >= 0
    spec = r.model_extra["speculation"]
    assert spec["accepted_prediction_tokens"] == d.accepted_prediction_tokens
    assert spec["target_forward_passes"] < r.usage.completion_tokens // 2
    # A prediction as a list of text parts, mostly wrong: the same output, few tokens accepted.
    wrong = [{"type": "text", "text": "SELECT name FROM users WHERE id = 1;\n"}] * 3
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=80, temperature=0,
                                       prediction={"type": "content", "content": wrong})
    assert r.choices[0].message.content == text
    assert r.usage.completion_tokens_details.accepted_prediction_tokens <= 8


def test_prediction_streamed_with_usage(client):
    # Another request than the others: suffix drafting has not seen its answer, which it would
    # draft as well as the prediction does.
    chat = [{"role": "user", "content": "Write a Python class for a point with x and y."}]
    text = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=80, temperature=0,
                                          extra_body={"speculative": {"draft": "none"}}).choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat, max_tokens=80, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 prediction={"type": "content", "content": text}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert usage.completion_tokens_details.accepted_prediction_tokens >= usage.completion_tokens // 2


def test_completions_take_a_prediction(client):
    prompt = "def add(a, b):\n    return"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    prediction = {"type": "content", "content": base.choices[0].text}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"prediction": prediction})
    assert r.choices[0].text == base.choices[0].text
    # Under "auto" whether drafting pays depends on this machine's measured costs (and its load):
    # the prediction drafter at a fixed K drafts whatever the costs, so its counts are certain.
    fixed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={
        "prediction": prediction, "speculative": {"draft": "prediction", "num_speculative_tokens": 8}})
    assert fixed.choices[0].text == base.choices[0].text
    assert fixed.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_speculative_choices(client, plain):
    text = plain.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=80, temperature=0,
                                       prediction={"type": "content", "content": text},
                                       extra_body={"speculative": {"draft": "prediction", "num_speculative_tokens": 6}})
    assert r.choices[0].message.content == text
    ks = {int(k) for k in r.model_extra["speculation"]["k_histogram"]}
    assert max(ks) == 6
    assert r.model_extra["speculation"]["draft"] == "prediction"  # what this request ran with
    assert r.model_extra["speculation"]["num_speculative_tokens"] == 6
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0,
                                       extra_body={"speculative": {"draft": "ngram"}})
    assert r.choices[0].message.content == text[:len(r.choices[0].message.content)]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0,
                                       extra_body={"speculative": {"max_tree_nodes": 0}})
    assert r.model_extra["speculation"]["max_tree_nodes"] == 0 and r.model_extra["speculation"]["tree_steps"] == 0
    # What ran, not what was asked: plain decoding drafts nothing whatever K the server has.
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                       extra_body={"speculative": {"draft": "none"}})
    spec = r.model_extra["speculation"]
    assert (spec["draft"], spec["num_speculative_tokens"], spec["drafted"], spec["strict"]) == ("none", 0, 0, False)


@pytest.mark.parametrize("body, param", [
    ({"speculative": {"draft": "qwen-70b"}}, "speculative.draft"),
    ({"speculative": {"draft": "nope", "num_speculative_tokens": 0}}, "speculative.draft"),
    ({"speculative": {"draft": "prediction"}}, "prediction"),
    ({"speculative": {"draft": "ngram"}, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "1"}]},
     "messages[1].tool_call_id"),
    ({"speculative": {"draft": 3}}, "speculative.draft"),
    ({"speculative": {"num_speculative_tokens": 99}}, "speculative.num_speculative_tokens"),
    ({"speculative": {"num_speculative_tokens": "many"}}, "speculative.num_speculative_tokens"),
    ({"speculative": {"k": 4}}, "speculative.k"),
    ({"speculative": {"max_tree_nodes": 99}}, "speculative.max_tree_nodes"),
    ({"speculative": {"max_tree_nodes": 4}}, "speculative.max_tree_nodes"),  # loaded for chains only
    ({"speculative": "fast"}, "speculative"),
    ({"prediction": "just text"}, "prediction"),
    ({"prediction": {"type": "content", "content": 5}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": [{"type": "image"}]}}, "prediction.content[0]"),
])
def test_bad_extension_fields_are_400_naming_them(http, body, param):
    body = {"messages": CHAT, **body}
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "stream": True, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
