"""The bench's oracle (specdecode.bench.oracle): pure replays over crafted prompts, outputs
and cost curves, checked against numbers worked out by hand."""

from __future__ import annotations

from typing import Sequence

import pytest

from specdecode.bench.oracle import OracleStep, lookup_drafters, oracle_replay, oracle_speedup
from specdecode.control.costmodel import CostCurve
from specdecode.drafters import Draft, DrafterBase, NgramDrafter, PredictionDrafter, SuffixDrafter
from specdecode.limits import MAX_NUM_SPECULATIVE_TOKENS

# T(n) = 0.8 + 0.2 n seconds: T(1) = 1.0, T(2) = 1.2, T(3) = 1.4, T(4) = 1.6, T(5) = 1.8.
LINEAR = CostCurve((1, 2, 3, 4, 5), (1.0, 1.2, 1.4, 1.6, 1.8))


def test_oracle_steps_time_and_speedup_by_hand():
    # i=0: the context ends in 0, which is nowhere earlier: a plain step (1.0 s).
    # i=1: "1" recurs at the prompt's start; the proposal is the 9 tokens after it (the cap:
    #      11 - 1 - 1 tokens left but the last), 2 3 4 5 6 7 8 0 1, of which 4 match the
    #      output (2 3 4 5, then 6 != 9). Rates (min(4, K) + 1) / T(K + 1): K=3 4/1.6 = 2.5,
    #      K=4 5/1.8 = 2.78, K=5 5/2.0 = 2.5: K = 4 (1.8 s), 5 tokens.
    # i=6: the context ends in 5 9; 9 is new: a plain step (1.0 s).
    # i=7: "9" recurs once, followed by one 9: proposal [9], n = 1, K = 1 (2/1.2 > 1/1.0), 2 tokens.
    # i=9: "9 9 9" recurs, followed by one 9 (and the cap is 1): K = 1, n = 1, 2 tokens.
    prompt, output = [1, 2, 3, 4, 5, 6, 7, 8, 0], [1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 9]
    r = oracle_replay(prompt, output, LINEAR, [NgramDrafter()])
    assert r.steps == (OracleStep(0, None, 0, 0), OracleStep(1, 0, 4, 4), OracleStep(6, None, 0, 0),
                       OracleStep(7, 0, 1, 1), OracleStep(9, 0, 1, 1))
    assert [s.advanced for s in r.steps] == [1, 5, 1, 2, 2]
    assert r.time_s == pytest.approx(2 * 1.0 + 1.8 + 2 * 1.2)  # 6.2 s
    assert r.plain_s == pytest.approx(11 * 1.0)
    assert r.speedup == pytest.approx(11 / 6.2)


def test_the_k_cap_limits_the_step():
    # As above with K <= 2: at i=1 K = 2 (3/1.4), then i=4: "4" recurs, proposal 5 6, n = 1:
    # K = 1 (2/1.2 = 1.67 > 2/1.4); i=6 plain; i=7 K=1; i=9 K=1.
    prompt, output = [1, 2, 3, 4, 5, 6, 7, 8, 0], [1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 9]
    r = oracle_replay(prompt, output, LINEAR, [NgramDrafter()], kmax=2)
    assert [(s.position, s.k) for s in r.steps] == [(0, 0), (1, 2), (4, 1), (6, 0), (7, 1), (9, 1)]
    assert r.time_s == pytest.approx(2 * 1.0 + 1.4 + 3 * 1.2)
    with pytest.raises(ValueError, match="kmax"):
        oracle_replay(prompt, output, LINEAR, [], kmax=MAX_NUM_SPECULATIVE_TOKENS + 1)


def test_a_non_monotonic_cost_makes_the_oracle_take_the_longer_block():
    # T rises 1.0 -> 3.0 over n = 1..12, jumps to 6.0 at 13..15, dips to 2.5 at n = 16
    # (T(16) < T(12)), then 8.0 at 17. The output copies the prompt's first 20 tokens.
    # i=0: plain. i=1: the proposal is 101..118 (18 tokens, all match): K=11 12/3.0 = 4.0,
    # K=15 16/2.5 = 6.4, K=18 19/T(19) = 19/9.0: K = 15, 16 tokens. i=17: "114 115 116"
    # recurs; proposal 117 118 (cap 2), n = 2: K = 2 (3/T(3) = 3/(1 + 4/11)).
    prompt, output = list(range(100, 130)) + [7], list(range(100, 120))
    dip = CostCurve((1, 12, 13, 15, 16, 17, 33), (1.0, 3.0, 6.0, 6.0, 2.5, 8.0, 16.0))
    assert dip(16) < dip(12)
    r = oracle_replay(prompt, output, dip, [NgramDrafter()])
    assert [(s.position, s.k, s.matched) for s in r.steps] == [(0, 0, 0), (1, 15, 18), (17, 2, 2)]
    t3 = 1.0 + 2.0 * 2 / 11
    assert r.time_s == pytest.approx(1.0 + 2.5 + t3)
    assert r.speedup == pytest.approx(20 / (1.0 + 2.5 + t3))
    # Without the dip (T(16) = 6.0 like its neighbours) the best block is K = 11.
    flat = CostCurve((1, 12, 13, 15, 16, 17, 33), (1.0, 3.0, 6.0, 6.0, 6.0, 8.0, 16.0))
    assert oracle_replay(prompt, output, flat, [NgramDrafter()]).steps[1].k == 11


