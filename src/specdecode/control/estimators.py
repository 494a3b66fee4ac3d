"""Acceptance estimates of the cost-aware controller: per drafter, and per kind of
prompt-lookup match (Leviathan et al. 2023, Eq. 1: E = (1 - alpha^(K+1)) / (1 - alpha), and
its positional form)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .costmodel import expected_tokens, expected_tokens_positional, expected_tokens_upto

# Prompt lookup: acceptance is estimated separately for each kind of match (see
# NgramDrafter.lookup): its band of match length (the number of context tokens the reused
# occurrence agrees with), and whether the matched n-gram was always followed by the same
# token (unique) or not. Band lower bounds, and each kind's prior (first-token acceptance,
# acceptance of each further token once the one before was accepted), measured with the
# 1.5B target on the built-in suite's prompts 4-8 of each category (the benchmark runs
# prompts 1-3): a longer or unambiguous match is likelier a copy, and a copy that has
# started tends to go on.
MATCH_BANDS = (1, 2, 3, 5, 9, 17)
MATCH_PRIORS = {
    False: ((0.14, 0.54), (0.17, 0.50), (0.26, 0.80), (0.44, 0.90), (0.75, 0.95), (0.96, 0.97)),  # ambiguous
    True: ((0.46, 0.58), (0.60, 0.69), (0.65, 0.80), (0.85, 0.87), (0.90, 0.95), (0.98, 0.97)),  # unique
}


def match_band(match_len: int) -> int:
    """Index of the MATCH_BANDS band holding match_len (>= 1)."""
    band = 0
    for i, lo in enumerate(MATCH_BANDS):
        if match_len >= lo:
            band = i
    return band


@dataclass
class AcceptanceEstimator:
    """Per-token acceptance alpha of one drafter, from observed steps.

    A step that drafted k tokens and accepted n adds n accepted tokens and, when n < k,
    one rejection: alpha = accepted / (accepted + rejections) is the maximum-likelihood
    estimate under the geometric model behind Eq. 1. Old steps decay by ``decay`` per
    step so that alpha follows the text; the prior counts as ``prior_weight`` tokens.
    """

    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.9
    accepted: float = field(init=False)
    rejected: float = field(init=False)

    def __post_init__(self) -> None:
        self.accepted = self.prior_alpha * self.prior_weight
        self.rejected = (1.0 - self.prior_alpha) * self.prior_weight

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, k: int, n: int) -> None:
        if k <= 0:
            return
        self.accepted = self.decay * self.accepted + n
        self.rejected = self.decay * self.rejected + (1.0 if n < k else 0.0)

    def relax(self) -> None:
        """One step without evidence: old observations fade toward the prior (by ``decay``),
        so that a drafter silenced by a few early rejections is tried again once its prior
        would pay, instead of waiting for a probe."""
        self.fade(self.decay)

    def fade(self, keep: float) -> None:
        """Keep this share (0..1) of the evidence; the rest returns to the prior."""
        self.accepted = keep * self.accepted + (1.0 - keep) * self.prior_alpha * self.prior_weight
        self.rejected = keep * self.rejected + (1.0 - keep) * (1.0 - self.prior_alpha) * self.prior_weight

    def expected(self, k: int) -> float:
        """Expected tokens committed by a step that drafts k (Eq. 1 at this alpha)."""
        return expected_tokens(self.alpha, k)

    def expected_upto(self, kmax: int) -> np.ndarray:
        """[kmax + 1] expected tokens of a step drafting k = 0..kmax."""
        return expected_tokens_upto(self.alpha, kmax)


@dataclass
class TwoRateEstimator:
    """Acceptance of the first drafted token (first) and of each later one given that the
    one before it was accepted (then): E = 1 + a1 (1 + a + ... + a^(k-1)), the positional
    form of Eq. 1 (expected_tokens_positional). For drafts whose first token is the
    uncertain one: a prompt-lookup copy that starts right tends to stay right."""

    prior_first: float
    prior_then: float
    prior_weight: float = 2.0
    decay: float = 0.9
    first: AcceptanceEstimator = field(init=False)
    then: AcceptanceEstimator = field(init=False)

    def __post_init__(self) -> None:
        self.first = AcceptanceEstimator(self.prior_first, self.prior_weight, self.decay)
        self.then = AcceptanceEstimator(self.prior_then, self.prior_weight, self.decay)

    @property
    def alpha(self) -> float:
        return self.first.alpha

    def update(self, k: int, n: int) -> None:
        if k <= 0:
            return
        self.first.update(1, min(n, 1))
        if n >= 1:
            self.then.update(k - 1, n - 1)

    def fade(self, keep: float) -> None:
        """Keep this share (0..1) of both rates' evidence; the rest returns to the priors."""
        self.first.fade(keep)
        self.then.fade(keep)

    def relax(self) -> None:
        """One step without evidence: both rates fade toward their priors by ``decay``
        (:meth:`AcceptanceEstimator.relax`)."""
        self.fade(self.decay)

    def fresh(self) -> "TwoRateEstimator":
        """A new estimator with this one's priors (what this kind of draft is worth before
        any observation)."""
        return TwoRateEstimator(self.prior_first, self.prior_then, self.prior_weight, self.decay)

    def expected(self, k: int) -> float:
        """Expected tokens committed by a step that drafts k."""
        return expected_tokens_positional([self.first.alpha] + [self.then.alpha] * (k - 1))

    def expected_upto(self, kmax: int) -> np.ndarray:
        """[kmax + 1] expected tokens of a step drafting k = 0..kmax:
        1 + a1 (1 - a^k) / (1 - a)."""
        a1, a = self.first.alpha, self.then.alpha
        k = np.arange(kmax + 1, dtype=np.float64)
        geometric = k if a >= 1.0 else (1.0 - a ** k) / (1.0 - a)
        return 1.0 + a1 * geometric


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return float(np.log(p / (1 - p)))


