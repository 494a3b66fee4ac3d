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

In a batched step (continuous batching) the forward is shared, and K is chosen for the
whole batch: each generation's controller offers E(alpha, K) for K = 0..cap of its best
drafter (:meth:`SpeculationController.offer`), and the engine's planner
(:func:`specdecode.control.costmodel.allocate_drafts`) picks every generation's K together to
maximize the step's expected tokens per second, sum E_i(K_i) / (T_target(sum (1 + K_i)) +
sum K_i T_draft,i), then hands each its quota (:meth:`set_quota`). Acceptance estimates
stay per generation (each has its own forked controller); the measured curve and its
corrections are shared.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Sequence

import numpy as np

from ..backends.base import Backend
from .costmodel import CostCurve, ObservedCurve, choose_k, expected_tokens_upto
from ..drafters.base import (Draft, Drafter, DraftingRequest, HiddenStateDrafter, IncrementalDrafter,
                             StepOutcome)
from .guard import SpeedGuard
from .estimators import AcceptanceEstimator, FeatureEstimator, StepFeatures, TwoRateEstimator
from .sources import Plan, SharedCosts, Source, SourceSet
from .tree_plan import shape_tree, tree_depth
from .planner import DraftOffer, PlannedDrafter
from .report import GenerationBooks
from ..limits import AUTO_KMAX, CATCH_UP_HORIZON, CONFIRM_BLOCK, NEW_TEXT_KEEP
from ..sampling import Sampler


