"""Batch-invariant verification: a seeded generation's text cannot depend on K, the drafter or
the batch even on a backend whose batched numerics differ from its one-token steps.

The fake target below behaves as llama.cpp's CPU backend was measured to
(specdecode.control.invariance): a forward of more than 3 rows uses other kernels (its logits
move a little), and a lone step over a long cache differs too unless the backend is in its
batch-invariant mode. The tests fail for an engine that ignores the mode or the block."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdecode.control.controller import Source, SpeculationController
from specdecode.control.costmodel import CostCurve
from specdecode.control.invariance import cached_invariant_block, measure_invariant_block
from specdecode.drafters import NgramDrafter, NoDrafter, SuffixDrafter
from specdecode.engine import SpeculativeEngine
from specdecode.errors import SpecDecodeError
from specdecode.request import GenerationOptions
from specdecode.sampling import SamplingParams

from test_batching import BigramLM, batched, requests
from test_seed import PROMPT, SAMPLED, Schedule, draft_model

EXACT_ROWS = 3  # as measured for Qwen2.5-Coder-1.5B Q4_K_M on llama.cpp (AVX-512)
LONG = 12  # cached tokens after which the fast lone step changes kernels


class VariantLM(BigramLM):
    """BigramLM whose logits depend on the forward's shape, as batched kernels' do: a forward
    of more than EXACT_ROWS rows (all sequences together) adds a small deterministic offset to
    every row; so does a one-token forward past LONG cached tokens outside batch-invariant mode."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.rows_in_invariant_mode: list[int] = []

    def forward_batch(self, items):
        rows = sum(len(t) for _, t, _ in items)
        measured = self.invariant_block is not None  # the engine's probe has run
        if measured and self.invariant_mode and any(len(r) for _, _, r in items):  # a verification, not a prefill
            self.rows_in_invariant_mode.append(rows)
        long_lone = rows == 1 and len(self.caches[items[0][0]]) >= LONG and not self.invariant_mode
        out = super().forward_batch(items)
        if rows > EXACT_ROWS or long_lone:
            out = [lg + np.random.default_rng(rows + 17 * len(lg)).normal(0, 0.6, lg.shape).astype(np.float32)
                   for lg in out]
        return out


def seeded(engine, seed, max_tokens=40, **kw):
    return engine.generate(PROMPT, sampling=SamplingParams(seed=seed, **SAMPLED), max_tokens=max_tokens, **kw)


def plain_tokens(seeds, **kw):
    t = VariantLM()
    eng = SpeculativeEngine(t, NoDrafter(), 0, n_slots=1)
    return [seeded(eng, s, **kw).token_ids for s in seeds]


def test_the_probe_finds_the_largest_invariant_block():
    assert measure_invariant_block(VariantLM(n_seq=1)) == EXACT_ROWS
    assert measure_invariant_block(BigramLM(n_seq=1)) == 33  # a backend that is invariant at every size


def test_the_probe_is_cached_per_machine(tmp_path, monkeypatch):
    t = VariantLM(n_seq=1)
    calls = []
    import specdecode.control.invariance as inv

    monkeypatch.setattr(inv, "measure_invariant_block", lambda b, seq: calls.append(seq) or 3)
    monkeypatch.setattr(inv, "machine_key", lambda b: "k1")
    assert cached_invariant_block(t, 0, tmp_path) == 3 and cached_invariant_block(t, 0, tmp_path) == 3
    assert calls == [0]
    (f,) = (tmp_path / "costs").glob("*.invariant.json")
    assert json.loads(f.read_text())["invariant_block"] == 3
    monkeypatch.setattr(inv, "machine_key", lambda b: "k2")  # another build or CPU: measured again
    cached_invariant_block(t, 0, tmp_path)
    assert calls == [0, 0]


@pytest.mark.parametrize("text", ["[]", "[" * 100_000, '{"key": "k1", "invariant_block": 100000, "measured_at": 0}',
                                  '{"key": "k1", "invariant_block": 0, "measured_at": 0}',
                                  '{"key": "k1", "invariant_block": 3, "measured_at": 1' + "0" * 400 + "}"])
def test_a_corrupt_cached_block_is_measured_again(tmp_path, monkeypatch, text):
    import specdecode.control.invariance as inv

    calls = []
    monkeypatch.setattr(inv, "measure_invariant_block", lambda b, seq: calls.append(seq) or 3)
    monkeypatch.setattr(inv, "machine_key", lambda b: "k1")
    monkeypatch.setattr(inv.time, "time", lambda: 1000.0)
    (tmp_path / "costs").mkdir()
    (tmp_path / "costs" / "k1.invariant.json").write_text(text)
    assert cached_invariant_block(VariantLM(n_seq=1), 0, tmp_path) == 3 and calls == [0]
    assert cached_invariant_block(VariantLM(n_seq=1), 0, tmp_path) == 3 and calls == [0]  # replaced


