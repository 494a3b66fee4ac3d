"""Prompt lookup (NgramDrafter): crafted contexts for the match it picks and what it reports
about it; the controller's acceptance estimates per kind of match."""

from __future__ import annotations

import pytest

from specdecode.control.controller import Source, SpeculationController
from specdecode.control.estimators import MATCH_BANDS, match_band
from specdecode.control.costmodel import CostCurve
from specdecode.drafters import NgramDrafter
from specdecode.errors import SpecDecodeError
from specdecode.sampling import Sampler, SamplingParams

from conftest import step_outcome


def test_lookup_prefers_the_occurrence_that_matches_furthest_back():
    # Suffix 4 1 2 3: "1 2 3" occurs at 1..3 (preceded by 4: match length 4) and at 6..8
    # (preceded by 9: length 3). The longer match wins although it is older.
    ctx = [4, 1, 2, 3, 10, 9, 1, 2, 3, 11, 8, 4, 1, 2, 3]
    d = NgramDrafter()
    assert d.lookup(ctx) == (4, 4, False)  # '1 2 3' was followed by 10 and by 11
    assert d.propose(ctx, 3).token_ids == [10, 9, 1]
    assert d.last_match_len == 4


def test_lookup_ties_go_to_the_most_recent_and_drafts_stop_at_the_end():
    ctx = [7, 1, 2, 5, 7, 1, 2, 6, 7, 1, 2]  # "7 1 2" twice before the suffix, both length 3
    assert NgramDrafter().lookup(ctx) == (3, 7, False)
    assert NgramDrafter().propose(ctx, 8).token_ids == [6, 7, 1, 2]  # only 4 tokens follow


def test_lookup_falls_back_to_shorter_ngrams_and_reports_no_match():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    assert d.lookup([5, 6, 9, 6]) == (1, 2, True)  # only the last token recurs
    assert d.propose([5, 6, 9, 6], 2).token_ids == [9, 6]
    assert d.lookup([1, 2, 3, 4]) == (0, -1, False)
    assert d.propose([1, 2, 3, 4], 4).token_ids == [] and d.last_match_len == 0
    assert NgramDrafter(min_ngram=2).lookup([5, 6, 9, 6]) == (0, -1, False)
    assert d.propose([1, 2, 1], 0).token_ids == []


def test_match_length_counts_back_to_max_match():
    text = list(range(100, 140))
    ctx = text + [1] + text  # the second copy agrees with the first for all 40 tokens
    assert NgramDrafter(max_match=64).lookup(ctx) == (40, 40, True)
    assert NgramDrafter(max_match=16).lookup(ctx) == (16, 40, True)
    with pytest.raises(SpecDecodeError, match="max_match"):
        NgramDrafter(max_ngram=4, max_match=3)
    with pytest.raises(SpecDecodeError, match="min_ngram"):
        NgramDrafter(max_ngram=2, min_ngram=3)


def test_lookup_reports_whether_the_continuation_is_unique():
    assert NgramDrafter().lookup([1, 2, 9, 1, 2, 9, 1, 2]).unique  # "1 2" always followed by 9
    assert not NgramDrafter().lookup([1, 2, 9, 1, 2, 8, 1, 2]).unique
    assert NgramDrafter().lookup([1, 2, 9, 1, 2, 8, 1, 2]).start == 5  # equal length: most recent


def test_match_bands():
    assert [match_band(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 500)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert len(MATCH_BANDS) == 6


# Verifying one more token costs a seventh of a one-token step: drafts pay from alpha ~0.15.
MILD = CostCurve(tuple(range(1, 10)), tuple(0.035 + 0.005 * (n - 1) for n in range(1, 10)))


def test_controller_learns_acceptance_per_match_length():
    """Long matches whose drafts are always accepted get drafted; short matches whose drafts
    always fail stop being drafted, and neither estimate pulls the other."""
    long_ctx = list(range(100, 130)) + [1] + list(range(100, 120))  # match length 20: band 5
    short_ctx = [5, 6, 7, 9, 5, 6, 7]  # match length 3, unique: band 2
    src = Source(NgramDrafter(), 0.0)
    c = SpeculationController([src], MILD, kmax=8, probe_every=1000)
    c.start([], Sampler(SamplingParams()))
    ks_long, ks_short = [], []
    for _ in range(12):
        d = c.propose(long_ctx, 8)
        ks_long.append(len(d.token_ids))
        c.observe(step_outcome(len(d.token_ids)))  # every draft accepted
        d = c.propose(short_ctx, 8)
        ks_short.append(len(d.token_ids))
        c.observe(step_outcome(0))  # every draft rejected
    assert src.bands[5, True].alpha > 0.95 and ks_long[-1] == 8
    assert ks_short[0] > 0 and src.bands[2, True].alpha < 0.2 and ks_short[-4:] == [0, 0, 0, 0]
    assert src.bands[3, True].alpha == pytest.approx(0.85)  # an unused kind keeps its prior


def _reference_lookup(context, max_ngram=3, min_ngram=1, max_match=64):
    """The lookup by a full pass over the text (numpy), as it was before the incremental index."""
    import numpy as np
    from specdecode.drafters.base import Match

    ctx = np.asarray(context, dtype=np.int64)
    L = len(ctx)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ctx[: L - 1], n)
        hits = np.flatnonzero((windows == ctx[L - n:]).all(axis=1))
        if not len(hits):
            continue
        lengths = np.full(len(hits), n)
        alive = np.ones(len(hits), dtype=bool)
        for j in range(n, min(max_match, L - 1)):
            pos = hits - (j - n) - 1
            ok = alive & (pos >= 0)
            ok[ok] = ctx[pos[ok]] == ctx[L - 1 - j]
            if not ok.any():
                break
            lengths[ok] += 1
            alive = ok
        best = int(np.flatnonzero(lengths == lengths.max())[-1])
        following = ctx[hits + n]
        return Match(int(lengths[best]), int(hits[best]) + n, bool((following == following[0]).all()))
    return Match(0, -1, False)


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_the_incremental_index_finds_what_a_full_pass_finds(vocab):
    """The lookup indexes each new token once per step; on growing texts (and a new text
    given without start(), a copy of the prompt, max_match reached) it answers as a full pass."""
    import numpy as np

    rng = np.random.default_rng(vocab)
    d = NgramDrafter(max_match=12)
    for trial in range(6):
        text = [int(t) for t in rng.integers(0, vocab, size=5)]
        if trial % 2:
            text += text * 3  # long copies
        for _ in range(60):
            assert d.lookup(text) == _reference_lookup(text, max_match=12), (trial, len(text))
            text.append(int(rng.integers(0, vocab)) if rng.random() < 0.5 else text[len(text) // 2])
        assert d.lookup(list(text)) == _reference_lookup(text, max_match=12)  # another list: read afresh