class SpeculationController(PlannedDrafter):
    """Chooses drafter and K per step; implements the Drafter protocol.

    sources: drafters with their measured cost per token (seconds). target_cost: T(n) of
    the target, measured for n = 1 .. kmax + 1. kmax: the largest K considered.
    learn_costs: follow the observed verification times (:class:`ObservedCurve`) instead
    of keeping the measured curve as it is; on_drift(why, live_curve) is called once when
    they contradict the measurement (overall, or at an observed size; the caller rewrites the
    cached curve with the live one, or, where live_curve is None because the steps observed too
    few sizes to say what the others cost (:meth:`ObservedCurve.grounded`), marks it stale).
    guard: the :class:`SpeedGuard` that stops drafting while speculation runs slower than
    plain decoding in this generation (a new one by default;
    it judges only steps this generation verified alone).
    probe_every: after this many plain steps in a row, one short speculative step
    refreshes a drafter's acceptance estimate (otherwise a K = 0 decision could never be
    undone). A probe that fails doubles that drafter's gap (up to max_probe_gap): probing a
    draft model costs its catch-up over the skipped tokens plus a wider verification, which
    on a compute-bound CPU is a measurable loss when drafts keep failing.
    explore_every: after this many plain steps in a row (and the probe gap), a lookup drafter
    with a match probes even when the curve says no draft could pay: a curve that is too
    steep (measured or cached under load) would otherwise never be observed, so never
    corrected. A lookup's probe costs one block of 3 tokens.

    A controller with a source that is a :class:`HiddenStateDrafter` (draft heads) is one
    itself (constructing one gives a :class:`HiddenStateController`), so that the engine
    asks the target for hidden states for its generation and hands them over.
    """

    name = "auto"

    def __new__(cls, sources: Sequence[Source] = (), *args, **kwargs):
        if cls is SpeculationController and any(isinstance(s.drafter, HiddenStateDrafter) for s in sources):
            cls = HiddenStateController
        return super().__new__(cls)

    # Observed verification times this far from the measured curve (ratio), after
    # DRIFT_MIN_SAMPLES steps, mean the measurement no longer describes the machine.
    DRIFT_BOUNDS = (0.67, 1.5)
    DRIFT_MIN_SAMPLES = 16

    def __init__(self, sources: Sequence[Source], target_cost: CostCurve, kmax: int = AUTO_KMAX,
                 probe_every: int = 16, max_probe_gap: int = 256, learn_costs: bool = False,
                 on_drift: Callable[[str, CostCurve], None] | None = None, shared: SharedCosts | None = None,
                 guard: SpeedGuard | None = None, explore_every: int = 64):
        if not sources:
            raise ValueError("the controller needs at least one drafter")
        self.sources = list(sources)
        self.kmax = kmax
        self._costs = shared or SharedCosts(ObservedCurve(target_cost) if learn_costs else target_cost, kmax + 1,
                                            on_drift)
        self._base_cost = target_cost
        self._quota: int | None = None  # the batch planner's K for the next proposal
        self._offered: Plan | None = None  # the plan of the last offer
        self.probe_every = probe_every
        self.max_probe_gap = max_probe_gap
        self.explore_every = explore_every
        for s in self.sources:
            s.probe_gap = probe_every
            if isinstance(s.drafter, IncrementalDrafter):
                s.drafter.set_continuation_rule(s.continuation_rule(lambda: self._T))
        self._last: Source | None = None
        self._last_est: AcceptanceEstimator | FeatureEstimator | TwoRateEstimator | None = None
        self._last_k, self._last_probe, self._last_rows = 0, False, 1  # K: a tree's first path
        self._plain_streak = 0
        self._prev_source: Source | None = None  # who drafted the last step, and whether all was accepted
        self._prev_full = False
        self._run = 0  # drafted tokens accepted in a row
        self._confidence = 0.5  # the target's top-1 probability at the last verified position
        self.choices: Counter = Counter()  # (drafter name or "none") -> steps, over all generations
        self.books = GenerationBooks()  # this generation's, for explain()
        self.guard = guard or SpeedGuard()
        self.measurement_note = ""  # how the cost curve was measured, when it is worth saying
        self.choice = SourceSet(self.sources)  # which sources this generation may draft with
        self._tree_expected: float | None = None  # the last tree's summed node probabilities
        # whether propose() ran this step, its seconds, its own verification, the tokens before it (T(n, c) read at)
        self._proposed, self._draft_s, self._own_verify, self._context_len, self._wasted = False, 0.0, None, 0, False

    last_source = property(lambda self: self._last.name if self._last is not None else None,
                           doc="The name of the source whose draft the last proposal returned (None: none).")

    @property
    def target_cost(self) -> CostCurve | ObservedCurve:
        """T(n) as planned with (shared by every fork)."""
        return self._costs.curve

    @property
    def _T(self) -> np.ndarray:
        """T(n) for n = 0..kmax+1 at least (a batched plan reads further), at this generation's context."""
        return self._costs.table_at(self._context_len)

    def fork(self, seq: int) -> "SpeculationController":
        """A controller for another concurrent generation: its drafters forked onto sequence
        seq, the same measured costs (the target's curve and each drafter's cost per token
        to start from), its own acceptance estimates (from the priors)."""
        sources = [Source(s.drafter.fork(seq), s.draft_cost, prefill_cost=s.prefill_cost, step_cost=s.step_cost)
                   for s in self.sources]
        return SpeculationController(sources, self._base_cost, kmax=self.kmax, probe_every=self.probe_every,
                                     max_probe_gap=self.max_probe_gap, shared=self._costs,
                                     explore_every=self.explore_every)

    def start(self, prompt_ids: Sequence[int], sampler: Sampler) -> None:
        """A new generation is a new text: what failed in earlier ones must not silence a
        drafter here. Probe gaps start again at probe_every, and each match kind's estimates
        keep NEW_TEXT_KEEP of their evidence (the rest returns to the measured priors). A long
        run of texts where lookups fail (translation, chat) otherwise leaves the later ones that
        repeat earlier answers undrafted: measured on the suite, `repeat` drafted nothing."""
        self.choice.restrict(None)
        for s in self.sources:
            s.drafter.start(prompt_ids, sampler)
            s.follow_priors()
            s.probe_gap = self.probe_every
            for rates in (s.bands or {}).values():
                rates.fade(NEW_TEXT_KEEP)
        self._plain_streak = 0
        self.books.clear()
        self.guard.reset()

    def configure(self, request: DraftingRequest) -> None:
        """This generation's choice and request-fed inputs (after :meth:`start`): :meth:`SourceSet.configure`."""
        self.choice.configure(request)

    def names(self) -> list[str]:
        return self.choice.names()

    def members(self) -> list[Drafter]:
        return [s.drafter for s in self.sources]

    def input_counts(self) -> tuple[int, int] | None:
        return self.choice.input_counts()

    def explain(self) -> str:
        """What each drafter did in the last generation, and why an unused one was not used
        (:meth:`GenerationBooks.explain`)."""
        return self.books.explain(self.sources, self.choice, self._T[1],
                                  lambda s: self.plan(s, self.kmax, alpha=1.0)[0] > 0,
                                  [self.guard.explain(), self.measurement_note])

    def finish(self, committed: Sequence[int]) -> None:
        self.set_quota(None)  # a batch's quota is for its step, not for a next generation
        for s in self.sources:
            s.drafter.finish(committed)

    def close(self) -> None:
        for s in self.sources:
            s.drafter.close()

    def draft_backends(self) -> list[Backend]:
        return [b for s in self.sources for b in s.drafter.draft_backends()]

    def plan(self, source: Source, cap: int, extra: float = 0.0, alpha: float | None = None,
             estimator: AcceptanceEstimator | FeatureEstimator | TwoRateEstimator | None = None) -> tuple[int, float]:
        """Best K (0..cap) for this source and its expected rate (tokens per second).

        extra: one-off seconds this step would cost on top (a draft model's catch-up); a
        drafting step also pays the source's ``step_cost``.
        alpha: a per-token acceptance to plan with (Eq. 1); else the estimator's expectation
        (default: the source's overall estimator).
        """
        K = min(cap, self.kmax)
        if K <= 0:
            return 0, 1.0 / self._T[1]
        est = source.estimator if estimator is None else estimator
        E = expected_tokens_upto(alpha, K) if alpha is not None else est.expected_upto(K)  # [K+1]
        return choose_k(E, source.draft_cost, self._T, extra + source.step_cost)

    @property
    def confidence(self) -> float:
        """The target's top-1 probability at the last verified position (a feature of the next
        step's acceptance: near 1 through a copy), computed only when a lookup drafter has a
        match to plan with."""
        if callable(self._confidence):
            self._confidence = float(self._confidence())
        return self._confidence

    def _observe_timing(self, n: int, seconds: float, sample: bool) -> None:
        """A verification of n tokens took ``seconds``: fold it into T(n) (learn_costs) when
        it is a sample of the curve; when it verified only this generation's block, the guard
        judges the step."""
        if sample:
            self._costs.observe(n, seconds, self.DRIFT_BOUNDS, self.DRIFT_MIN_SAMPLES, self._context_len)
        self._own_verify = seconds if n <= (self._last_rows if self._proposed and self._last is not None else 1) else None

    def _catch_up_slowdown(self, pending: int, context_len: int) -> float:
        """What the context a draft model's catch-up of ``pending`` tokens reads at adds to its
        tokens' cost: the target's largest block at the middle of the text to feed over its cost
        at the base context (its context costs: 1.0 where none are known)."""
        if pending <= 0:
            return 1.0
        base = self._T[-1]
        at = self._costs.at(context_len - pending // 2).table[-1]
        return max(1.0, float(at / base)) if base > 0 else 1.0

    def _candidates(self, context: Sequence[int], k: int, probes: bool = True) -> list[Plan]:
        """The plan of each drafter worth trying after context, unsorted: its best K at its
        estimated acceptance, or a probe."""
        self._context_len = len(context)
        plans = []
        for s in self.sources:
            if not self.choice.allows(s):
                continue
            known = lambda s=s: StepFeatures(prev_full=s is self._prev_source and self._prev_full,  # noqa: E731
                                             run=self._run, confidence=self.confidence)
            est, avail = s.estimator_for(context, known) if k > 0 else (None, 0)
            if est is None:
                continue
            self.books.matched[s.name] += 1
            cap = min(k, avail)
            if not (s is self._prev_source and self._prev_full or s.drafter.confirmed):
                cap = min(cap, CONFIRM_BLOCK)
            pending = s.behind(context)
            extra = s.catch_up(pending, self._catch_up_slowdown(pending, len(context)))
            k_best, rate = self.plan(s, cap, extra, estimator=est)
            if s.drafter.tree_nodes > 0:  # a tree: its own plan cuts it (control/tree_plan.py)
                k_best = tree_depth(s.drafter, k_best, cap)
            if k_best == 0 and extra > 0:
                # The catch-up is paid once, not every step: worth it when the time the
                # steady rate saves per token repays it within the horizon.
                k_steady, rate_steady = self.plan(s, cap, 0.0, estimator=est)
                if k_steady > 0 and extra <= CATCH_UP_HORIZON * (self._T[1] - 1.0 / rate_steady):
                    k_best, rate = k_steady, rate_steady
            # Probe only a drafter that could pay at all: with every draft accepted, after
            # its catch-up (on a CPU a draft model that lags the text never does); for a
            # kind of prompt-lookup match, at its prior acceptance.
            probe = False
            if probes and k_best == 0 and self._plain_streak >= s.probe_gap:
                could = (self.plan(s, cap, extra, estimator=est.fresh()) if isinstance(est, FeatureEstimator)
                         else self.plan(s, cap, extra, alpha=1.0))
                probe = could[0] > 0 or (s.bands is not None and self._plain_streak >= max(s.probe_gap,
                                                                                          self.explore_every))
            if probe:
                k_best, rate = min(2, cap), -s.draft_cost  # cheapest probe first
            plans.append(Plan(rate, s, k_best, probe, est, cap))
        return plans

    def offer(self, context: Sequence[int], k: int) -> DraftOffer | None:
        """For a batched step: the expected committed tokens E[0..K] of the drafter that
        would draft here (the best expected rate alone; else the likeliest first token),
        its cost per drafted token, and the shared T(n); None when no drafter has anything
        to say. The engine's batch planner then sets this generation's quota."""
        self._offered = None
        plans = self._candidates(context, k, probes=False)
        self.books.matched.subtract({p.source.name: 1 for p in plans})  # counted again when proposing
        plans = [p for p in plans if p.cap > 0]
        if not plans:
            return None
        best = max(plans, key=lambda p: (p.k > 0, p.rate if p.k > 0 else p.estimator.expected(1)))
        self._offered = best
        return DraftOffer(best.estimator.expected_upto(best.cap), best.source.draft_cost,
                          self._costs.at(len(context)), best.source.step_cost)

    def set_quota(self, k: int | None) -> None:
        """The batch planner's K for the next proposal (with the drafter of the last offer);
        None: choose alone."""
        self._quota = k

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Try the drafters whose best K beats plain decoding, best expected rate first; the
        first non-empty draft wins (an n-gram drafter without a match gives none). k is the
        cap that the engine allows this step. With a quota from the batch planner, the
        offered drafter drafts that many instead."""
        self._last, self._last_est, self._last_k, self._last_probe = None, None, 0, False
        self.books.steps += 1
        self._proposed, started = True, time.perf_counter()
        try:
            return self._propose(context, k)
        finally:
            self._draft_s = time.perf_counter() - started

    def _propose(self, context: Sequence[int], k: int) -> Draft:
        quota, offered, self._quota, self._offered = self._quota, self._offered, None, None
        self._context_len = len(context)
        if self.choice.fixed:
            plans = [Plan(0.0, s, k, False, s.estimator_for(context)[0]) for s in self.sources if self.choice.allows(s)]
            plans = [p for p in plans if p.estimator is not None]
        elif not self.guard.allows_drafting():
            plans = []
        elif quota is not None and offered is not None:
            self.books.matched[offered.source.name] += 1
            plans = [offered._replace(k=min(quota, k), probe=False)] if min(quota, k) > 0 else []
        else:
            plans = [p for p in self._candidates(context, k) if p.k > 0]
        for plan in sorted(plans, key=lambda p: -p.rate):
            s = plan.source
            # A draft model that must first read many committed tokens times its catch-up, not its drafting.
            fed = s.behind(context)
            t0, behind, slowdown = time.perf_counter(), fed > 4, self._catch_up_slowdown(fed, len(context))
            draft = s.drafter.propose(context, plan.k)
            drafted_s = time.perf_counter() - t0
            if behind:  # what the catch-up cost beside the drafting, priced so from now on
                s.observe_catch_up(fed, drafted_s - s.step_cost - len(draft.token_ids) * s.draft_cost, slowdown)
            # A model that ran and drafted nothing: the guard counts its time as speculation that gained nothing.
            self._wasted = self._wasted or (not draft.token_ids and isinstance(s.drafter, IncrementalDrafter))
            draft, levels, first = shape_tree(draft, s, self._costs.at(self._context_len), drafted_s)  # a tree: the prefix that pays
            self._tree_expected = sum(draft.node_probs) if draft.parents is not None and draft.node_probs else None
            if draft.token_ids:
                # The measured one-token forward underestimates what drafting really costs (sampling, Python):
                # follow the observed cost, per level drafted (a tree's depth).
                if not behind:
                    s.observe_draft(levels, drafted_s)
                self._last, self._last_est, self._last_k, self._last_probe = s, plan.estimator, first, plan.probe
                self._last_rows = len(draft.token_ids) + 1  # verified rows (a tree's nodes, the root)
                self._plain_streak = 0
                self.choices[s.name] += 1
                self.books.drafted(s.name, len(draft.token_ids))
                return draft
        self._plain_streak += 1
        self.choices["none"] += 1
        for s in self.sources:
            if s.bands is None:  # per-kind n-gram estimates keep their evidence (priors are measured)
                s.estimator.relax()
        return Draft([])

    def observe(self, outcome: StepOutcome) -> None:
        """The step's outcome: its timing (the batch's first generation only) into T(n) and the
        guard, its confidence, its acceptance into the estimates of the source that drafted,
        which gets the outcome too."""
        if outcome.num_drafted == 0 and outcome.target_logits is None:  # the prefill: nothing verified
            self._observe_sources(outcome, None)
            return
        if outcome.verified_tokens:
            self._observe_timing(outcome.verified_tokens, outcome.seconds, outcome.timed)
        self._confidence = outcome.top1_probability
        num_accepted = outcome.num_accepted
        if self._own_verify is not None:
            self.guard.judge(self._last_k if self._proposed else 0, self._draft_s, self._own_verify, num_accepted + 1,
                             self._wasted)
        self._proposed, self._own_verify, self._draft_s, self._wasted = False, None, 0.0, False
        s = self._last
        self._prev_source, self._prev_full = s, s is not None and num_accepted == self._last_k
        if s is not None:  # a copy that goes on lengthens the run; a rejection ends it
            self._run = self._run + num_accepted if num_accepted == self._last_k else 0
        if s is not None and self._tree_expected is not None:  # a tree: its calibration learns, and the chain's
            s.tree_calibration.update(self._tree_expected, num_accepted)  # estimate from its first path
            self._tree_expected = None
            s.estimator.update(self._last_k, min(num_accepted, self._last_k))
        elif s is not None:
            s.estimator.update(self._last_k, num_accepted)
            if self._last_est is not None and self._last_est is not s.estimator:
                self._last_est.update(self._last_k, num_accepted)
            if self._last_probe:
                failed = num_accepted < self._last_k
                s.probe_gap = min(s.probe_gap * 2, self.max_probe_gap) if failed else self.probe_every
        self._observe_sources(outcome, s)

    def _observe_sources(self, outcome: StepOutcome, drafted: Source | None) -> None:
        """The source that drafted the step gets its outcome; the others only the hidden
        states, where they read them (HiddenStateController)."""
        if drafted is not None:
            drafted.drafter.observe(outcome)


class HiddenStateController(SpeculationController, HiddenStateDrafter):
    """A controller over at least one :class:`HiddenStateDrafter`: it hands each step's
    hidden states to every such source (whichever drafter drafted the step)."""

    def _observe_sources(self, outcome: StepOutcome, drafted: Source | None) -> None:
        super()._observe_sources(outcome, drafted)
        if outcome.hidden is not None:
            for s in self.sources:
                if s is not drafted and isinstance(s.drafter, HiddenStateDrafter):
                    s.drafter.observe(StepOutcome(hidden=outcome.hidden))
