"""Tests of the acceptance rules in specdecode.verify.

Two kinds of test:

* crafted cases whose outcome is known exactly (greedy exact match; speculative sampling
  with probabilities 0 and 1 where no randomness is left);
* statistical tests of losslessness (docs/architecture.md, "Lossless, defined"): run the real
  ``verify_speculative_sampling`` on >= 100,000 seeded trials and check with a
  chi-square test that the committed tokens are distributed as the target's
  distribution; the same harness with a deliberately wrong rule must fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specdecode.sampling import Sampler, SamplingParams
from specdecode.verify import (
    VerifyResult,
    committed_tokens,
    sample_token,
    verify_greedy,
    verify_speculative_sampling,
)

# ---------------------------------------------------------------------------------------
# verify_greedy
# ---------------------------------------------------------------------------------------


def test_greedy_all_accepted_gives_bonus_from_last_position():
    r = verify_greedy([5, 7, 9], [5, 7, 9, 11])
    assert r == VerifyResult(num_accepted=3, next_token=11, is_bonus=True)


def test_greedy_first_rejected():
    r = verify_greedy([4, 7, 9], [5, 7, 9, 11])
    assert r == VerifyResult(num_accepted=0, next_token=5, is_bonus=False)


def test_greedy_middle_rejected_stops_at_first_mismatch():
    # Position 2 matches again, but verification must stop at the first mismatch (pos 1).
    r = verify_greedy([5, 8, 9, 2], [5, 7, 9, 2, 3])
    assert r == VerifyResult(num_accepted=1, next_token=7, is_bonus=False)


def test_greedy_last_rejected():
    r = verify_greedy([5, 7, 1], [5, 7, 9, 11])
    assert r == VerifyResult(num_accepted=2, next_token=9, is_bonus=False)


def test_greedy_empty_draft_takes_target_argmax_0():
    r = verify_greedy([], [42])
    assert r.num_accepted == 0
    assert r.next_token == 42
    assert r.is_bonus  # vacuously all (zero) drafts accepted
    assert committed_tokens([], r) == [42]


def test_greedy_accepts_numpy_inputs_and_returns_python_ints():
    r = verify_greedy(np.array([3, 1], dtype=np.int32), np.array([3, 1, 2], dtype=np.int64))
    assert r == VerifyResult(num_accepted=2, next_token=2, is_bonus=True)
    assert type(r.next_token) is int and type(r.num_accepted) is int


@pytest.mark.parametrize(
    "draft, target",
    [([1, 2], [1, 2]), ([1, 2], [1, 2, 3, 4]), ([], []), ([1], [])],
)
def test_greedy_shape_error(draft, target):
    with pytest.raises(ValueError, match="K\\+1"):
        verify_greedy(draft, target)


def test_committed_tokens_accepted_prefix_then_next_token():
    draft = [10, 11, 12]
    assert committed_tokens(draft, VerifyResult(0, 99, False)) == [99]
    assert committed_tokens(draft, VerifyResult(2, 99, False)) == [10, 11, 99]
    assert committed_tokens(draft, VerifyResult(3, 99, True)) == [10, 11, 12, 99]
    out = committed_tokens(np.array(draft, dtype=np.int64), VerifyResult(1, 7, False))
    assert out == [10, 7] and all(type(t) is int for t in out)


def test_committed_tokens_from_greedy_result():
    draft = [5, 8, 9]
    r = verify_greedy(draft, [5, 7, 9, 1])
    assert committed_tokens(draft, r) == [5, 7]


# ---------------------------------------------------------------------------------------
# verify_speculative_sampling: crafted cases
# ---------------------------------------------------------------------------------------

V = 6


def one_hot(i: int, v: int = V) -> np.ndarray:
    row = np.zeros(v)
    row[i] = 1.0
    return row


def test_onehot_draft_target_prob_one_always_accepted():
    draft = [2, 4, 1]
    target = np.stack([one_hot(2), one_hot(4), one_hot(1), one_hot(5)])
    for seed in range(200):
        r = verify_speculative_sampling(draft, None, target, np.random.default_rng(seed))
        assert r == VerifyResult(num_accepted=3, next_token=5, is_bonus=True)
        assert committed_tokens(draft, r) == [2, 4, 1, 5]


def test_target_prob_zero_on_draft_always_rejected_and_recovered_differs():
    draft = [2, 3]
    rng = np.random.default_rng(0)
    row1 = rng.random(V)
    row1[3] = 0.0  # target gives the second draft probability 0
    row1 /= row1.sum()
    target = np.stack([one_hot(2), row1, np.full(V, 1.0 / V)])
    for draft_probs in (None, np.stack([one_hot(2), np.full(V, 1.0 / V)])):
        seen = set()
        for seed in range(300):
            r = verify_speculative_sampling(draft, draft_probs, target, np.random.default_rng(seed))
            assert r.num_accepted == 1
            assert not r.is_bonus
            assert r.next_token != 3
            assert target[1, r.next_token] > 0.0
            seen.add(r.next_token)
        # The recovered token is really sampled (not a fixed fallback): several values occur.
        assert len(seen) >= 3


def test_rejection_at_position_0_with_zero_target_mass():
    draft = [0, 1]
    target = np.stack([np.array([0.0, 0.2, 0.8, 0, 0, 0]), one_hot(1), one_hot(2)])
    draft_probs = np.stack([np.array([0.5, 0.5, 0, 0, 0, 0]), one_hot(1)])
    for seed in range(100):
        r = verify_speculative_sampling(draft, draft_probs, target, np.random.default_rng(seed))
        assert r.num_accepted == 0 and not r.is_bonus
        # residual = max(0, target - draft) = [0, 0, 0.8, 0, 0, 0]
        assert r.next_token == 2


def test_recovered_token_comes_from_residual_not_target():
    # target [0.5, 0.5, 0, ...], draft one-hot at 0: accepted w.p. 0.5; on rejection the
    # residual max(0, target - draft) is all on token 1, so the recovered token must be 1.
    target = np.stack([np.array([0.5, 0.5, 0, 0, 0, 0]), one_hot(4)])
    for draft_probs in (None, one_hot(0)[None, :]):
        outcomes = {0: 0, 1: 0}
        for seed in range(400):
            r = verify_speculative_sampling([0], draft_probs, target, np.random.default_rng(seed))
            outcomes[r.num_accepted] += 1
            if r.num_accepted == 0:
                assert r.next_token == 1 and not r.is_bonus
            else:
                assert r.next_token == 4 and r.is_bonus
        assert 120 < outcomes[0] < 280 and 120 < outcomes[1] < 280


def test_draft_probability_zero_on_drafted_token_is_rejected():
    # A token the drafter gave probability 0 cannot have been drawn: always rejected.
    target = np.stack([np.full(V, 1.0 / V), one_hot(0)])
    draft_probs = np.array([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0]])
    for seed in range(50):
        r = verify_speculative_sampling([0], draft_probs, target, np.random.default_rng(seed))
        assert r.num_accepted == 0 and not r.is_bonus


def test_empty_draft_samples_bonus_from_target_row_0():
    target = one_hot(3)[None, :]
    for draft_probs in (None, np.zeros((0, V))):
        r = verify_speculative_sampling([], draft_probs, target, np.random.default_rng(1))
        assert r == VerifyResult(num_accepted=0, next_token=3, is_bonus=True)
    # And it is really sampled from row 0: a two-token row gives both tokens.
    target = np.array([[0.0, 0.5, 0.0, 0.0, 0.5, 0.0]])
    seen = [verify_speculative_sampling([], None, target, np.random.default_rng(s)).next_token for s in range(200)]
    assert set(seen) == {1, 4}
    assert 60 < seen.count(1) < 140


def test_all_accepted_with_draft_probs_bonus_from_row_k():
    rng = np.random.default_rng(7)
    rows = rng.dirichlet(np.ones(V), size=3)
    draft = [int(np.argmax(rows[0])), int(np.argmax(rows[1])), int(np.argmax(rows[2]))]
    # target == draft at each drafted position: min(1, target/draft) == 1, always accepted.
    target = np.vstack([rows, one_hot(5)[None, :]])
    for seed in range(200):
        r = verify_speculative_sampling(draft, rows, target, np.random.default_rng(seed))
        assert r == VerifyResult(num_accepted=3, next_token=5, is_bonus=True)
    # Bonus really comes from row K (not row K-1 or row 0): make row K two-valued.
    target[3] = np.array([0.0, 0.0, 0.5, 0.0, 0.0, 0.5])
    seen = {verify_speculative_sampling(draft, rows, target, np.random.default_rng(s)).next_token for s in range(100)}
    assert seen == {2, 5}


def test_target_over_draft_ratio_above_one_always_accepts():
    # target(x) > draft(x): min(1, ratio) = 1.
    target = np.array([[0.9, 0.1, 0, 0, 0, 0], [0, 0, 0, 1.0, 0, 0]])
    draft_probs = np.array([[0.3, 0.7, 0, 0, 0, 0]])
    for seed in range(200):
        r = verify_speculative_sampling([0], draft_probs, target, np.random.default_rng(seed))
        assert r == VerifyResult(num_accepted=1, next_token=3, is_bonus=True)


def test_middle_rejected():
    draft = [1, 2, 3]
    target = np.stack([one_hot(1), np.array([0.0, 0.0, 0.0, 0.0, 1.0, 0.0]), one_hot(3), one_hot(0)])
    draft_probs = np.stack([one_hot(1), np.array([0.0, 0.0, 1.0, 0, 0, 0]), one_hot(3)])
    for dp in (None, draft_probs):
        for seed in range(100):
            r = verify_speculative_sampling(draft, dp, target, np.random.default_rng(seed))
            assert r == VerifyResult(num_accepted=1, next_token=4, is_bonus=False)
            assert committed_tokens(draft, r) == [1, 4]


def test_same_seed_same_result():
    rng = np.random.default_rng(3)
    target = rng.dirichlet(np.ones(V), size=4)
    draft_probs = rng.dirichlet(np.ones(V), size=3)
    draft = [0, 1, 2]
    a = [verify_speculative_sampling(draft, draft_probs, target, np.random.default_rng(s)) for s in range(50)]
    b = [verify_speculative_sampling(draft, draft_probs, target, np.random.default_rng(s)) for s in range(50)]
    assert a == b
    assert len({(r.num_accepted, r.next_token) for r in a}) > 1


@pytest.mark.parametrize(
    "k, draft_probs_shape, target_shape",
    [
        (2, None, (2, V)),  # target needs K+1 rows
        (2, None, (4, V)),
        (0, None, (2, V)),
        (2, None, (3 * V,)),  # 1-D target
        (2, (3, V), (3, V)),  # draft needs K rows
        (2, (2, V + 1), (3, V)),  # vocabulary mismatch
        (2, (2 * V,), (3, V)),  # 1-D draft
        (0, (1, V), (1, V)),
    ],
)
def test_speculative_shape_errors(k, draft_probs_shape, target_shape):
    draft = list(range(k))
    target = np.full(target_shape, 1.0 / V)
    draft_probs = None if draft_probs_shape is None else np.full(draft_probs_shape, 1.0 / V)
    with pytest.raises(ValueError):
        verify_speculative_sampling(draft, draft_probs, target, np.random.default_rng(0))


def test_sample_token_unnormalised_and_zero_mass():
    rng = np.random.default_rng(0)
    probs = np.array([0.0, 3.0, 0.0, 1.0, 0.0])
    draws = [sample_token(probs, rng) for _ in range(4000)]
    assert set(draws) == {1, 3}
    assert 2800 < draws.count(1) < 3200
    # Trailing zero-probability tokens are never returned, even at the top of the range.
    assert sample_token(np.array([1.0, 0.0, 0.0]), rng) == 0
    with pytest.raises(ValueError):
        sample_token(np.zeros(4), rng)


# ---------------------------------------------------------------------------------------
# Statistical losslessness
# ---------------------------------------------------------------------------------------
#
# Design (exact expected distribution):
#
# Target and draft are first-order Markov "models" over a vocabulary of V tokens: a
# distribution for the first token after the prompt, and one distribution per previous
# token. They are stored as tables of V+1 rows: row 0 = after the prompt, row a+1 = after
# token a. A model's next-token distribution depends only on the last token, so a
# verified position's row is fixed by the token before it.
#
# Each trial generates the first T = K+1 = 3 tokens of a sequence by repeated
# speculative steps, as the decoding loop would: at each step, from the last committed
# token c (or the prompt), draw K = 2 drafts autoregressively from the draft model
# (x0 ~ draft(.|c), x1 ~ draft(.|x0)), build target_probs = [target(.|c), target(.|x0),
# target(.|x1)] and draft_probs = [draft(.|c), draft(.|x0)], call the real
# verify_speculative_sampling and append committed_tokens(...). Steps repeat until three
# tokens are committed (one step if both drafts are accepted: the third token is then the
# bonus token; otherwise two or three steps). Only the first three tokens are recorded.
#
# If the rule is lossless, the committed sequence is distributed as sampling the target
# autoregressively (Leviathan et al. 2023, Theorem 1), so exactly
#     P(t0, t1, t2) = target(t0|prompt) * target(t1|t0) * target(t2|t1).
# Three tokens is K+1, so the histograms cover every path of the rule: acceptance,
# recovery at position 0 and 1, and the bonus token. We chi-square the marginals of t0,
# t1 and t2 and the full joint (V**3 cells); any committed outcome of target probability
# 0 is impossible under the hypothesis and scores p = 0.
#
# Drafts are pre-drawn (vectorised) from a separate generator, for every trial, step and
# possible context, so that the draft draws are independent of the rule's uniforms; the
# loop then picks the pair for the actual context. The rule under test gets its own
# seeded generator.

K = 2
T = K + 1
N_TRIALS = 100_000
P_PASS = 1e-3
P_FAIL = 1e-6


def _draw_from_rows(table: np.ndarray, rows: np.ndarray, u: np.ndarray) -> np.ndarray:
    """One draw per entry of rows (row indices into table: [R, V]) using uniforms u (same shape)."""
    cdf = np.cumsum(table, axis=1)
    out = np.empty(rows.shape, dtype=np.int64)
    for r in np.unique(rows):
        m = rows == r
        idx = np.searchsorted(cdf[r], u[m] * cdf[r, -1], side="right")
        out[m] = np.minimum(idx, table.shape[1] - 1)
    return out


def _predraw_drafts(draft_table: np.ndarray, n: int, rng: np.random.Generator, mode: str):
    """Draft pairs for every (step, trial, context): two arrays [T, n, V+1] of token ids.

    mode "probs" / "onehot_drawn": drawn from the draft model;
    "onehot_argmax": the draft model's argmax (a deterministic drafter).
    """
    v = draft_table.shape[1]
    ctx = np.broadcast_to(np.arange(v + 1), (T, n, v + 1))
    if mode == "onehot_argmax":
        best = np.argmax(draft_table, axis=1)  # [V+1]
        x0 = best[ctx]
        x1 = best[x0 + 1]
        return x0, x1
    x0 = _draw_from_rows(draft_table, ctx, rng.random(ctx.shape))
    x1 = _draw_from_rows(draft_table, x0 + 1, rng.random(ctx.shape))
    assert (draft_table[ctx, x0] > 0).all() and (draft_table[x0 + 1, x1] > 0).all()
    return x0, x1


def run_harness(rule, target_table, draft_table, mode="probs", n=N_TRIALS, seed=0):
    """Returns an int array [n, T] of the first T committed tokens of each trial."""
    v = target_table.shape[1]
    assert target_table.shape == (v + 1, v) and draft_table.shape == (v + 1, v)
    x0s, x1s = _predraw_drafts(draft_table, n, np.random.default_rng(seed + 1_000_003), mode)
    rng = np.random.default_rng(seed)
    out = np.empty((n, T), dtype=np.int64)
    pass_probs = mode == "probs"
    for trial in range(n):
        seq: list[int] = []
        step = 0
        while len(seq) < T:
            c = 0 if not seq else seq[-1] + 1
            x0 = int(x0s[step, trial, c])
            x1 = int(x1s[step, trial, c])
            draft = [x0, x1]
            rows = [c, x0 + 1, x1 + 1]
            target_probs = target_table[rows]
            draft_probs = draft_table[rows[:K]] if pass_probs else None
            result = rule(draft, draft_probs, target_probs, rng)
            seq.extend(committed_tokens(draft, result))
            step += 1
        out[trial] = seq[:T]
    return out


def expected_joint(target_table: np.ndarray) -> np.ndarray:
    """P(t0, t1, t2) under autoregressive sampling of the target: [V, V, V]."""
    p0 = target_table[0]
    trans = target_table[1:]  # trans[a, b] = target(b | a)
    return p0[:, None, None] * trans[:, :, None] * trans[None, :, :]


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    counts = counts.ravel().astype(np.float64)
    probs = probs.ravel()
    support = probs > 0
    if counts[~support].sum() > 0:
        # An outcome of target probability 0 was committed: impossible under the
        # hypothesis (chisquare cannot score such cells), so reject outright.
        return 0.0
    n = counts.sum()
    f_exp = probs[support] / probs[support].sum() * n
    assert f_exp.min() >= 5, "test design: expected counts too small for chi-square"
    return float(chisquare(counts[support], f_exp).pvalue)


def pvalues(samples: np.ndarray, target_table: np.ndarray) -> dict[str, float]:
    v = target_table.shape[1]
    joint = expected_joint(target_table)
    counts = np.zeros((v, v, v), dtype=np.int64)
    np.add.at(counts, (samples[:, 0], samples[:, 1], samples[:, 2]), 1)
    return {
        "t0": _chi2_pvalue(counts.sum(axis=(1, 2)), joint.sum(axis=(1, 2))),
        "t1": _chi2_pvalue(counts.sum(axis=(0, 2)), joint.sum(axis=(0, 2))),
        "t2": _chi2_pvalue(counts.sum(axis=(0, 1)), joint.sum(axis=(0, 1))),
        "joint": _chi2_pvalue(counts, joint),
    }


def _smooth_random_table(rng: np.random.Generator, v: int) -> np.ndarray:
    """V+1 random distributions bounded below by 0.4/V (keeps chi-square cells large)."""
    return 0.6 * rng.dirichlet(np.ones(v), size=v + 1) + 0.4 / v


def _case_random(seed: int):
    rng = np.random.default_rng(seed)
    v = 6
    return _smooth_random_table(rng, v), _smooth_random_table(rng, v)


def _case_disjoint(seed: int):
    # Target support {3..6}, draft support {0, 1, 2}: every draft is rejected at position 0
    # and every token comes from the residual (= the target itself here).
    rng = np.random.default_rng(seed)
    v = 7
    target = np.zeros((v + 1, v))
    target[:, 3:] = 0.6 * rng.dirichlet(np.ones(4), size=v + 1) + 0.1
    draft = np.zeros((v + 1, v))
    draft[:, :3] = rng.dirichlet(np.ones(3), size=v + 1)
    return target, draft


def _case_shaped(seed: int):
    # Both models shaped by the same Sampler (temperature 0.7, top-k 3, top-p 0.9) from
    # independent random logits; expected = the shaped target.
    rng = np.random.default_rng(seed)
    v = 8
    sampler = Sampler(SamplingParams(temperature=0.7, top_k=3, top_p=0.9, seed=seed))
    target = np.stack([sampler.shape(rng.normal(0.0, 1.0, v)) for _ in range(v + 1)])
    draft = np.stack([sampler.shape(rng.normal(0.0, 1.0, v)) for _ in range(v + 1)])
    assert ((target > 0).sum(axis=1) <= 3).all() and ((target > 0).sum(axis=1) >= 1).all()
    assert np.allclose(target.sum(axis=1), 1.0) and np.allclose(draft.sum(axis=1), 1.0)
    return target, draft


def _case_shaped_overlapping(seed: int):
    # Shaped as above but draft logits are a perturbation of the target's, so supports
    # overlap partially and acceptance happens at a realistic rate.
    rng = np.random.default_rng(seed)
    v = 8
    sampler = Sampler(SamplingParams(temperature=0.7, top_k=3, top_p=0.9, seed=seed))
    logits = rng.normal(0.0, 1.0, (v + 1, v))
    target = np.stack([sampler.shape(z) for z in logits])
    draft = np.stack([sampler.shape(z + rng.normal(0.0, 0.7, v)) for z in logits])
    return target, draft


def _case_draft_equals_target(seed: int):
    rng = np.random.default_rng(seed)
    table = _smooth_random_table(rng, 5)
    return table, table.copy()


@pytest.mark.parametrize(
    "case, mode",
    [
        (_case_random, "probs"),
        (_case_random, "onehot_drawn"),  # drafts drawn, but draft_probs=None (one-hot)
        (_case_random, "onehot_argmax"),  # deterministic drafter, draft_probs=None
        (_case_disjoint, "probs"),
        (_case_disjoint, "onehot_drawn"),
        (_case_shaped, "probs"),
        (_case_shaped_overlapping, "probs"),
        (_case_draft_equals_target, "probs"),
    ],
)
def test_speculative_sampling_is_lossless(case, mode):
    target, draft = case(seed=12345)
    samples = run_harness(verify_speculative_sampling, target, draft, mode=mode, seed=2024)
    ps = pvalues(samples, target)
    assert min(ps.values()) > P_PASS, ps


def test_harness_exercises_every_path():
    # Sanity of the design: in the random case all three outcomes occur often, so the
    # histograms above really cover acceptance, recovery and bonus tokens.
    target, draft = _case_random(seed=12345)
    x0s, x1s = _predraw_drafts(draft, 20_000, np.random.default_rng(5), "probs")
    rng = np.random.default_rng(6)
    accepted = np.zeros(K + 1, dtype=np.int64)
    for trial in range(20_000):
        x0, x1 = int(x0s[0, trial, 0]), int(x1s[0, trial, 0])
        r = verify_speculative_sampling([x0, x1], draft[[0, x0 + 1]], target[[0, x0 + 1, x1 + 1]], rng)
        accepted[r.num_accepted] += 1
    assert (accepted > 2_000).all(), accepted


# Deliberately wrong rules (same signature as verify_speculative_sampling).


def _accept_always(draft_ids, draft_probs, target_probs, rng):
    k = len(draft_ids)
    return VerifyResult(k, sample_token(target_probs[k], rng), True)


def _accept_iff_target_argmax(draft_ids, draft_probs, target_probs, rng):
    # Exact-match acceptance at temperature > 0, then sample the target on mismatch.
    for i, x in enumerate(draft_ids):
        if int(x) != int(np.argmax(target_probs[i])):
            return VerifyResult(i, sample_token(target_probs[i], rng), False)
    k = len(draft_ids)
    return VerifyResult(k, sample_token(target_probs[k], rng), True)


def _recover_from_target_not_residual(draft_ids, draft_probs, target_probs, rng):
    # Correct acceptance test, but the recovered token is drawn from the target instead of
    # normalize(max(0, target - draft)): a classic subtle bug.
    for i, x in enumerate(draft_ids):
        x = int(x)
        q = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if not (q > 0 and rng.random() < min(1.0, float(target_probs[i, x]) / q)):
            return VerifyResult(i, sample_token(target_probs[i], rng), False)
    k = len(draft_ids)
    return VerifyResult(k, sample_token(target_probs[k], rng), True)


def _bonus_from_wrong_row(draft_ids, draft_probs, target_probs, rng):
    # Correct except that the bonus token is sampled from row K-1 instead of row K; only
    # the third committed token can show it.
    r = verify_speculative_sampling(draft_ids, draft_probs, target_probs, rng)
    if r.is_bonus and len(draft_ids) > 0:
        return VerifyResult(r.num_accepted, sample_token(target_probs[len(draft_ids) - 1], rng), True)
    return r


@pytest.mark.parametrize(
    "rule, case, mode",
    [
        (_accept_always, _case_random, "probs"),
        (_accept_iff_target_argmax, _case_random, "probs"),
        (_recover_from_target_not_residual, _case_random, "probs"),
        (_recover_from_target_not_residual, _case_random, "onehot_drawn"),
        (_bonus_from_wrong_row, _case_random, "probs"),
        (_bonus_from_wrong_row, _case_shaped_overlapping, "probs"),
    ],
)
def test_wrong_rule_fails_chi_square(rule, case, mode):
    target, draft = case(seed=12345)
    samples = run_harness(rule, target, draft, mode=mode, seed=2024)
    ps = pvalues(samples, target)
    assert min(ps.values()) < P_FAIL, ps
