"""Cost model and controller: formulas against hand-computed values, K choices with fake
costs and fake drafters (no timing), and parity with auto exactly as with a fixed K."""

from __future__ import annotations

import pytest

from specdecode.control.controller import Source, SpeculationController
from specdecode.control.estimators import AcceptanceEstimator
from specdecode.control.costmodel import (CostCurve, choose_k, curve_table, expected_tokens, expected_tokens_positional,
                                         expected_tokens_upto, fit_linear, step_rate)
from specdecode.drafters import Draft, DrafterBase, IncrementalDrafter, NgramDrafter, NoDrafter
from specdecode.engine import SpeculativeEngine
from specdecode.parity import parity_report
from specdecode.sampling import Sampler, SamplingParams

from conftest import OracleDrafter, ScriptedBackend, step_outcome


def test_expected_tokens_hand_computed():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)  # 1 + 0.5
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)  # 3.3616
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens_positional([0.8] * 4) == pytest.approx(3.3616)
    assert expected_tokens_positional([0.9, 0.5]) == pytest.approx(1 + 0.9 + 0.45)
    with pytest.raises(ValueError):
        expected_tokens(1.2, 3)


def test_cost_curve_fit_and_interpolation():
    a, b = fit_linear([1, 2, 3, 4], [0.03, 0.05, 0.07, 0.09])
    assert a == pytest.approx(0.01) and b == pytest.approx(0.02)
    a, b = fit_linear([1, 3], [1.0, 2.0])
    assert (a, b) == (pytest.approx(0.5), pytest.approx(0.5))
    c = CostCurve((1, 2, 4), (0.035, 0.05, 0.1))
    assert c(1) == pytest.approx(0.035)
    assert c(3) == pytest.approx(0.075)  # halfway between 0.05 and 0.1
    a, b = fit_linear([1, 2, 4], [0.035, 0.05, 0.1])
    assert c(8) == pytest.approx(a + 8 * b)
    assert CostCurve.from_dict(c.to_dict()) == c


def best_k(alpha: float, kmax: int, target: CostCurve, draft_cost: float) -> int:
    """The controller's K chooser at a per-token acceptance alpha."""
    return choose_k(expected_tokens_upto(alpha, kmax), draft_cost, curve_table(target, kmax + 1))[0]


def test_step_rate_and_best_k_hand_computed():
    # Memory-bound target (verification as cheap as one token), free drafts, alpha 0.8.
    flat = CostCurve(tuple(range(1, 10)), (0.1,) * 9)
    assert step_rate(0.8, 4, flat, 0.0) == pytest.approx(33.616)
    assert best_k(0.8, 8, flat, 0.0) == 8
    # Compute-bound target like the 1.5B on this CPU: T(n) = 0.035 + 0.022 (n - 1).
    cpu = CostCurve(tuple(range(1, 10)), tuple(0.035 + 0.022 * (n - 1) for n in range(1, 10)))
    assert best_k(0.0, 8, cpu, 0.0) == 0
    # A draft model costing 0.65 of the target never pays there, even at alpha 0.9 ...
    assert best_k(0.9, 8, cpu, 0.65 * 0.035) == 0
    # ... while free n-gram drafts at alpha 0.9 do: k=2 gives 2.71 / 0.079 = 34.30 tokens/s,
    # k=3 gives 3.439 / 0.101 = 34.05, plain gives 1 / 0.035 = 28.57.
    assert step_rate(0.9, 2, cpu, 0.0) == pytest.approx(2.71 / 0.079)
    assert step_rate(0.9, 3, cpu, 0.0) == pytest.approx(3.439 / 0.101)
    assert best_k(0.9, 8, cpu, 0.0) == 2


class FixedDrafter(DrafterBase):
    """Proposes k copies of a token; counts how often it is asked."""

    def __init__(self, token: int, name: str = "fixed"):
        self.token = token
        self.name = name
        self.calls = 0

    def start(self, prompt_ids, sampler):
        pass

    def propose(self, context, k):
        self.calls += 1
        return Draft([self.token] * k)


class FixedModel(FixedDrafter, IncrementalDrafter):
    """A FixedDrafter that, like a draft model, must read the text before drafting."""

    def pending(self, context):
        return 0

    def set_continuation_rule(self, rule):
        pass

    def observe(self, outcome):
        pass

    def finish(self, committed):
        pass


CPU = CostCurve(tuple(range(1, 10)), tuple(0.035 + 0.022 * (n - 1) for n in range(1, 10)))
FLAT = CostCurve(tuple(range(1, 10)), (0.035,) * 9)


def drive(controller, accept_all: bool, steps: int = 40, cap: int = 8):
    ks = []
    controller.start([1, 2, 3], Sampler(SamplingParams()))
    for _ in range(steps):
        d = controller.propose([1, 2, 3], cap)
        k = len(d.token_ids)
        ks.append(k)
        controller.observe(step_outcome(k if accept_all else 0))
    return ks


