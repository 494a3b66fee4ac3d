"""Suffix drafting across requests (drafters/suffix.py): drafts from earlier requests,
frequency statistics and the confidence stop, the history cap and its LRU eviction, only
committed tokens stored, the controller over it, and greedy parity on smollm2."""

from __future__ import annotations

import numpy as np
import pytest

from specdecode.assembly import loading
from specdecode.control.controller import Source, SpeculationController
from specdecode.control.estimators import match_band
from specdecode.control.costmodel import CostCurve
from specdecode.control.measure import Measurement
from specdecode.drafters import IncrementalDrafter, LookupDrafter, NgramDrafter, NoDrafter, SuffixDrafter
from specdecode.engine import SpeculativeEngine
from specdecode.errors import SpecDecodeError
from specdecode.parity import parity_report
from specdecode.sampling import Sampler, SamplingParams

from conftest import ScriptedBackend, step_outcome

SAMPLER = Sampler(SamplingParams())
FLAT = CostCurve(tuple(range(1, 34)), (0.035,) * 33)


def request(d: SuffixDrafter, committed: list[int], n_prompt: int | None = None) -> None:
    """One finished request: start with its prompt, finish with everything committed."""
    d.start(committed[: n_prompt or len(committed)], SAMPLER)
    d.finish(committed)


def test_a_repeated_output_is_drafted_from_the_earlier_request():
    d = SuffixDrafter()
    p1, out1 = list(range(1, 21)), list(range(100, 140))
    d.start(p1, SAMPLER)
    d.propose(p1 + out1[:5], 8)  # drafting during the request changes nothing stored
    d.finish(p1 + out1)
    p2 = list(range(200, 216))  # a different prompt, then the same output
    ctx = p2 + out1[:8]
    d.start(p2, SAMPLER)
    assert NgramDrafter().lookup(ctx).length == 0  # the context alone has no match
    match = d.lookup(ctx)
    assert match.length == 8 and match.start == -1 and match.unique  # from history
    assert d.available(ctx) == 8  # a match of m tokens predicts up to m (max_spec_factor 1)
    assert d.propose(ctx, 8).token_ids == out1[8:16]
    assert d.propose(ctx, 3).token_ids == out1[8:11]
    # Later in the request the match is longer, and so are the drafts (up to k).
    ctx = p2 + out1[:30]
    assert d.lookup(ctx).length == 30 and d.propose(ctx, 16).token_ids == out1[30:40]  # the stored end
    # The same prompt again: its whole length matches, and the earlier output follows.
    assert d.propose(list(p1), 16).token_ids == out1[:16]


def test_a_history_taken_and_put_back_forgets_what_came_after():
    """What the bench uses to run a prompt again with its prediction from the history its
    first run started from: the answer stored in between is gone, the earlier ones are
    drafted from as before, and putting back the later state brings the answer back."""
    from specdecode.bench.runner import history_as, history_keepers

    d = SuffixDrafter()
    p1, out1 = list(range(1, 21)), list(range(100, 140))
    p2, out2 = list(range(200, 216)), list(range(300, 340))
    request(d, p1 + out1, len(p1))
    before = d.history_state()
    request(d, p2 + out2, len(p2))
    assert history_keepers([d]) == [d] and len(d.history()) == 2
    with history_as([d], [before]):
        assert d.history() == [p1 + out1] and d.stored_tokens == len(p1 + out1)
        d.start(p2, SAMPLER)
        assert d.lookup(p2 + out2[:8]).length == 0  # the answer stored after the state was taken is gone
        assert d.propose(p2, 8).token_ids == []
        assert d.propose(list(range(500, 510)) + out1[:8], 8).token_ids == out1[8:16]
        request(d, [7, 7, 7, 7], 2)  # stored meanwhile: dropped when the block ends
    assert d.history() == [p1 + out1, p2 + out2]
    d.start(p2, SAMPLER)
    assert d.propose(list(p2), 8).token_ids == out2[:8]


def test_the_current_request_is_indexed_too():
    d = SuffixDrafter(max_spec_factor=4.0)
    ctx = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    match = d.lookup(ctx)
    assert match == (3, 3, True)  # "5 6 7" at the start; context[3] is proposed first
    assert d.propose(ctx, 4).token_ids == [8, 9, 1, 2]
    assert d.lookup([1, 2, 3]) == (0, -1, False) and d.available([1, 2, 3]) == 0
    assert d.propose([1, 2, 3], 4).token_ids == []
    # The same context object at the same length reuses the lookup; grown, it is redone.
    assert d.lookup(ctx) is d.lookup(ctx)
    ctx.append(8)
    assert d.lookup(ctx) == (4, 4, True) and d.propose(ctx, 4).token_ids == [9, 1, 2, 5]


def test_ids_beyond_the_key_range_are_matched_exactly():
    big = 1 << 22  # ids past the 21 bits of a key component all share one
    d = SuffixDrafter(max_spec_factor=4.0)
    request(d, [1, big, big + 1, 7, 8, 9])
    request(d, [1, big + 2, big + 1, 5, 6, 4])
    assert d.propose([3, big, big + 1], 3).token_ids == [7, 8, 9]
    assert d.propose([3, big + 2, big + 1], 3).token_ids == [5, 6, 4]
    assert d.lookup([3, big + 3, big + 1]).length == 1  # only the last id recurs


