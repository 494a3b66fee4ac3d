"""The cost curve up to K = 32: a non-monotonic T(n), observed step times folded in, and a
cached curve measured again when it no longer describes the machine."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdecode.backends.base import BackendBase
from specdecode.control import costcache
from specdecode.control.controller import Source, SpeculationController
from specdecode.control.estimators import AcceptanceEstimator
from specdecode.control.costmodel import CostCurve, ObservedCurve
from specdecode.control.costcache import cached_forward_curve, mark_stale
from specdecode.control.measure import Measurement
from specdecode.drafters import Draft, DrafterBase
from specdecode.limits import AUTO_KMAX, COST_CURVE_NS
from specdecode.sampling import Sampler, SamplingParams

from conftest import step_outcome

# A llama.cpp-like CPU curve (seconds): per-token cost falls once the batch reaches 16
# tokens, so T(16) < T(12).
BENT = CostCurve((1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 33), (0.030, 0.059, 0.080, 0.103, 0.125, 0.144, 0.168, 0.227, 0.244,
                                 0.289, 0.250, 0.376, 0.412, 0.430))


class Fixed(DrafterBase):
    name = "fixed"

    def propose(self, context, k):
        return Draft([7] * k)


def source(alpha: float) -> Source:
    return Source(Fixed(), 0.0, estimator=AcceptanceEstimator(prior_alpha=alpha, prior_weight=1e6))


def test_the_curve_is_measured_at_every_size_to_k_32():
    assert COST_CURVE_NS == tuple(range(1, AUTO_KMAX + 2)) and AUTO_KMAX + 1 == 33
    assert BENT(16) < BENT(12) and BENT(14) == pytest.approx((0.289 + 0.250) / 2)


def test_plan_picks_k_15_where_t16_is_cheaper_than_t12():
    c = SpeculationController([source(0.95)], BENT, kmax=32)
    k, rate = c.plan(c.sources[0], 32)
    assert k == 15
    # By hand: E(0.95, 15) / T(16) beats every other K, plain included.
    e = (1 - 0.95 ** 16) / 0.05
    assert rate == pytest.approx(e / 0.250)
    assert rate > 1 / 0.030


def test_plan_picks_plain_when_acceptance_is_low():
    c = SpeculationController([source(0.1)], BENT, kmax=32)
    assert c.plan(c.sources[0], 32)[0] == 0


def test_always_accepted_drafts_settle_on_the_cheapest_block_per_token():
    c = SpeculationController([Source(Fixed(), 0.0, estimator=AcceptanceEstimator(prior_alpha=0.9))], BENT, kmax=32)
    c.start([1, 2, 3], Sampler(SamplingParams()))
    ks = []
    for _ in range(30):
        k = len(c.propose([1, 2, 3], 32).token_ids)
        c.observe(step_outcome(k))
        ks.append(k)
    # Fully accepted: 32 tokens for T(32) = 0.412 s (78/s) beats 16 for T(16) = 0.25 s (64/s)
    # and 9 for T(9) = 0.244 s (37/s); K = 32 would need T(33).
    assert ks[-5:] == [31] * 5


def test_observed_times_are_folded_into_the_curve():
    obs = ObservedCurve(BENT, min_samples=3)
    assert obs(16) == pytest.approx(BENT(16))
    for _ in range(10):
        obs.observe(1, 2 * BENT(1))  # this machine is now twice as slow at n = 1
    assert obs(1) == pytest.approx(2 * BENT(1), rel=1e-3)
    assert obs.drift == pytest.approx(2.0, rel=1e-3)
    # Points not yet observed follow the overall ratio, so no size looks cheap for lack of samples.
    assert obs(33) == pytest.approx(2 * BENT(33), rel=1e-3)
    np.testing.assert_allclose(obs.table(33)[1:], [obs(n) for n in range(1, 34)])


def test_controller_with_learned_costs_follows_the_machine():
    """On a machine where blocks turn out dear (observed T(16) four times the measurement),
    a controller that learns costs stops choosing the 16-token block; one that does not, keeps it."""
    drifts = []
    learned = SpeculationController([source(0.95)], BENT, kmax=32, learn_costs=True,
                                    on_drift=lambda why, live: drifts.append(why))
    fixed = SpeculationController([source(0.95)], BENT, kmax=32)
    for c in (learned, fixed):
        for _ in range(80):
            c.observe(step_outcome(0, verified=16, seconds=4 * BENT(16)))
            c.observe(step_outcome(0, verified=1, seconds=BENT(1)))
    assert fixed.plan(fixed.sources[0], 32)[0] == 15
    assert learned.plan(learned.sources[0], 32)[0] < 15
    assert len(drifts) == 1 and "the measured curve" in drifts[0] and "n = 16" in drifts[0]  # reported once


class FakeTarget(BackendBase):
    """What machine_key and measure_forward_curve read, without a model."""

    name = "fake"
    path = None
    n_threads = 2
    device = "cpu"
    cost_key = ""
    n_vocab = 1000
    n_seq = 1


@pytest.fixture
def measured(monkeypatch):
    calls = []

    def fake_measure(backend, ns, context=64, rounds=5):
        calls.append(tuple(ns))
        return Measurement(CostCurve(tuple(ns), tuple(0.01 * n for n in ns)))

    monkeypatch.setattr(costcache, "measure_forward_curve", fake_measure)
    return calls


def test_cached_curve_is_reused(tmp_path, measured):
    t = FakeTarget()
    a = cached_forward_curve(t, [1, 2, 3], tmp_path)
    b = cached_forward_curve(t, [1, 2, 3], tmp_path)
    assert a == b and len(measured) == 1


def test_curve_written_under_another_key_is_measured_again(tmp_path, measured):
    t = FakeTarget()
    cached_forward_curve(t, [1, 2, 3], tmp_path)
    path = costcache.cost_cache_path(t, tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "key": "another library build"}))
    cached_forward_curve(t, [1, 2, 3], tmp_path)
    assert len(measured) == 2


def test_old_or_drifted_curve_is_measured_again(tmp_path, measured):
    t = FakeTarget()
    cached_forward_curve(t, [1, 2, 3], tmp_path)
    cached_forward_curve(t, [1, 2, 3], tmp_path, max_age_s=-1)  # expired
    assert len(measured) == 2
    mark_stale(t, tmp_path, "observed 2.0x the measured curve")
    assert "2.0x" in json.loads(costcache.cost_cache_path(t, tmp_path).read_text())["stale"]
    cached_forward_curve(t, [1, 2, 3], tmp_path)
    assert len(measured) == 3
    cached_forward_curve(t, [1, 2, 3], tmp_path)  # the new measurement is fresh
    assert len(measured) == 3
    cached_forward_curve(t, [1, 2, 3, 4], tmp_path)  # other points
    assert len(measured) == 4


@pytest.mark.parametrize("text", [
    "[]", '"x"', "5", "null", "{", "[" * 100_000,  # not an object; cut off; nested beyond the parser
    '{"ns": [1, 2, 3], "seconds": [0, 0, 0]}',  # zeros would divide by zero
    '{"ns": [1, 2, 3], "seconds": [NaN, NaN, NaN]}',  # NaN would never draft
    '{"ns": [1, 2, 3], "seconds": [Infinity, 1, 1]}', '{"ns": [1, 2, 3], "seconds": [1e300, 1e300, 1e300]}',
    '{"ns": [1, 2, 3], "seconds": [0.01, 0.02, 0.03], "others_cpu": 1' + "0" * 400 + "}",  # beyond float
    '{"ns": [1, 2, 3], "seconds": [0.01, 0.02, 0.03], "measured_at": 1' + "0" * 400 + "}",
    '{"ns": [1, 2, 3], "seconds": [0.01, 0.02, 0.03], "confirmed": 5}',
    '{"ns": "abc", "seconds": [0.01, 0.02, 0.03]}',
])
def test_a_corrupt_cached_curve_is_measured_again_and_replaced(tmp_path, measured, text):
    t = FakeTarget()
    path = costcache.cost_cache_path(t, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert cached_forward_curve(t, [1, 2, 3], tmp_path) == CostCurve((1, 2, 3), (0.01, 0.02, 0.03))
    assert len(measured) == 1
    cached_forward_curve(t, [1, 2, 3], tmp_path)  # replaced by the measurement: read back from now on
    assert len(measured) == 1


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_run(tmp_path, measured, capsys):
    t = FakeTarget()
    (tmp_path / "costs").write_text("a file where the folder should be")
    assert cached_forward_curve(t, [1, 2, 3], tmp_path) == CostCurve((1, 2, 3), (0.01, 0.02, 0.03))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "specdecode: warning: cannot keep" in err and "$SPECDECODE_CACHE" in err
    # a folder where the file should be: read as no curve, and not replaced
    other = tmp_path / "other"
    costcache.cost_cache_path(t, other).mkdir(parents=True)
    cached_forward_curve(t, [1, 2, 3], other)
    assert len(measured) == 2 and "cannot keep" in capsys.readouterr().err


def test_explain_says_why_a_costly_draft_model_is_not_used():
    class Model(DrafterBase):
        name = "model"

        def propose(self, context, k):
            return Draft([7] * k)

    cheap = source(0.95)
    dear = Source(Model(), 0.6 * BENT(1))
    c = SpeculationController([cheap, dear], BENT, kmax=32)
    c.start([1, 2, 3], Sampler(SamplingParams()))
    for _ in range(5):
        c.observe(step_outcome(len(c.propose([1, 2, 3], 32).token_ids)))
    note = c.explain()
    assert "fixed drafted in 5 of 5 steps" in note
    assert "model not used: it costs 0.60 of a target step" in note


def scripted_smollm_curve(n: int) -> float:
    """The scripted T(n) of smollm2 (seconds): flat enough (T(4) = 1.3 T(1)) that likely
    prompt-lookup drafts pay, whatever the machine measures under load."""
    return 0.012 * (1.0 + 0.1 * (n - 1))


@pytest.fixture
def scripted_costs(monkeypatch):
    """The shared cost cache set aside for one test, and the measurement a first run makes
    scripted (:func:`scripted_smollm_curve`, where lookup drafts pay): what the controller starts from
    is then the script, not whatever load the machine (or earlier tests, which may have
    rewritten smollm2's cached curve live up to T(n) = n T(1), where no draft can pay) had
    while it measured. The cache is put back afterwards."""
    from specdecode.assembly import registry

    asked = []

    def scripted(backend, ns, **kw):
        asked.append(tuple(ns))
        return Measurement(CostCurve(tuple(ns), tuple(scripted_smollm_curve(n) for n in ns)))

    monkeypatch.setattr(costcache, "measure_forward_curve", scripted)
    costs = registry.cache_dir() / "costs"
    before = {p: p.read_bytes() for p in costs.glob("*.json")} if costs.is_dir() else {}
    for p in before:
        p.unlink()
    yield asked
    for p in costs.glob("*.json") if costs.is_dir() else ():
        p.unlink()
    for p, data in before.items():
        p.write_bytes(data)


def test_auto_draft_with_a_fixed_k_caps_the_controller(smollm_path, scripted_costs):
    """--draft auto -k 3: the controller chooses the drafter each step, never more than 3 tokens;
    -k 0 is plain decoding. It starts from the scripted curve (drafts pay), so whether it
    drafts depends on the text and the controller, not on the machine's load."""
    import specdecode

    text = "Repeat exactly: alpha beta gamma delta epsilon zeta eta theta. " * 3
    with specdecode.Decoder(target="smollm2-135m-instruct", draft="auto", num_speculative_tokens=3,
                            progress=False) as dec:
        assert isinstance(dec.drafter, SpeculationController) and dec.drafter.kmax == 3
        assert scripted_costs and scripted_costs[0] == (1, 2, 3, 4)  # T(n) up to k + 1, from the script
        r = dec.generate(messages=[{"role": "user", "content": text}], max_tokens=24)
        assert r.stats.drafted > 0 and all(int(k) <= 3 for k in r.stats.k_histogram)
    with specdecode.Decoder(target="smollm2-135m-instruct", draft="auto", num_speculative_tokens=0,
                            progress=False) as dec:
        assert dec.generate("def f():", max_tokens=4).stats.drafted == 0


def _bounded_reference(curve: ObservedCurve, v: np.ndarray, trusted: np.ndarray) -> np.ndarray:
    """ObservedCurve's bounds on untrusted points as first written: one point at a time, every
    bound a loop over the points before or after it (what the vectorised form must equal)."""
    vs, ns, ok, bs = v.tolist(), curve._ns.tolist(), trusted.tolist(), curve._base_s.tolist()
    for j in range(len(vs)):
        if ok[j]:
            continue
        below = [vs[i] * min(1.0, bs[j] / bs[i]) for i in range(j) if ok[i]]
        above = [vs[i] for i in range(j + 1, len(vs)) if ok[i]]
        lo = curve.FALL * max(below) if below else 0.0
        hi = curve.RISE * min(above) if above else float("inf")
        if j > 0:
            hi = min(hi, curve.PER_TOKEN * min(vs[i] / ns[i] for i in range(j)) * ns[j])
        vs[j] = min(max(vs[j], lo), max(hi, lo))
    return np.asarray(vs)


def test_the_planned_curve_keeps_untrusted_points_within_the_trusted_ones_bounds():
    """The bounds of ObservedCurve.values, computed at once, equal the one-point-at-a-time
    loop on random curves and samples (dips, rises, a kernel's cheap size, load bursts), and
    they bind: some untrusted point is moved by them in most trials."""
    rng = np.random.default_rng(7)
    moved = 0
    for _ in range(400):
        ns = sorted(int(n) for n in rng.choice(np.arange(1, 60), size=int(rng.integers(2, 34)), replace=False))
        secs = [0.03 * (1 + rng.uniform(0.3, 0.9) * (n - 1)) * rng.uniform(0.7, 1.3) for n in ns]
        curve = ObservedCurve(CostCurve(tuple(ns), tuple(secs)))
        for _ in range(int(rng.integers(1, 40))):
            n = int(rng.choice(ns)) if rng.random() < 0.8 else int(rng.integers(1, 70))
            curve.observe(n, curve.base(n) * rng.uniform(0.4, 2.5))
        trusted = curve.trusted()
        if not trusted.any() or trusted.all():
            continue
        ratio = np.array([np.median(d) if ok else curve.drift for d, ok in zip(curve._recent, trusted)])
        ratio[~trusted] = np.interp(curve._ns[~trusted], curve._ns[trusted], ratio[trusted])
        v = curve._base_s * ratio
        expected = _bounded_reference(curve, v, trusted)
        assert np.allclose(curve._bounded(v, trusted), expected, rtol=1e-12, atol=0)
        moved += not np.allclose(expected, v)
    assert moved > 50
