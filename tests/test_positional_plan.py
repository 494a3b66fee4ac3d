"""A drafter whose first drafted token is the uncertain one (a draft model across tokenizers:
measured on torch bf16, code editing, K = 4: 34, 33, 32, 25 of 50 accepted by position) is
planned with two acceptance rates, first and then (``acceptance_priors``), so that where
verification is nearly flat the controller learns that long drafts pay instead of settling on
one-token drafts, all that one rate at a middling acceptance pays for. Scripted costs: the
drafting and verification times are a script's (an injected clock), never the machine's."""

from __future__ import annotations

import time

import numpy as np
import pytest

from specdecode.control.controller import Source, SpeculationController
from specdecode.control.costmodel import CostCurve, DraftStepCost
from specdecode.control.estimators import AcceptanceEstimator, TwoRateEstimator
from specdecode.drafters import Draft, DrafterBase
from specdecode.drafters.base import IncrementalDrafter
from specdecode.drafters.cross_vocab import CrossVocabDrafter
from specdecode.sampling import Sampler, SamplingParams

from conftest import ScriptedClock, step_outcome

# Torch bf16 on a CPU with AVX-512 BF16 (Zen 4), seconds: T(1..5) measured, then a slow rise.
FLAT = CostCurve(tuple(range(1, 34)), (0.231, 0.194, 0.189, 0.203, 0.213)
                 + tuple(0.213 + 0.010 * i for i in range(1, 29)))
# smollm2-135m drafting under SLEM on that machine: ~42 ms a forward, about k + 2 forwards for k tokens.
FORWARD = 0.042
STEP = 2 * FORWARD


class TimedDraft(DrafterBase):
    """Drafts k tokens in STEP + k FORWARD seconds of the scripted clock."""

    name = "model"

    def __init__(self, clock: ScriptedClock, priors: tuple[float, float] | None) -> None:
        self.clock = clock
        self.acceptance_priors = priors

    def propose(self, context, k):
        self.clock.advance(STEP + FORWARD * k)
        return Draft([7] * k)


class TimedDraftModel(TimedDraft, IncrementalDrafter):
    """The same, as a draft model: the controller fits its step cost as a line."""

    def pending(self, context):
        return 0

    def set_continuation_rule(self, rule):
        pass


def run(monkeypatch, model=True, priors=CrossVocabDrafter.ACCEPTANCE_PRIORS["slem"], first=0.7, then=0.9,
        steps=150, seed=0):
    """Tokens per second over the scripted steps, and the Ks drafted."""
    clock = ScriptedClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    drafter = (TimedDraftModel if model else TimedDraft)(clock, priors)
    c = SpeculationController([Source(drafter, FORWARD)], FLAT, kmax=32)
    c.start([1, 2, 3], Sampler(SamplingParams()))
    rng = np.random.default_rng(seed)
    tokens, seconds, ks = 0, 0.0, []
    for _ in range(steps):
        before = clock.now
        k = len(c.propose([1, 2, 3], 32).token_ids)
        n = 0
        while n < k and rng.random() < (first if n == 0 else then):
            n += 1
        t = FLAT(k + 1)
        clock.advance(t)
        c.observe(step_outcome(n, verified=k + 1, seconds=t, drafted=k))
        tokens, seconds = tokens + n + 1, seconds + clock.now - before
        ks.append(k)
    return tokens / seconds, ks


def test_a_drafter_with_acceptance_priors_is_planned_with_two_rates_and_a_draft_model_with_a_cost_line():
    clock = ScriptedClock()
    assert isinstance(Source(TimedDraft(clock, (0.6, 0.75)), 0.0).estimator, TwoRateEstimator)
    assert type(Source(TimedDraft(clock, None), 0.0).estimator) is AcceptanceEstimator
    assert Source(TimedDraft(clock, None), 0.0).cost_fit is None
    assert isinstance(Source(TimedDraftModel(clock, None), 0.0).cost_fit, DraftStepCost)
    assert CrossVocabDrafter.ACCEPTANCE_PRIORS["slem"][1] > CrossVocabDrafter.ACCEPTANCE_PRIORS["slem"][0]