def test_controller_picks_plain_when_drafts_are_always_rejected():
    # A compute-bound target (verifying 2 tokens costs more than 1): rejected drafts are pure
    # loss. (With a flat curve and free drafts even a tiny acceptance rate pays.)
    c = SpeculationController([Source(FixedDrafter(7), 0.001)], CPU, kmax=8, probe_every=16)
    ks = drive(c, accept_all=False, steps=60)
    assert ks[-10:] == [0] * 10 or sum(k == 0 for k in ks[-20:]) >= 18  # only probes remain
    assert sum(ks[20:]) <= 2 * 3  # at most a few short probes in the last 40 steps


def test_controller_picks_a_large_k_when_drafts_are_always_accepted():
    c = SpeculationController([Source(FixedDrafter(7), 0.0)], FLAT, kmax=8)
    ks = drive(c, accept_all=True)
    assert ks[-1] == 8 and all(k == 8 for k in ks[-10:])
    assert c.sources[0].estimator.alpha > 0.95


def test_controller_on_a_compute_bound_target_stays_moderate():
    c = SpeculationController([Source(FixedDrafter(7), 0.0)], CPU, kmax=8)
    ks = drive(c, accept_all=True)
    assert 0 < ks[-1] <= 8


def test_controller_prefers_the_cheaper_drafter_and_falls_back():
    class Empty(FixedDrafter):
        def propose(self, context, k):
            self.calls += 1
            return Draft([])

    ngram, model = Empty(5, "ngram"), FixedDrafter(6, "model")
    c = SpeculationController([Source(ngram, 0.0), Source(model, 0.001)], FLAT, kmax=4)
    d = c.propose([1, 2], 4)
    assert ngram.calls == 1 and model.calls == 1 and d.token_ids == [6] * len(d.token_ids)
    assert c.choices["model"] == 1


def test_estimator():
    e = AcceptanceEstimator(prior_alpha=0.5, prior_weight=2.0, decay=1.0)
    e.update(4, 4)  # 4 accepted, no rejection
    assert e.alpha == pytest.approx(5 / 6)
    e.update(4, 1)  # 1 accepted, 1 rejection
    assert e.alpha == pytest.approx(6 / 8)
    e.update(0, 0)
    assert e.alpha == pytest.approx(6 / 8)


def test_auto_parity_on_a_scripted_target():
    pieces = [b"", b"?"] + [bytes([97 + i]) for i in range(20)]
    script = [2, 3, 4, 2, 3, 4, 5, 2, 3, 4, 2, 3, 4, 5, 6, 7] * 3
    t = ScriptedBackend(pieces, script, n_prompt=3)
    auto = SpeculationController([Source(NgramDrafter(), 0.0), Source(OracleDrafter(t), 0.01)], CPU, kmax=8)
    spec = SpeculativeEngine(t, auto, 8).generate([2, 3, 4], max_tokens=40)
    t2 = ScriptedBackend(pieces, script, n_prompt=3)
    plain = SpeculativeEngine(t2, NoDrafter(), 0).generate([2, 3, 4], max_tokens=40, record_top2_gaps=True)
    assert spec.token_ids == plain.token_ids == script[:40]
    assert spec.stats.drafted > 0 and spec.stats.target_forward_passes < plain.stats.target_forward_passes


def test_auto_parity_on_smollm(smollm, smollm_draft):
    from specdecode.drafters import ModelDrafter
    from specdecode.control.measure import measure_forward_curve

    curve = measure_forward_curve(smollm, [1, 2, 3, 4, 5, 6, 7, 8, 9], rounds=2).curve
    srcs = [Source(NgramDrafter(), 0.0002), Source(ModelDrafter(smollm_draft, target=smollm), curve(1))]
    ctl = SpeculationController(srcs, curve, kmax=8)
    text = smollm.apply_chat_template([{"role": "user", "content": "Repeat exactly: one two three, one two three."}])
    ids = smollm.tokenize(text, add_special=False, parse_special=True)
    spec = SpeculativeEngine(smollm, ctl, 8).generate(ids, max_tokens=48)
    plain = SpeculativeEngine(smollm, NoDrafter(), 0).generate(ids, max_tokens=48, record_top2_gaps=True)
    assert parity_report(spec, plain)["status"] in ("exact", "near-tie")
    fixed = SpeculativeEngine(smollm, ModelDrafter(smollm_draft, target=smollm), 4).generate(ids, max_tokens=48)
    assert parity_report(fixed, plain)["status"] in ("exact", "near-tie")