def test_at_a_long_context_each_step_is_priced_there():
    """With context costs, the first example's steps cost T(n) + extra(n, c): after 1,000 tokens of
    prompt every forward of n tokens costs n * 0.5 s more, so the 5-token block (K = 4) costs
    1.8 + 2.5 = 4.3 s against 5 plain steps of 1.5 s; the oracle still takes it (5/4.3 > 1/1.5) and
    the plain time is 11 steps of 1.5 s. Negative control: without them the curve's figures."""
    from specdecode.control.context_costs import ContextCosts

    pad = list(range(200, 1200))  # 1,000 tokens that recur nowhere, before the first example's prompt
    prompt, output = pad + [1, 2, 3, 4, 5, 6, 7, 8, 0], [1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 9]
    # extra(n, c) = 0.5 n at c >= 1,000 (flat beyond: the two contexts carry the same extra).
    cc = ContextCosts(64, (999, 5000), (1, 33), ((0.5, 16.5), (0.5, 16.5)))
    r = oracle_replay(prompt, output, LINEAR, [NgramDrafter()], context_costs=cc)
    assert [(s.position, s.k) for s in r.steps] == [(0, 0), (1, 4), (6, 0), (7, 1), (9, 1)]
    assert r.time_s == pytest.approx(2 * 1.5 + (1.8 + 2.5) + 2 * (1.2 + 1.0))
    assert r.plain_s == pytest.approx(11 * 1.5)
    plain = oracle_replay(prompt, output, LINEAR, [NgramDrafter()])
    assert plain.time_s == pytest.approx(6.2) and plain.plain_s == pytest.approx(11.0)


def test_no_matches_is_plain_decoding():
    r = oracle_replay([1, 2, 3], [4, 5, 6, 7], LINEAR, [NgramDrafter()])
    assert all(s.k == 0 and s.drafter is None for s in r.steps) and len(r.steps) == 4
    assert r.time_s == r.plain_s == pytest.approx(4.0)
    assert r.speedup == 1.0
    assert oracle_replay([1, 2], [3, 3, 3], LINEAR, []).speedup == 1.0  # no drafters at all
    assert oracle_replay([1, 2], [], LINEAR, [NgramDrafter()]).speedup == 1.0  # no output


def test_speedup_over_requests_sums_times():
    a = oracle_replay([1, 2, 3, 4, 5, 6, 7, 8, 0], [1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 9], LINEAR, [NgramDrafter()])
    b = oracle_replay([1, 2, 3], [4, 5, 6, 7], LINEAR, [NgramDrafter()])
    assert oracle_speedup([a, b]) == pytest.approx((11 + 4) / (6.2 + 4.0))
    assert oracle_speedup([]) is None


class HistoryDrafter(DrafterBase):
    """A stand-in for suffix drafting: proposes what followed the context's last token in
    the requests it was told about through finish() (latest occurrence), never the prompt."""

    def __init__(self) -> None:
        self.history: list[int] = []
        self.finished = 0

    def propose(self, context: Sequence[int], k: int) -> Draft:
        last = context[-1]
        for j in range(len(self.history) - 2, -1, -1):
            if self.history[j] == last:
                return Draft(self.history[j + 1: j + 1 + k])
        return Draft([])

    def finish(self, committed: Sequence[int]) -> None:
        self.history += list(committed)
        self.finished += 1


def test_history_accumulates_across_requests_in_order():
    out = [20, 21, 22, 23, 24, 25]
    first = oracle_replay([1, 2, 3], out, LINEAR, drafters := [NgramDrafter(), HistoryDrafter()])
    assert first.speedup == 1.0  # novel: nothing to copy from
    # The same output again after another prompt: prompt lookup cannot draft it, the
    # history can. i=0: 9 is in no history: plain; i=1: after 20 the history
    # proposes 21..24 (cap 4), all right: K = 4 (5/1.8), 5 tokens. Time 1.0 + 1.8.
    again = oracle_replay([9], out, LINEAR, drafters)
    assert [(s.position, s.drafter, s.k) for s in again.steps] == [(0, None, 0), (1, 1, 4)]
    assert again.time_s == pytest.approx(2.8) and again.speedup == pytest.approx(6 / 2.8)
    assert drafters[1].finished == 2 and drafters[1].history == [1, 2, 3, *out, 9, *out]
    # Fresh drafters (no history) see the repeat as novel.
    assert oracle_replay([9], out, LINEAR, [NgramDrafter(), HistoryDrafter()]).speedup == 1.0


def test_lookup_drafters_per_configuration():
    assert [type(d) for d in lookup_drafters("ngram")] == [NgramDrafter]
    assert lookup_drafters("none") == []
    auto = lookup_drafters("auto")
    assert [type(d) for d in auto] == [NgramDrafter, SuffixDrafter, PredictionDrafter]
    assert [type(d) for d in lookup_drafters("suffix")] == [SuffixDrafter]
    assert lookup_drafters("qwen2.5-coder-0.5b-instruct") is None  # a draft model: no oracle
    assert lookup_drafters("ngram")[0] is not lookup_drafters("ngram")[0]  # fresh state each time
