"""A seed fixes the text: under the "gumbel" rule each position's token is a function of the
target's distribution there and noise keyed by (seed, position), so the same seed gives the
same tokens with any drafter or none, at any K and K schedule, alone or in a batch; and the
tokens are distributed as the target's (chi-square with fixed seeds, with negative controls
that must fail). Parity gaps are measured on the scores the rule used."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specdecode.control.controller import Source, SpeculationController
from specdecode.control.costmodel import CostCurve
from specdecode.drafters import Draft, DrafterBase, ModelDrafter, NgramDrafter, NoDrafter, SuffixDrafter
from specdecode.engine import SpeculativeEngine
from specdecode.output import GenerationResult
from specdecode.parity import parity_report
from specdecode.sampling import Sampler, SamplingParams
from specdecode.verify import verify_keyed

from test_batching import V, BigramLM, batched, requests

SAMPLED = dict(temperature=1.0, top_k=12, top_p=0.95, min_p=0.01, repetition_penalty=1.1)


def run(engine: SpeculativeEngine, prompt: list[int], seed: int, max_tokens: int = 40, **kw) -> GenerationResult:
    return engine.generate(prompt, sampling=SamplingParams(seed=seed, **{**SAMPLED, **kw}), max_tokens=max_tokens)


def draft_model(target: BigramLM) -> ModelDrafter:
    return ModelDrafter(BigramLM(seed=0, n_seq=target.n_seq, noise=1.5), target=target)


DRAFTERS = {"none": lambda t: NoDrafter(), "ngram": lambda t: NgramDrafter(), "suffix": lambda t: SuffixDrafter(),
            "draft-model": draft_model}
PROMPT = [3, 5, 7, 3, 5, 9, 11]


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_the_same_seed_gives_the_same_tokens_with_any_drafter_and_k(name, k):
    t0 = BigramLM()
    plain = [run(SpeculativeEngine(t0, NoDrafter(), 0, n_slots=1), PROMPT, seed).token_ids for seed in range(6)]
    assert len({tuple(p) for p in plain}) == 6  # the seed matters: the test is not vacuous
    t = BigramLM()
    eng = SpeculativeEngine(t, DRAFTERS[name](t), k, n_slots=1)
    outs = [run(eng, PROMPT, seed) for seed in range(6)]
    assert [o.token_ids for o in outs] == plain
    if name == "draft-model":
        assert sum(o.stats.accepted for o in outs) > 0  # drafts were made and kept


class Schedule(DrafterBase):
    """Drafts K tokens from a fixed K schedule of a wrapped drafter: a stand-in for the
    controller choosing different K from different measured costs."""

    def __init__(self, inner, ks):
        self.inner, self.ks, self.i = inner, ks, 0

    def start(self, prompt_ids, sampler):
        self.inner.start(prompt_ids, sampler)

    def propose(self, context, k):
        self.i += 1
        return self.inner.propose(context, min(k, self.ks[self.i % len(self.ks)]))


@pytest.mark.parametrize("curve", [(0.03, 0.031, 0.032, 0.033), (0.03, 0.06, 0.24, 1.2)], ids=["flat", "steep"])
def test_k_auto_under_different_measured_costs_gives_the_same_tokens(curve):
    """The controller picks different K from different cost curves (a GPU-like flat one and a
    CPU-like steep one): the tokens of a seed do not change."""
    outs, ks = [], []
    for c in (curve, (0.03, 0.06, 0.24, 1.2)):
        t = BigramLM()
        ctl = SpeculationController([Source(draft_model(t), 0.001), Source(NgramDrafter(), 1e-5)],
                                    CostCurve((1, 2, 8, 33), c), kmax=16)
        eng = SpeculativeEngine(t, ctl, 16, n_slots=1)
        res = [run(eng, PROMPT, seed) for seed in range(5)]
        outs.append([r.token_ids for r in res])
        ks.append(sum((r.stats.k_histogram for r in res), start=__import__("collections").Counter()))
    assert outs[0] == outs[1]
    for ks_a, schedule in ((1, [0, 3, 1]), (2, [7, 0, 2, 5])):
        t = BigramLM()
        eng = SpeculativeEngine(t, Schedule(draft_model(t), schedule), 16, n_slots=1)
        assert [run(eng, PROMPT, seed).token_ids for seed in range(5)] == outs[0]


def test_a_seeded_request_is_the_same_alone_and_in_a_batch():
    reqs = [dict(r, sampling=SamplingParams(seed=100 + i, **SAMPLED)) for i, r in enumerate(requests(8))]
    t_solo = BigramLM()
    alone = [SpeculativeEngine(t_solo, draft_model(t_solo), 4, n_slots=1).generate(
        r["prompt_ids"], **{k: v for k, v in r.items() if k != "prompt_ids"}) for r in reqs]
    t = BigramLM()
    together = batched(SpeculativeEngine(t, draft_model(t), 4), reqs, join_every=3)
    assert [a.token_ids for a in alone] == [b.token_ids for b in together]
    assert max(t.batch_sizes) >= 4


# ----------------------------------------------------------------- distribution (chi-square)

def _probs_of(params: SamplingParams, logits: np.ndarray, history=()) -> np.ndarray:
    return Sampler(params).probs(logits, history)


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1), dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5)])
def test_the_keyed_draw_has_the_transformed_distribution(params):
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1.5, size=10).astype(np.float32)
    history = [1, 1, 4]
    sp = SamplingParams(seed=11, **params)
    probs = _probs_of(sp, logits, history)
    s = Sampler(sp)
    n = 20_000
    draws = np.bincount([s.draw(probs, i) for i in range(n)], minlength=10)
    keep = probs > 0
    assert draws[~keep].sum() == 0
    assert chisquare(draws[keep], probs[keep] * n).pvalue > 1e-3


def test_negative_control_noise_reused_across_positions_fails():
    """The same noise at every position makes every draw the same token: not the distribution."""
    probs = np.array([0.3, 0.3, 0.4])
    s = Sampler(SamplingParams(temperature=1.0, seed=2))
    fixed = s.noise(0, 3)
    s.noise = lambda index, n: fixed  # a broken key: the position is ignored
    draws = np.bincount([s.draw(probs, i) for i in range(3000)], minlength=3)
    assert chisquare(draws, probs * 3000).pvalue < 1e-6


def two_token_joint(target: BigramLM, prompt: list[int], params: SamplingParams) -> dict:
    s = Sampler(params)
    t = target
    joint = {}
    ctx = list(prompt)
    p1 = s.probs(t.table[ctx[-2], ctx[-1]], ctx)
    for a in np.flatnonzero(p1):
        p2 = s.probs(t.table[ctx[-1], a], ctx + [int(a)])
        for b in np.flatnonzero(p2):
            joint[(int(a), int(b))] = p1[a] * p2[b]
    return joint


class Constant(DrafterBase):
    """Proposes the same token at every position (a lookup that is often wrong)."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, context, k):
        return Draft([self.token] * k)


