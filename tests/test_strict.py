"""Strict mode (``speculative.strict``, ``serve --strict``; issue 34): every greedy answer is bit
for bit the one plain decoding gives it alone, in a batch, with a drafter, on the real small
model (smollm2 on llama.cpp).

What makes it hold: a strict generation verifies batch-invariantly (forwards no larger than
the measured invariant block) in a KV cache of its own
(``kv_per_sequence``): in llama.cpp's shared (unified) buffer a forward attends past other
sequences' cells and its arithmetic moves. Measured on AMD EPYC Zen 4, 8 concurrent greedy chat requests of 96 tokens,
ngram drafts: 4 of 8 left their solo plain text without strict mode, none with it; the batch
below without ``batch_invariant="on"``: 3 of 8.
``serve --strict`` loads a KV cache per slot; a shared one refuses strict generations.
"""

from __future__ import annotations

import httpx
import pytest

from specdecode.api import Decoder
from specdecode.cli import build_parser
from specdecode.errors import SpecDecodeError
from specdecode.options import decoder_kwargs
from specdecode.server import create_app

from conftest import SMOLLM
from test_batching import batched
from test_server import ServerThread

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain what a hash map is in three sentences.",
    "List five fruits and their colours.",
    "Write a haiku about the sea.",
    "Rewrite this code with type hints:\ndef add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n",
    "What is the capital of France? Answer in one sentence, then repeat it.",
    "Write a SQL query that counts users by country.",
    "Give three tips for writing clean code.",
]
MAX_TOKENS = 64


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def solo():
    """Each prompt's greedy tokens from plain decoding, alone: each prefilled from an empty
    cache, as strict mode prefills (a prefix cached by the previous prompt's forwards is other
    arithmetic: on an AVX2 EPYC it changed prompt 4's answer at its 50th token)."""
    def alone(dec: Decoder, p: str) -> list[int]:
        dec.engine.forget_prefix()
        return dec.generate(messages=chat(p), max_tokens=MAX_TOKENS, temperature=0).token_ids

    with Decoder(target=SMOLLM, draft="none", n_ctx=1024, progress=False) as dec:
        return [alone(dec, p) for p in PROMPTS]


def run_batch(dec: Decoder, **options) -> list:
    """The prompts together on the decoder's engine, one more joining each step."""
    reqs = [{"prompt_ids": dec.prompt_ids(messages=chat(p)), "max_tokens": MAX_TOKENS, **options} for p in PROMPTS]
    return batched(dec.engine, reqs, join_every=1)


def test_strict_is_refused_in_a_shared_cache():
    """In one shared buffer what runs beside a generation changes its arithmetic (measured:
    strict greedy requests verified one token a forward still left their solo text beside
    sampled ones), so strict mode needs a cache per slot; a seed's "auto" verifies as usual."""
    with Decoder(target=SMOLLM, draft="ngram", num_speculative_tokens=8, n_ctx=1024, parallel=2,
                 progress=False) as dec:
        assert dec.target.kv_shared
        ids = dec.prompt_ids(messages=chat(PROMPTS[0]))
        with pytest.raises(SpecDecodeError) as e:
            dec.engine.begin(ids, max_tokens=4, batch_invariant="on")
        assert e.value.param == "batch_invariant" and "kv_per_sequence" in str(e.value)
        assert dec.engine.free_slots() == 2  # nothing held
        seeded = dec.generate(messages=chat(PROMPTS[0]), max_tokens=4, temperature=0.8, seed=1)
        assert seeded.stats.invariant_block == 0
        with pytest.raises(SpecDecodeError) as e:
            create_app(dec, strict=True)
        assert e.value.param == "strict"
        with ServerThread(create_app(dec)) as server:
            r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                "model": SMOLLM, "messages": chat("Hi"), "max_tokens": 4, "speculative": {"strict": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.strict", r.text
        assert "--strict" in r.json()["error"]["message"]


def test_a_seeded_prompt_reuses_the_calls_a_fresh_prefill_makes_and_keeps_its_text():
    """Issue 61: a seed threw the cache away even with one slot. A seeded (batch-invariant)
    generation keeps the whole 512-token calls from position 0 of a prefix an earlier request
    read, and gives the tokens it gives from an empty cache; the prefix the unseeded request in
    between extended from an unaligned position is not reused past its last whole call."""
    import inspect
    import textwrap as module

    doc = inspect.getsource(module)[:6000]
    ask = lambda q: [{"role": "system", "content": "Answer about this code:\n" + doc},  # noqa: E731
                     {"role": "user", "content": q}]
    seeded = dict(max_tokens=32, temperature=0.9, seed=7)
    with Decoder(target=SMOLLM, draft="ngram", num_speculative_tokens=4, n_ctx=4096, progress=False) as dec:
        n = len(dec.prompt_ids(messages=ask("Summarise it.")))
        assert n > 1100 and dec.target.prefill_split == 512
        dec.engine.forget_prefix()
        fresh = dec.generate(messages=ask("Summarise it."), **seeded)
        assert fresh.stats.prompt_cached == 0 and fresh.stats.invariant_block >= 2
        between = dec.generate(messages=ask("Which functions does it define?"), max_tokens=8, temperature=0)
        assert between.stats.prompt_cached > 1024  # unseeded: the whole common prefix
        again = dec.generate(messages=ask("Summarise it."), **seeded)
        assert again.stats.prompt_cached == (between.stats.prompt_cached // 512) * 512
        assert again.token_ids == fresh.token_ids


def test_strict_with_a_cache_per_slot_speculates_and_equals_solo_plain_decoding(solo):
    with Decoder(target=SMOLLM, draft="ngram", num_speculative_tokens=8, n_ctx=1024, parallel=8,
                 kv_per_sequence=True, progress=False) as dec:
        assert not dec.target.kv_shared
        strict = run_batch(dec, batch_invariant="on")
    assert [r.token_ids for r in strict] == solo
    (block,) = {r.stats.invariant_block for r in strict}
    assert block >= 1
    if block >= 2:  # blocks of drafts are verified, not only one-token steps
        assert sum(r.stats.drafted for r in strict) > 0 and sum(r.stats.accepted for r in strict) > 0


def test_serve_strict_loads_a_cache_per_slot_and_refuses_trees():
    args = build_parser().parse_args(["serve", "--strict", "--parallel", "4"])
    assert decoder_kwargs(args)["kv_per_sequence"] is True
    assert decoder_kwargs(build_parser().parse_args(["serve"]))["kv_per_sequence"] is False
    with pytest.raises(SpecDecodeError) as e:
        Decoder(target=SMOLLM, draft="ngram", parallel=2, max_tree_nodes=8, kv_per_sequence=True, progress=False)
    assert e.value.param == "max_tree_nodes" and "strict" in str(e.value)
