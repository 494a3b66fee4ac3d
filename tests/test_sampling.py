"""Tests of specdecode.sampling: parameter validation, penalties and the shaping transforms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specdecode.errors import SpecDecodeError
from specdecode.sampling import Sampler, SamplingParams

# ---------------------------------------------------------------------------------------
# SamplingParams validation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5),
        ("temperature", 100.5),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", -0.25),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.25),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.5),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.25),
        ("presence_penalty", 3.0),
        ("presence_penalty", -2.5),
        ("penalty_last_n", -2),
        ("seed", -1),
        ("seed", 2**64),
    ],
)
def test_out_of_range_raises_with_field_and_value(field, value):
    with pytest.raises(SpecDecodeError) as info:
        SamplingParams(**{field: value})
    msg = str(info.value)
    assert field in msg
    assert repr(value) in msg or str(value) in msg


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 100.0},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"repetition_penalty": 1e-3},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0},
        {"frequency_penalty": 2.0, "presence_penalty": -2.0},
        {"penalty_last_n": -1},
        {"penalty_last_n": 0},
        {"seed": 0},
        {"seed": 2**64 - 1},
    ],
)
def test_boundary_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


def test_greedy_and_has_penalties_properties():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(frequency_penalty=0.5).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    # A zero-length window disables every penalty.
    assert not SamplingParams(repetition_penalty=1.3, presence_penalty=1.0, penalty_last_n=0).has_penalties


def test_spec_decode_error_is_exception():
    assert issubclass(SpecDecodeError, Exception)


# ---------------------------------------------------------------------------------------
# Sampler.shape
# ---------------------------------------------------------------------------------------


def _softmax_by_hand(logits, temperature):
    e = [math.exp(x / temperature) for x in logits]
    s = sum(e)
    return [x / s for x in e]


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 2.5])
def test_shape_temperature_matches_hand_softmax(temperature):
    logits = [1.0, 2.0, 3.0, 0.5, -1.0]
    probs = Sampler(SamplingParams(temperature=temperature)).shape(np.array(logits, dtype=np.float32))
    assert probs.dtype == np.float64
    assert probs.shape == (5,)
    np.testing.assert_allclose(probs, _softmax_by_hand(logits, temperature), rtol=1e-9, atol=1e-12)


def test_shape_temperature_is_not_the_identity():
    logits = np.array([1.0, 2.0, 3.0])
    cold = Sampler(SamplingParams(temperature=0.5)).shape(logits)
    warm = Sampler(SamplingParams(temperature=2.0)).shape(logits)
    assert cold[2] > warm[2] and cold[0] < warm[0]


def test_shape_large_logits_stay_finite():
    probs = Sampler(SamplingParams(temperature=0.1)).shape(np.array([1000.0, 999.0, -1000.0]))
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(probs, _softmax_by_hand([10.0, 0.0, -20000.0], 1.0), rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize("k", [1, 3, 10, 49])
def test_top_k_keeps_exactly_k(k):
    rng = np.random.default_rng(k)
    logits = rng.normal(size=50)  # distinct almost surely
    probs = Sampler(SamplingParams(temperature=0.8, top_k=k)).shape(logits)
    kept = np.flatnonzero(probs > 0)
    assert len(kept) == k
    assert set(kept) == set(np.argsort(-logits)[:k])
    np.testing.assert_allclose(probs.sum(), 1.0)
    expected = np.exp(logits[kept] / 0.8)
    np.testing.assert_allclose(probs[kept], expected / expected.sum(), rtol=1e-9)


@pytest.mark.parametrize("k", [0, 50, 80])
def test_top_k_disabled_or_not_smaller_than_vocab_keeps_all(k):
    logits = np.random.default_rng(0).normal(size=50)
    probs = Sampler(SamplingParams(temperature=1.0, top_k=k)).shape(logits)
    assert (probs > 0).all()
    np.testing.assert_allclose(probs, _softmax_by_hand(list(logits), 1.0), rtol=1e-9)


def _probs_logits(probs):
    return np.log(np.asarray(probs, dtype=np.float64))


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.4, [0]),
        (0.75, [0, 1]),
        (0.85, [0, 1, 2]),
        (0.99, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p, kept):
    base = np.array([0.5, 0.3, 0.15, 0.05])
    perm = np.array([2, 0, 3, 1])  # shuffle so the kept set is not a prefix of the array
    logits = _probs_logits(base[perm])
    probs = Sampler(SamplingParams(temperature=1.0, top_p=top_p)).shape(logits)
    kept_ids = sorted(int(np.flatnonzero(perm == i)[0]) for i in kept)
    assert sorted(np.flatnonzero(probs > 0).tolist()) == kept_ids
    expected = np.zeros(4)
    expected[kept_ids] = base[perm][kept_ids] / base[perm][kept_ids].sum()
    np.testing.assert_allclose(probs, expected, rtol=1e-9, atol=1e-15)


def test_top_p_keeps_ties_at_the_cutoff():
    logits = _probs_logits([0.4, 0.2, 0.2, 0.2])
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.5)).shape(logits)
    # 0.4 + 0.2 reaches 0.5; the other two 0.2 tokens tie with the last kept one.
    assert (probs > 0).all()


def _reference_top_p(probs, top_p):
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    n_keep = int(np.argmax(cum >= top_p)) + 1 if cum[-1] >= top_p else len(order)
    out = np.zeros_like(probs)
    out[order[:n_keep]] = probs[order[:n_keep]]
    return out / out.sum(), n_keep


@pytest.mark.parametrize(
    "scale, top_p, min_kept",
    [
        (0.01, 0.5, 1025),  # nearly uniform: about 2,500 of 5,000 kept -> full-sort fallback
        (0.01, 0.95, 1025),  # about 4,750 kept
        (3.0, 0.5, 1),  # peaked: kept set inside the first 1,024-token slice
    ],
)
def test_top_p_large_vocabulary_matches_full_sort(scale, top_p, min_kept):
    v = 5000
    logits = np.random.default_rng(11).normal(0.0, scale, size=v)
    probs = Sampler(SamplingParams(temperature=1.0, top_p=top_p)).shape(logits)
    softmax = np.exp(logits - logits.max())
    softmax /= softmax.sum()
    expected, n_keep = _reference_top_p(softmax, top_p)
    assert n_keep >= min_kept
    if min_kept > 1024:
        assert n_keep > 1024  # the fallback path of _top_p is exercised
    assert int((probs > 0).sum()) == n_keep
    np.testing.assert_array_equal(probs > 0, expected > 0)
    np.testing.assert_allclose(probs, expected, rtol=1e-9, atol=1e-15)
    # The kept set is the smallest reaching the mass: dropping its least likely token falls short.
    kept_mass = softmax[probs > 0].sum()
    assert kept_mass >= top_p - 1e-12
    assert kept_mass - softmax[probs > 0].min() < top_p


@pytest.mark.parametrize(
    "min_p, kept",
    [(0.2, [0, 1, 2]), (0.5, [0, 1]), (0.7, [0]), (1.0, [0]), (0.05, [0, 1, 2, 3])],
)
def test_min_p(min_p, kept):
    base = np.array([0.5, 0.3, 0.15, 0.04])
    base = base / base.sum()
    probs = Sampler(SamplingParams(temperature=1.0, min_p=min_p)).shape(_probs_logits(base))
    assert np.flatnonzero(probs > 0).tolist() == kept
    np.testing.assert_allclose(probs[kept], base[kept] / base[kept].sum(), rtol=1e-9)


def test_combined_order_top_k_then_top_p_then_min_p():
    base = np.array([0.30, 0.25, 0.20, 0.15, 0.10])
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.8, min_p=0.5)
    probs = Sampler(params).shape(_probs_logits(base))
    # top-k 4: [.30,.25,.20,.15]/.90 = [.333,.278,.222,.167]; top-p 0.8 keeps 3 tokens
    # (.333+.278 = .611 < .8; + .222 = .833); renormalised [.4, .333, .267];
    # min-p 0.5: threshold .2 keeps all three.
    expected = np.array([0.30, 0.25, 0.20, 0.0, 0.0]) / 0.75
    np.testing.assert_allclose(probs, expected, rtol=1e-9, atol=1e-15)
    # min-p 0.7 applies after renormalisation: threshold .28 keeps tokens 0 and 1.
    probs = Sampler(SamplingParams(temperature=1.0, top_k=4, top_p=0.8, min_p=0.7)).shape(_probs_logits(base))
    np.testing.assert_allclose(probs, np.array([0.30, 0.25, 0, 0, 0]) / 0.55, rtol=1e-9, atol=1e-15)


# ---------------------------------------------------------------------------------------
# Sampler.penalize
# ---------------------------------------------------------------------------------------

LOGITS = np.array([2.0, -1.0, 0.5, 3.0, -2.0], dtype=np.float32)


def test_repetition_penalty_divides_positive_multiplies_negative():
    s = Sampler(SamplingParams(temperature=1.0, repetition_penalty=2.0))
    out = s.penalize(LOGITS, [0, 1, 1, 4])
    np.testing.assert_allclose(out, [1.0, -2.0, 0.5, 3.0, -4.0])
    assert out.dtype == np.float32
    # Count does not matter for the repetition penalty, only presence.
    np.testing.assert_allclose(s.penalize(LOGITS, [0]), s.penalize(LOGITS, [0, 0, 0]))


def test_repetition_penalty_below_one_boosts():
    out = Sampler(SamplingParams(repetition_penalty=0.5)).penalize(LOGITS, [0, 1])
    np.testing.assert_allclose(out, [4.0, -0.5, 0.5, 3.0, -2.0])


def test_frequency_and_presence_penalties():
    s = Sampler(SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25))
    out = s.penalize(LOGITS, [0, 1, 1, 1, 3])
    # subtract count * 0.5 + 0.25 for every token in the history
    np.testing.assert_allclose(out, [2.0 - 0.75, -1.0 - 1.75, 0.5, 3.0 - 0.75, -2.0], rtol=1e-6)


def test_negative_frequency_and_presence_penalties_add():
    s = Sampler(SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5))
    out = s.penalize(LOGITS, [2, 2])
    np.testing.assert_allclose(out, [2.0, -1.0, 0.5 + 2.5, 3.0, -2.0], rtol=1e-6)


def test_repetition_then_frequency_presence():
    s = Sampler(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0))
    out = s.penalize(LOGITS, [0, 1, 1])
    # token 0: 2/2 - 0.5 - 1 = -0.5; token 1: -1*2 - 1.0 - 1 = -4
    np.testing.assert_allclose(out, [-0.5, -4.0, 0.5, 3.0, -2.0], rtol=1e-6)


def test_penalty_last_n_window():
    history = [0, 0, 0, 1, 2]
    s = Sampler(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, penalty_last_n=2))
    out = s.penalize(LOGITS, history)
    # Only the last two tokens (1, 2) are seen; token 0 is untouched.
    np.testing.assert_allclose(out, [2.0, -2.5, -1.0, 3.0, -2.0], rtol=1e-6)
    s3 = Sampler(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, penalty_last_n=3))
    np.testing.assert_allclose(s3.penalize(LOGITS, history), [0.5, -2.5, -1.0, 3.0, -2.0], rtol=1e-6)


def test_penalty_last_n_minus_one_is_whole_history():
    history = [0] * 100 + [3]
    s = Sampler(SamplingParams(frequency_penalty=0.01, penalty_last_n=-1))
    np.testing.assert_allclose(s.penalize(LOGITS, history), [1.0, -1.0, 0.5, 2.99, -2.0], rtol=1e-6)
    # The default window (64) sees only 63 zeros and the 3.
    d = Sampler(SamplingParams(frequency_penalty=0.01))
    assert d.params.penalty_last_n == 64
    np.testing.assert_allclose(d.penalize(LOGITS, history), [2.0 - 0.63, -1.0, 0.5, 2.99, -2.0], rtol=1e-6)


def test_penalty_last_n_longer_than_history():
    s = Sampler(SamplingParams(presence_penalty=1.0, penalty_last_n=1000))
    np.testing.assert_allclose(s.penalize(LOGITS, [4]), [2.0, -1.0, 0.5, 3.0, -3.0])


def test_penalize_no_op_cases_and_no_mutation():
    logits = LOGITS.copy()
    assert Sampler(SamplingParams()).penalize(logits, [0, 1]) is logits
    assert Sampler(SamplingParams(repetition_penalty=2.0)).penalize(logits, []) is logits
    assert Sampler(SamplingParams(repetition_penalty=2.0, penalty_last_n=0)).penalize(logits, [0, 1]) is logits
    out = Sampler(SamplingParams(repetition_penalty=2.0)).penalize(logits, [0, 1])
    assert out is not logits
    np.testing.assert_array_equal(logits, LOGITS)


def test_penalize_ignores_ids_outside_vocabulary():
    s = Sampler(SamplingParams(presence_penalty=1.0))
    np.testing.assert_allclose(s.penalize(LOGITS, [3, 5, 99]), [2.0, -1.0, 0.5, 2.0, -2.0])


def test_probs_is_penalize_then_shape():
    s = Sampler(SamplingParams(temperature=0.9, repetition_penalty=1.5, top_k=3))
    history = [3, 0]
    np.testing.assert_allclose(s.probs(LOGITS, history), s.shape(s.penalize(LOGITS, history)))
    # penalised: [1.333, -1, .5, 2, -2] -> top-3 keeps tokens 3, 0, 2
    assert np.flatnonzero(s.probs(LOGITS, history) > 0).tolist() == [0, 2, 3]


# ---------------------------------------------------------------------------------------
# Greedy argmax and seeded sampling
# ---------------------------------------------------------------------------------------


def test_argmax_without_penalties():
    assert Sampler(SamplingParams()).argmax(np.array([5.0, 4.9, 1.0]), [0, 0]) == 0


def test_argmax_with_repetition_penalty():
    s = Sampler(SamplingParams(repetition_penalty=2.0))
    assert s.argmax(np.array([5.0, 4.9, 1.0]), [0]) == 1
    assert s.argmax(np.array([5.0, 4.9, 1.0]), [2]) == 0
    assert type(s.argmax(np.array([5.0, 4.9, 1.0]), [0])) is int


def test_argmax_with_presence_penalty_and_window():
    s = Sampler(SamplingParams(presence_penalty=2.0, penalty_last_n=1))
    logits = np.array([5.0, 4.0, 1.0])
    assert s.argmax(logits, [0]) == 1  # 5 - 2 = 3 < 4
    assert s.argmax(logits, [0, 2]) == 0  # token 0 fell out of the 1-token window


@pytest.mark.parametrize("rule", ["gumbel", "rejection"])
def test_draws_are_reproducible_for_a_seed(rule):
    probs = np.array([0.1, 0.2, 0.3, 0.25, 0.15])
    a, b, c = (Sampler(SamplingParams(temperature=1.0, seed=seed, sampling_rule=rule)) for seed in (1234, 1234, 4321))
    xa = [a.draw(probs, i) for i in range(300)]
    xb = [b.draw(probs, i) for i in range(300)]
    xc = [c.draw(probs, i) for i in range(300)]
    assert xa == xb
    assert xa != xc
    assert set(xa) == {0, 1, 2, 3, 4}
    assert all(type(x) is int for x in xa)


def test_a_keyed_draw_depends_on_its_position_only():
    """The "gumbel" rule: the token at a position is the same however often, in whatever
    order, and after whatever other draws it is asked for."""
    probs = np.array([0.1, 0.2, 0.3, 0.25, 0.15])
    a = Sampler(SamplingParams(temperature=1.0, seed=5), prompt_len=10)
    b = Sampler(SamplingParams(temperature=1.0, seed=5), prompt_len=10)
    forward = [a.draw(probs, 10 + i) for i in range(200)]
    backward = [b.draw(probs, 10 + i) for i in reversed(range(200))][::-1]
    assert forward == backward == [a.draw(probs, 10 + i) for i in range(200)]
    c = Sampler(SamplingParams(temperature=1.0, seed=5), prompt_len=3)  # keyed by the position in the output
    assert [c.draw(probs, 3 + i) for i in range(200)] == forward


@pytest.mark.parametrize("rule", ["gumbel", "rejection"])
def test_draws_respect_the_distribution(rule):
    s = Sampler(SamplingParams(temperature=1.0, seed=7, sampling_rule=rule))
    assert {s.draw(np.array([0.0, 0.0, 1.0, 0.0]), i) for i in range(50)} == {2}
    probs = np.array([0.0, 0.7, 0.0, 0.3, 0.0])
    draws = np.array([s.draw(probs, i) for i in range(5000)])
    assert set(draws.tolist()) == {1, 3}
    assert 3300 < (draws == 1).sum() < 3700


def test_sampler_rng_seeded_from_params():
    a = Sampler(SamplingParams(temperature=1.0, seed=99))
    assert a.rng.random() == np.random.default_rng(99).random()