@pytest.mark.parametrize("drafter", ["draft-model", "near-match"])
def test_speculation_under_the_keyed_rule_has_the_target_distribution(drafter):
    """Two-token outputs over many seeds against the target's exact joint distribution; the
    negative control accepts a draft on a near match (its token or the next id), which the
    same test must reject."""
    params = dict(temperature=1.0, top_k=6)
    t = BigramLM(sharp=1.0)
    expected = two_token_joint(t, PROMPT, SamplingParams(**params))
    if drafter == "draft-model":
        eng = SpeculativeEngine(t, draft_model(t), 2, n_slots=1)
    else:
        import specdecode.engine.core as engine_mod

        first = max({a for a, _ in expected}, key=lambda a: sum(v for (x, _), v in expected.items() if x == a))
        eng = SpeculativeEngine(t, Constant(first), 2, n_slots=1)
        near = lambda draft_ids, target_token: verify_keyed(  # noqa: E731
            draft_ids, lambda i: draft_ids[i] if i < len(draft_ids) and abs(target_token(i) - draft_ids[i]) <= 2
            else target_token(i))
        eng_verify = engine_mod.verify_keyed
        engine_mod.verify_keyed = near
    try:
        n = 6000
        counts: dict = {}
        for seed in range(n):
            r = eng.generate(PROMPT, sampling=SamplingParams(seed=seed, **params), max_tokens=2)
            if len(r.token_ids) == 2:
                counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    finally:
        if drafter != "draft-model":
            engine_mod.verify_keyed = eng_verify
    keys = sorted(expected)
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    assert obs.sum() == sum(counts.values())
    exp = np.array([expected[k] for k in keys])
    p = chisquare(obs, exp / exp.sum() * obs.sum()).pvalue
    if drafter == "draft-model":
        assert p > 1e-3
    else:
        assert p < 1e-6