DRAFTERS = {"ngram": lambda t: NgramDrafter(), "suffix": lambda t: SuffixDrafter(), "draft-model": draft_model}


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_seeded_speculation_equals_plain_decoding_on_batch_variant_numerics(name, k):
    seeds = range(6)
    want = plain_tokens(seeds)
    t = VariantLM()
    eng = SpeculativeEngine(t, DRAFTERS[name](t), k, n_slots=1)
    outs = [seeded(eng, s) for s in seeds]
    assert [o.token_ids for o in outs] == want
    assert all(o.stats.invariant_block == EXACT_ROWS for o in outs)
    assert t.rows_in_invariant_mode and max(t.rows_in_invariant_mode) <= EXACT_ROWS
    if name != "suffix" and k > 1:
        assert sum(o.stats.accepted for o in outs) > 0  # drafts were made and kept


def test_negative_control_without_batch_invariance_the_text_depends_on_k():
    seeds = range(6)
    want = plain_tokens(seeds, batch_invariant="off")
    t = VariantLM()
    eng = SpeculativeEngine(t, draft_model(t), 16, n_slots=1)
    outs = [seeded(eng, s, batch_invariant="off").token_ids for s in seeds]
    assert outs != want
    assert not t.rows_in_invariant_mode


@pytest.mark.parametrize("curve", [(0.03, 0.031, 0.032, 0.033), (0.03, 0.06, 0.24, 1.2)], ids=["flat", "steep"])
def test_k_auto_and_k_schedules_give_plain_decodings_text(curve):
    seeds = range(5)
    want = plain_tokens(seeds)
    t = VariantLM()
    ctl = SpeculationController([Source(draft_model(t), 0.001), Source(NgramDrafter(), 1e-5)],
                                CostCurve((1, 2, 8, 33), curve), kmax=16, learn_costs=True)
    assert [seeded(SpeculativeEngine(t, ctl, 16, n_slots=1), s).token_ids for s in seeds] == want
    t = VariantLM()
    eng = SpeculativeEngine(t, Schedule(draft_model(t), [2, 0, 1]), 16, n_slots=1)
    assert [seeded(eng, s).token_ids for s in seeds] == want


def test_in_a_batch_seeded_requests_equal_their_plain_runs_and_others_share_forwards():
    reqs = requests(8)
    for i, r in enumerate(reqs):  # half seeded (batch-invariant), half greedy
        if i % 2:
            r["sampling"] = SamplingParams(seed=100 + i, **SAMPLED)
    solo = []
    for r in reqs:
        t = VariantLM(n_seq=1)
        solo.append(SpeculativeEngine(t, NoDrafter(), 0, n_slots=1).generate(
            r["prompt_ids"], **{k: v for k, v in r.items() if k != "prompt_ids"}))
    t = VariantLM()
    together = batched(SpeculativeEngine(t, draft_model(t), 4), reqs, join_every=2)
    for i, (a, b) in enumerate(zip(solo, together)):
        if i % 2:
            assert a.token_ids == b.token_ids, i
            assert b.stats.invariant_block == EXACT_ROWS
        else:
            assert b.stats.invariant_block == 0
    assert max(t.rows_in_invariant_mode) <= EXACT_ROWS
    assert max(t.batch_sizes) >= 3  # the greedy generations still share their forwards


def test_a_seeded_generation_prefills_its_whole_prompt():
    """No reuse of a cached prefix (written by other forwards, it could differ in the last bits)."""
    t = VariantLM(n_seq=1)
    eng = SpeculativeEngine(t, NgramDrafter(), 4, n_slots=1)
    seeded(eng, 0, max_tokens=3)  # measures the invariant block
    eng.generate(PROMPT, max_tokens=5)  # greedy: caches the prompt
    t.forward_calls.clear()
    seeded(eng, 1, max_tokens=3)
    assert t.forward_calls[0] == len(PROMPT) - 1


def test_options_say_when_a_generation_is_batch_invariant():
    opts = GenerationOptions.from_kwargs
    assert opts(temperature=0.8, seed=1).invariant
    assert not opts(temperature=0.8).invariant  # no seed: no text was promised
    assert not opts().invariant  # greedy: near-ties are reported instead
    assert not opts(temperature=0.8, seed=1, sampling_rule="rejection").invariant
    assert opts(batch_invariant="on").invariant and not opts(temperature=0.8, seed=1, batch_invariant="off").invariant
    with pytest.raises(SpecDecodeError) as e:
        opts(batch_invariant="yes")
    assert e.value.param == "batch_invariant" and "'yes'" in str(e.value)


def test_the_auto_rule_is_gumbel_with_a_seed_and_rejection_without():
    assert SamplingParams(temperature=1.0, seed=3).keyed
    assert not SamplingParams(temperature=1.0).keyed
    assert SamplingParams(temperature=1.0, sampling_rule="gumbel").keyed
    assert not SamplingParams(temperature=0.0, seed=3).keyed


def test_auto_does_not_trade_all_speculation_for_invariance():
    """Where no block of 2 equals two one-token steps (a block of 1), "auto" verifies as usual
    (and says so: invariant_block 0); "on" still holds to it, drafting nothing."""
    t = VariantLM()
    t.invariant_block = 1
    eng = SpeculativeEngine(t, NgramDrafter(), 4, n_slots=1)
    auto = seeded(eng, 2)
    assert auto.stats.invariant_block == 0 and auto.stats.drafted > 0
    on = seeded(eng, 2, batch_invariant="on")
    assert on.stats.invariant_block == 1 and on.stats.drafted == 0
    assert on.token_ids == plain_tokens([2], batch_invariant="on")[0]