def test_the_most_frequent_continuation_is_proposed():
    d = SuffixDrafter()
    for cont in ([50, 51, 52], [60, 61, 62], [50, 51, 52]):
        request(d, [9, 10, 11, 12] + cont + [0])
    ctx = [3, 10, 11, 12]
    match = d.lookup(ctx)
    assert match.length == 3 and match.start == -1 and not match.unique
    assert d.propose(ctx, 8).token_ids == [50, 51, 52]
    # The current request's own occurrences count as well: two more of "60" make it win.
    ctx = [10, 11, 12, 60, 61, 62, 10, 11, 12, 60, 61, 62, 3, 10, 11, 12]
    match = d.lookup(ctx)
    assert match.length == 3 and match.start == 9 and not match.unique  # the later "10 11 12", then 60
    assert d.propose(ctx, 8).token_ids == [60, 61, 62]  # 60 after 3 of the 5 occurrences
    assert d._plan(ctx).confs == pytest.approx([0.6, 0.6, 0.6])
    # A tie goes to the most recently stored occurrence.
    d = SuffixDrafter()
    request(d, [9, 10, 11, 12, 50])
    request(d, [9, 10, 11, 12, 60])
    assert d.propose([10, 11, 12], 8).token_ids == [60]


def test_drafts_stop_where_the_confidence_falls_below_the_threshold():
    # After "P Q X": 1 always (share 1), then 2 in 3 of 4 (0.75), then 3 in 2 of 3 (0.5),
    # then 4 or 5 (0.25; a tie, the later stored wins).
    histories = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 8, 9, 9]]

    def drafter(min_confidence):
        d = SuffixDrafter(min_confidence=min_confidence, max_spec_factor=4.0)
        for h in histories:
            request(d, [30, 31, 32] + h)
        return d

    ctx = [30, 31, 32]
    assert drafter(0.6).propose(ctx, 8).token_ids == [1, 2]
    assert drafter(0.3).propose(ctx, 8).token_ids == [1, 2, 3]
    assert drafter(0.1).propose(ctx, 8).token_ids == [1, 2, 3, 5]
    assert drafter(0.1).lookup(ctx).unique and not drafter(0.1).lookup(ctx + [1]).unique
    assert drafter(0.1)._plan(ctx).confs == pytest.approx([1.0, 0.75, 0.5, 0.25])
    # The controller's token-by-token rule is for draft models (IncrementalDrafter); a
    # lookup's K is the controller's choice from its per-kind estimate, so it gets no rule.
    d = drafter(0.1)
    assert isinstance(d, LookupDrafter) and not isinstance(d, IncrementalDrafter)
    assert d.propose(ctx, 8).token_ids == [1, 2, 3, 5]
    with pytest.raises(SpecDecodeError):
        SuffixDrafter(min_confidence=1.5)


def seq(tag: int, n: int = 10) -> list[int]:
    """n tokens that occur in no other tagged sequence."""
    return [1000 * tag + i for i in range(n)]


def test_eviction_bounds_memory_and_keeps_the_recently_used():
    d = SuffixDrafter(max_history_tokens=30)
    for tag in (1, 2, 3):
        request(d, seq(tag))
    assert d.stored_tokens == 30
    # Sequence 1 supplies an accepted draft: it becomes the most recently used.
    d.start([7], SAMPLER)
    ctx = [7] + seq(1)[:4]
    assert d.propose(ctx, 4).token_ids == seq(1)[4:8]
    d.observe(step_outcome(2))
    d.finish(ctx + seq(1)[4:6])  # 7 tokens: evicts sequence 2 (least recently used) only
    assert d.stored_tokens <= 30
    hist = d.history()
    assert seq(2) not in hist and seq(1) in hist and seq(3) in hist
    assert d.propose(seq(2)[:4], 4).token_ids == []  # gone from the index as well
    # A draft that was rejected outright does not count as use.
    d = SuffixDrafter(max_history_tokens=30)
    for tag in (1, 2, 3):
        request(d, seq(tag))
    d.start([7], SAMPLER)
    assert d.propose([7] + seq(1)[:4], 4).token_ids
    d.observe(step_outcome(0))
    d.finish([7, 8, 9])
    assert seq(1) not in d.history() and seq(2) in d.history()


def test_the_cap_holds_over_many_requests_and_drafts_survive_compaction():
    rng = np.random.default_rng(0)
    cap = 500
    d = SuffixDrafter(max_history_tokens=cap)
    for tag in range(1, 200):
        n = int(rng.integers(2, 120))
        request(d, seq(tag, n))
        assert d.stored_tokens <= cap
        assert d.stored_tokens == sum(len(s) for s in d.history())
        assert d.history()[-1] == seq(tag, n)
    assert d.store.used < 2 * cap + 1100  # evicted space was reclaimed (12k tokens went through)
    # Whatever is stored still drafts exactly; the evicted do not.
    for s in d.history():
        if len(s) >= 6:
            assert d.propose(s[:3], 3).token_ids == s[3:6]
    assert d.propose(seq(1, 6)[:3], 3).token_ids == []
    # A request longer than the cap keeps its last tokens.
    d = SuffixDrafter(max_history_tokens=10)
    request(d, seq(1, 25))
    assert d.history() == [seq(1, 25)[-10:]] and d.stored_tokens == 10