def test_the_step_cost_line_holds_one_forward_a_token_from_steps_of_one_k_and_follows_spread_ones():
    fit = DraftStepCost(FORWARD)
    for _ in range(10):
        fit.observe(2, STEP + 2 * FORWARD)  # a cost per token would say 84 ms
    assert fit.per_token == pytest.approx(FORWARD) and fit.step == pytest.approx(STEP)
    assert fit(6) == pytest.approx(STEP + 6 * FORWARD) and fit(0) == 0.0
    fit = DraftStepCost(0.010)  # a prior slope half the real one, no fixed part
    for k in [3, 5, 2, 6, 4] * 6:
        fit.observe(k, 0.020 * k)
    assert fit(2) == pytest.approx(0.040, rel=0.2) and fit(6) == pytest.approx(0.120, rel=0.1)


def test_long_drafts_are_learned_to_pay_where_the_old_plan_settled_on_short_ones(monkeypatch):
    """The old plan (the negative control): one acceptance rate and the step's cost averaged
    per token; it drafts 1-2 tokens. With both, the controller drafts 4 or more."""
    plain = 1.0 / FLAT(1)
    new, ks_new = run(monkeypatch)
    old, ks_old = run(monkeypatch, model=False, priors=None)
    assert np.mean(ks_new[-100:]) >= 4 > 2 > np.mean(ks_old[-100:])
    assert new > 1.2 * old and new > 1.4 * plain


def test_drafting_still_backs_off_where_drafts_are_rejected(monkeypatch):
    rate, ks = run(monkeypatch, first=0.3, then=0.3)
    assert np.mean(ks[-60:]) < 1 and rate >= 0.95 / FLAT(1)


def test_two_rates_relax_toward_their_priors():
    rates = TwoRateEstimator(0.6, 0.8, decay=0.5)
    for _ in range(20):
        rates.update(4, 1)  # the first accepted, the second not
    low_first, low_then = rates.first.alpha, rates.then.alpha
    assert low_then < 0.1
    rates.relax()
    assert 0.6 < rates.first.alpha < low_first and low_then < rates.then.alpha < 0.8  # each toward its prior
    rates.decay = 0.0
    rates.relax()
    assert rates.first.alpha == pytest.approx(0.6) and rates.then.alpha == pytest.approx(0.8)


def test_the_explanation_names_both_rates_of_a_drafter_that_does_not_pay():
    steep = CostCurve(tuple(range(1, 34)), tuple(0.03 + 0.02 * (n - 1) for n in range(1, 34)))
    c = SpeculationController([Source(TimedDraftModel(ScriptedClock(), (0.6, 0.75)), 0.003)], steep, kmax=8)
    c.start([1, 2, 3], Sampler(SamplingParams()))
    assert c.propose([1, 2, 3], 8).token_ids == []  # at 0.6 and 0.75 no K pays; with all accepted K = 4 would
    assert "at its estimated acceptance 0.60 (first token; 0.75 each later one) it does not pay" in c.explain()


def test_each_method_of_a_drafter_is_planned_from_its_own_priors_and_keeps_its_own_evidence():
    """A draft model across tokenizers runs SLEM for greedy generations and TLI for sampled ones:
    a sampled generation is planned from TLI's priors, and each method's estimate is its own."""
    slem, tli = CrossVocabDrafter.ACCEPTANCE_PRIORS["slem"], CrossVocabDrafter.ACCEPTANCE_PRIORS["tli"]
    drafter = TimedDraftModel(ScriptedClock(), slem)
    c = SpeculationController([Source(drafter, FORWARD)], FLAT, kmax=8)
    s = c.sources[0]
    c.start([1, 2, 3], Sampler(SamplingParams()))
    s.estimator.update(4, 4)
    learned = s.estimator.first.alpha
    drafter.acceptance_priors = tli  # what CrossVocabDrafter.start says for a sampled generation
    c.start([1, 2, 3], Sampler(SamplingParams(temperature=0.8)))
    assert (s.estimator.prior_first, s.estimator.prior_then) == tli and s.estimator.first.alpha == pytest.approx(tli[0])
    drafter.acceptance_priors = slem
    c.start([1, 2, 3], Sampler(SamplingParams()))
    assert s.estimator.first.alpha == pytest.approx(learned)  # SLEM's evidence kept