@dataclass
class StepFeatures:
    """What is known before a lookup drafter's step, for :class:`LogisticAcceptance`.

    match_len: tokens the matched occurrence agrees with the context. unique: the matched
    n-gram was always followed by the same token. prev_full: this drafter's previous draft
    was accepted whole. run: drafted tokens accepted in a row up to now (the position inside
    a copied span). confidence: the target's top-1 probability at the last verified
    position (near 1 through a copy; 0.5 when unknown).
    """

    match_len: int = 0
    unique: bool = False
    prev_full: bool = False
    run: int = 0
    confidence: float = 0.5

    def vector(self, k: int) -> np.ndarray:
        """[k, 7] features of drafted positions j = 1..k (centred, scaled to about [-1, 1])."""
        j = np.arange(k, dtype=np.float64)
        base = [np.log1p(self.match_len) / 3 - 0.5, float(self.unique) - 0.5, float(self.prev_full) - 0.5,
                np.log1p(self.run) / 4 - 0.5, 2 * self.confidence - 1]
        cols = [np.full(k, v) for v in base]
        cols.append(np.log1p(j) / 3)  # position in the draft
        cols.append((2 * self.confidence - 1) * (j == 0))  # confidence speaks mostly for the first token
        return np.stack(cols, axis=1)


class LogisticAcceptance:
    """Acceptance of each drafted token given the step's features: logistic regression
    fitted online (stochastic gradient on the log-loss) on top of an offset, the logit of
    the match kind's :class:`TwoRateEstimator` rate (first token, later tokens). With zero
    weights it predicts exactly what the rate estimator does; the weights learn how much
    the features move it (Leviathan et al. 2023's alpha, made conditional).

    Observations: a step that drafted k tokens and accepted n gives label 1 for positions
    1..n and 0 for position n+1 (when n < k); later positions are not observed.
    lr: learning rate. l2: weight decay per update.
    """

    DIM = 7

    def __init__(self, lr: float = 0.1, l2: float = 1e-3) -> None:
        self.w = np.zeros(self.DIM)
        self.lr = lr
        self.l2 = l2
        self.updates = 0

    @staticmethod
    def _offsets(rates: TwoRateEstimator, k: int) -> np.ndarray:
        return np.array([_logit(rates.first.alpha)] + [_logit(rates.then.alpha)] * (k - 1))

    def probabilities(self, rates: TwoRateEstimator, f: StepFeatures, k: int) -> np.ndarray:
        """[k] P(token j accepted | tokens before it accepted), j = 1..k."""
        if k <= 0:
            return np.zeros(0)
        return _sigmoid(self._offsets(rates, k) + f.vector(k) @ self.w)

    def expected_upto(self, rates: TwoRateEstimator, f: StepFeatures, kmax: int) -> np.ndarray:
        """[kmax + 1] expected committed tokens of a step drafting k = 0..kmax:
        1 + sum_{k'<=k} prod_{j<=k'} p_j."""
        p = self.probabilities(rates, f, kmax)
        return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(p))])

    def update(self, rates: TwoRateEstimator, f: StepFeatures, k: int, n: int) -> None:
        m = min(n + 1, k)
        if m <= 0:
            return
        x = f.vector(k)[:m]
        y = (np.arange(m) < n).astype(np.float64)
        p = _sigmoid(self._offsets(rates, k)[:m] + x @ self.w)
        self.w += self.lr * ((y - p) @ x / m - self.l2 * self.w)
        self.updates += 1


@dataclass
class FeatureEstimator:
    """The estimate the controller plans a lookup step with: a match kind's rates and the
    drafter's :class:`LogisticAcceptance` model, at this step's features. Same interface as
    :class:`TwoRateEstimator` (alpha, expected, expected_upto, update, fresh)."""

    rates: TwoRateEstimator
    model: LogisticAcceptance
    features: StepFeatures

    @property
    def alpha(self) -> float:
        return float(self.model.probabilities(self.rates, self.features, 1)[0])

    def expected(self, k: int) -> float:
        return float(self.expected_upto(k)[k])

    def expected_upto(self, kmax: int) -> np.ndarray:
        return self.model.expected_upto(self.rates, self.features, kmax)

    def update(self, k: int, n: int) -> None:
        if k <= 0:
            return
        self.model.update(self.rates, self.features, k, n)  # before the rates move: the offset it predicted with
        self.rates.update(k, n)

    def fresh(self) -> TwoRateEstimator:
        return self.rates.fresh()