# ------------------------------------------------------------------------ parity gaps

def test_a_penalised_near_tie_is_reported_as_a_near_tie():
    """Raw logits 4.88 apart, 0.099 apart after the repetition penalty: the gap reported is the
    one the greedy choice was made on."""
    class Fixed(BigramLM):
        def _forward(self, seq, token_ids, logits_for):
            cache = self.caches[seq]
            cache.extend(int(x) for x in token_ids)
            row = np.full(V, -10.0, dtype=np.float32)
            row[2], row[3] = 9.56, 4.681  # token 2 was seen: 9.56 / 2 = 4.78 after the penalty
            return np.stack([row] * len(logits_for)) if len(logits_for) else np.zeros((0, V), np.float32)

    t = Fixed()
    r = SpeculativeEngine(t, NoDrafter(), 0, n_slots=1).generate(
        [2, 4], sampling=SamplingParams(repetition_penalty=2.0), max_tokens=1, record_top2_gaps=True)
    assert r.top2_gaps[0] == pytest.approx(0.099, abs=1e-3)


def test_a_divergence_hidden_by_a_grammar_mask_is_reported_as_divergent():
    """Raw logits nearly tied between "d" (which the grammar forbids) and "a", with "b" far
    behind: the grammar leaves "a" a clear choice, so the plain run's gap is the masked one
    (3.99, not the raw 0.01) and a run that chose "b" there is a divergence, not numerics."""
    from specdecode.grammar import Grammar

    from test_grammar import ID, PIECES, CharBackend

    class Tie(CharBackend):
        def _forward(self, seq, token_ids, logits_for):
            self.caches[seq].extend(int(x) for x in token_ids)
            row = np.full(len(PIECES), -10.0, dtype=np.float32)
            row[ID["d"]], row[ID["a"]], row[ID["b"]] = 5.0, 4.99, 1.0
            return np.stack([row] * len(logits_for)) if len(logits_for) else np.zeros((0, len(PIECES)), np.float32)

    t = Tie(PIECES, [], n_prompt=1, eos=0)
    plain = SpeculativeEngine(t, NoDrafter(), 0, n_slots=1).generate(
        [ID["a"]], max_tokens=1, record_top2_gaps=True, grammar=Grammar("regex", "[ab]"))
    assert plain.token_ids == [ID["a"]]
    assert plain.top2_gaps[0] == pytest.approx(3.99, abs=1e-3)
    wrong = GenerationResult(text="b", token_ids=[ID["b"]], finish_reason="length", stats=plain.stats)
    assert parity_report(wrong, plain)["status"] == "divergent"


def test_under_sampling_the_gap_is_of_the_noisy_scores():
    s = Sampler(SamplingParams(temperature=1.0, seed=4))
    logits = np.array([1.0, 1.0, -50.0])
    scores = s.scores(logits, (), 0)
    g = -np.log(s.noise(0, 3))  # Gumbel noise from the position's exponentials
    expect = np.log(s.probs(logits, ())) + g
    assert np.allclose(scores[:2], expect[:2]) and scores.argmax() == s.draw(s.probs(logits, ()), 0)