def test_failed_probes_back_off_and_lagging_draft_models_are_not_probed():
    c = SpeculationController([Source(FixedDrafter(7), 0.0)], CPU, kmax=8, probe_every=4)
    ks = drive(c, accept_all=False, steps=200)
    probes = [i for i, k in enumerate(ks) if k > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and gaps[-1] > 4 * gaps[0]  # exponential back-off
    assert c.sources[0].probe_gap > 4

    class Lagging(FixedModel):
        def pending(self, context):
            return 500  # a draft model 500 tokens behind the text

    lag = Source(Lagging(7), 0.01, prefill_cost=0.002)  # 1 s of catch-up
    c = SpeculationController([lag], CPU, kmax=8, probe_every=4)
    assert sum(drive(c, accept_all=True, steps=50)) == 0


class Lagging(FixedModel):
    """A draft model 500 tokens behind the text until it drafts (it catches up then);
    on_catch_up(tokens) is told of each catch-up."""

    def __init__(self, token, on_catch_up=None):
        super().__init__(token, "model")
        self.behind, self.on_catch_up = 500, on_catch_up

    def pending(self, context):
        return self.behind

    def propose(self, context, k):
        if self.on_catch_up is not None:
            self.on_catch_up(self.behind)
        self.behind = 0  # it has caught up
        return super().propose(context, k)


def test_a_draft_model_that_pays_catches_up_once():
    """A draft model 500 tokens behind (1 s of catch-up, five plain steps) is started at once
    when its steady rate repays the catch-up within the horizon (cheap drafts, flat
    verification, as a bf16 torch target on a CPU with a llama.cpp draft), and still never
    on a compute-bound target where it cannot pay at all."""

    slow_target = CostCurve(tuple(range(1, 10)), (0.2,) * 9)
    c = SpeculationController([Source(Lagging(7), 0.03, prefill_cost=0.002)], slow_target, kmax=8)
    ks = drive(c, accept_all=True, steps=5)
    assert ks[0] > 0 and all(k > 0 for k in ks)
    c = SpeculationController([Source(Lagging(7), 0.03, prefill_cost=0.002)], CPU, kmax=8, probe_every=4)
    assert sum(drive(c, accept_all=True, steps=50)) == 0


def test_a_catch_up_that_cost_more_than_its_price_is_priced_so_from_then_on(monkeypatch):
    """Issue 61: on a 7,260-token agent prompt a draft model that drafted in 1 of 70 steps took
    87.5 s of a 120.6 s decode: its first catch-up cost far more than priced. The controller now
    times each catch-up (on its clock, scripted here) and prices the next one so: a draft model
    500 tokens behind is caught up at 2 ms a token priced (1 s, repaid within the horizon on a
    flat target); the catch-up takes 50 s; 500 tokens behind again, it is not caught up."""
    import specdecode.control.controller as controller_module

    now = [0.0]
    monkeypatch.setattr(controller_module, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))

    slow_target = CostCurve(tuple(range(1, 10)), (0.2,) * 9)
    source = Source(Lagging(7, on_catch_up=lambda behind: now.__setitem__(0, now[0] + 0.1 * behind)), 0.03,
                    prefill_cost=0.002)  # 100 ms a token: 50 x what it is priced at
    c = SpeculationController([source], slow_target, kmax=8)
    ks = drive(c, accept_all=True, steps=3)
    assert ks[0] > 0  # priced at 1 s: caught up at once
    assert source.prefill_cost == pytest.approx(0.002 + 0.5 * (0.1 - 0.002), rel=0.05)  # the 50 s, observed
    source.drafter.behind = 500  # another generation: behind again
    assert drive(c, accept_all=True, steps=5) == [0] * 5  # 25 s priced: not repaid within the horizon


def test_a_drafter_silenced_by_early_rejections_is_tried_again_when_its_prior_pays(monkeypatch):
    import specdecode.control.sources as sources

    monkeypatch.setattr(sources, "COST_EMA", 0.0)  # keep the stated draft cost (no timing)
    cheap = CostCurve(tuple(range(1, 10)), (0.2,) * 9)  # verification free, drafts 0.3 of a step
    c = SpeculationController([Source(FixedDrafter(7), 0.06)], cheap, kmax=8, probe_every=1000)
    c.start([1, 2, 3], Sampler(SamplingParams()))
    ks = []
    for step in range(14):
        k = len(c.propose([1, 2, 3], 8).token_ids)
        ks.append(k)
        c.observe(step_outcome(0 if step < 2 else k))  # the first two drafts fail, later ones pass
    assert ks[2:4] == [0, 0]  # two rejections silence it (no probe for 1000 steps) ...
    assert all(k > 0 for k in ks[4:]) and ks[-1] == 8  # ... until its evidence fades toward the prior
    # Where even the prior does not pay (a compute-bound target), fading changes nothing.
    c = SpeculationController([Source(FixedDrafter(7), 0.001)], CPU, kmax=8, probe_every=1000)
    assert sum(drive(c, accept_all=False, steps=40)) == 0
