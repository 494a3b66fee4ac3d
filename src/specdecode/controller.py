"""Cost-aware speculation: choose the drafter and K each step from measured costs.

Each step the controller picks, among its drafters and plain decoding (K = 0), the
option that maximizes the expected committed tokens per second,
E(alpha, K) / (K * T_draft + T_target(K + 1))  (Leviathan et al. 2023, Eq. 1 and Sec. 3.4),
with T_target the measured verification latency curve, T_draft the drafter's measured
cost per token, and alpha each drafter's acceptance estimated online. A draft model also
stops drafting early when its own confidence says the next token no longer pays (as
llama.cpp's --draft-p-min does, but with the threshold derived from the costs).

The controller is itself a drafter (same protocol), so the engine is unchanged: the
engine's K is the cap, the controller's proposal length is the K chosen.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from .costmodel import CostCurve, expected_tokens
from .drafters import Draft, Drafter, ModelDrafter
from .sampling import Sampler


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


@dataclass
class Source:
    """One drafter the controller may use, with its cost per drafted token (seconds)."""

    drafter: Drafter
    draft_cost: float
    estimator: AcceptanceEstimator = field(default_factory=AcceptanceEstimator)

    @property
    def name(self) -> str:
        return self.drafter.name


class SpeculationController:
    """Chooses drafter and K per step; implements the Drafter protocol.

    sources: drafters with their measured cost per token (seconds). target_cost: T(n) of
    the target, measured for n = 1 .. kmax + 1. kmax: the largest K considered.
    probe_every: after this many plain steps in a row, one short speculative step
    refreshes the acceptance estimates (otherwise a K = 0 decision could never be undone).
    """

    name = "auto"

    def __init__(self, sources: Sequence[Source], target_cost: CostCurve, kmax: int = 8, probe_every: int = 16):
        if not sources:
            raise ValueError("the controller needs at least one drafter")
        self.sources = list(sources)
        self.target_cost = target_cost
        self.kmax = kmax
        self.probe_every = probe_every
        self._last: Source | None = None
        self._last_k = 0
        self._plain_streak = 0
        self.choices: Counter = Counter()  # (drafter name or "none") -> steps

    def start(self, prompt_ids: Sequence[int], sampler: Sampler) -> None:
        for s in self.sources:
            s.drafter.start(prompt_ids, sampler)
        self._plain_streak = 0

    def finish(self, committed: Sequence[int]) -> None:
        for s in self.sources:
            s.drafter.finish(committed)

    def plan(self, source: Source, cap: int) -> tuple[int, float]:
        """Best K (0..cap) for this source and its expected rate (tokens per second)."""
        T = self.target_cost
        alpha = source.estimator.alpha
        best_k, best_rate = 0, 1.0 / T(1)
        for k in range(1, min(cap, self.kmax) + 1):
            rate = expected_tokens(alpha, k) / (k * source.draft_cost + T(k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Try the drafters whose best K beats plain decoding, best expected rate first; the
        first non-empty draft wins (an n-gram drafter without a match gives none). k is the
        cap that the engine allows this step."""
        self._last, self._last_k = None, 0
        probing = self._plain_streak >= self.probe_every
        plans = []
        for s in self.sources:
            kk, rate = self.plan(s, k) if k > 0 else (0, 0.0)
            if probing and kk == 0 and k > 0:
                kk = min(2, k)
            if kk > 0:
                plans.append((rate, s, kk))
        for _, s, kk in sorted(plans, key=lambda p: -p[0]):
            if isinstance(s.drafter, ModelDrafter):
                s.drafter.keep_drafting = self._continuation_rule(s)
            draft = s.drafter.propose(context, kk)
            if draft.token_ids:
                self._last, self._last_k = s, len(draft.token_ids)
                self._plain_streak = 0
                self.choices[s.name] += 1
                return draft
        self._plain_streak += 1
        self.choices["none"] += 1
        return Draft([])

    def _continuation_rule(self, source: Source):
        """Draft token i+1 only while its chance of being accepted (the product of the draft
        model's own top probabilities so far) times the time one plain step takes exceeds
        what drafting it and verifying one more position cost."""
        T = self.target_cost

        def keep(i: int, p_cum: float) -> bool:
            marginal = source.draft_cost + T(i + 2) - T(i + 1)
            return p_cum * T(1) >= marginal

        return keep

    def observe(self, num_accepted: int) -> None:
        if self._last is not None:
            self._last.estimator.update(self._last_k, num_accepted)
            self._last.drafter.observe(num_accepted)