def test_only_committed_tokens_are_stored():
    """Two scripted targets with the same prompt: the second diverges from what the first
    produced, so its drafts from history are rejected there; the history then holds
    exactly each request's prompt and emitted tokens."""
    pieces = [b"", b"?"] + [bytes([97 + i]) for i in range(20)]
    prompt = [2, 3, 4]
    script1 = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    script2 = [5, 6, 7, 8, 17, 18, 19, 20, 21, 2, 3, 4]
    d = SuffixDrafter()
    out1 = SpeculativeEngine(ScriptedBackend(pieces, script1, n_prompt=3), d, 8).generate(prompt, max_tokens=12)
    out2 = SpeculativeEngine(ScriptedBackend(pieces, script2, n_prompt=3), d, 8).generate(prompt, max_tokens=12)
    assert out1.token_ids == script1 and out2.token_ids == script2
    assert out2.stats.drafted > out2.stats.accepted > 0  # history drafts, some rejected
    assert d.history() == [prompt + script1, prompt + script2]
    # Directly: proposals and rejections leave no trace; finish stores what it is given.
    d = SuffixDrafter()
    request(d, [1, 2, 3, 4, 5, 6])
    d.start([1, 2], SAMPLER)
    assert d.propose([1, 2, 3], 3).token_ids == [4, 5, 6]
    d.observe(step_outcome(0))
    d.finish([1, 2, 3, 9])
    assert d.history() == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9]] and d.stored_tokens == 10


def test_the_controller_drafts_with_a_suffix_source():
    d = SuffixDrafter()
    earlier = list(range(100, 180))
    request(d, [1, 2, 3] + earlier)
    ngram = NgramDrafter()
    c = SpeculationController([Source(ngram, 0.0), Source(d, 0.0)], FLAT, kmax=8)
    assert c.names() == ["ngram", "suffix"]
    ctx = [50, 51] + earlier[:20]  # no match within the context: only the history has one
    c.start(ctx[:2], SAMPLER)
    draft = c.propose(ctx, 8)
    assert draft.token_ids == earlier[20:28]
    assert c.choices["suffix"] == 1
    est = c.sources[1].bands[match_band(20), True]
    before = est.first.accepted
    c.observe(step_outcome(8))
    assert est.first.accepted > before  # the estimate for this kind of match learned
    # Where nothing matches, the controller falls back to plain steps.
    assert c.propose([7, 8, 9], 8).token_ids == []


def test_loading_builds_suffix_drafters(monkeypatch):
    assert isinstance(loading.make_drafter("suffix", target=None), SuffixDrafter)
    monkeypatch.setattr(loading, "read_cached", lambda *a, **k: (None, "measure"))  # nothing cached: measured
    monkeypatch.setattr(loading, "cached_measurement", lambda *a, **k: Measurement(FLAT))
    monkeypatch.setattr(loading, "cached_context_costs", lambda *a, **k: None)
    monkeypatch.setattr(loading, "default_draft_serves", lambda target: False)
    assert loading.make_controller("suffix", target=None).names() == ["suffix"]
    assert loading.make_controller("auto", target=None).names() == ["ngram", "suffix", "prediction"]
    assert loading.make_controller("ngram", target=None).names() == ["ngram"]


def chat_ids(backend, text):
    return backend.tokenize(backend.apply_chat_template([{"role": "user", "content": text}]),
                            add_special=False, parse_special=True)


@pytest.mark.parametrize("k", [4, 16])
def test_greedy_parity_across_requests_on_smollm(smollm, k):
    texts = ["List three colours of the rainbow, one per line.", "Name two planets and one fact about each."]
    prompts = [chat_ids(smollm, t) for t in texts]
    eng = SpeculativeEngine(smollm, SuffixDrafter(), k)
    plain = [eng.generate(ids, drafter=NoDrafter(), num_speculative_tokens=0, record_top2_gaps=True,
                          max_tokens=40) for ids in prompts]
    stored = 0
    for j, i in enumerate((0, 1, 0, 1)):  # the last two repeat the first two's prompts
        spec = eng.generate(prompts[i], max_tokens=40)
        report = parity_report(spec, plain[i])
        assert report["status"] in ("exact", "near-tie"), report
        if j >= 2:  # drafted from the earlier request, and accepted
            assert spec.stats.acceptance_rate > 0.5, spec.stats
            assert spec.stats.accepted >= len(spec.token_ids) // 2, spec.stats
        stored += len(prompts[i]) + len(spec.token_ids)
    assert eng.drafter.stored_tokens == stored  # prompts and outputs (plain runs bypass it)
