"""What the cost-aware controller plans with: the target's T(n) shared by every fork of a
controller (:class:`SharedCosts`), each drafter it may use with its cost and acceptance
estimates (:class:`Source`), which of them a generation's request allows (:class:`SourceSet`,
the controller's side of the drafters' one door, ``configure``), and one step's option for a
source (:class:`Plan`).

Units: seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ..drafters.base import ContinuationRule, Drafter, DraftingRequest, IncrementalDrafter, LookupDrafter
from ..errors import SpecDecodeError
from ..limits import CATCH_UP_EMA, COST_EMA
from .costmodel import CostCurve, DraftStepCost, ObservedCurve, curve_table
from .tree_plan import TreeCalibration
from .estimators import (MATCH_PRIORS, AcceptanceEstimator, FeatureEstimator, LogisticAcceptance, StepFeatures,
                         TwoRateEstimator, match_band)


# The drift check reads every trusted size's median: done every few steps, not every step (a
# rewrite then comes at most this many steps later; on a 30 ms step the check costs ~0.1 ms).
DRIFT_CHECK_EVERY = 4
# A drift found before the live curve is grounded (ObservedCurve.grounded: observed at both ends)
# waits for it this many times the drift's own minimum of samples; then the cached curve is
# marked stale instead of rewritten (the sizes not observed would be extrapolations).
DRIFT_GROUNDING_SAMPLES = 4


class SharedCosts:
    """T(n) as every fork of one controller plans with it: the curve (measured, or
    :class:`ObservedCurve` when costs are learned) and its table T[0..n], grown on demand
    (a batched step reaches n = generations * (kmax + 1)), one per context planned at (in
    buckets of CONTEXT_BUCKET tokens) once the curve has context costs
    (:class:`.context_costs.ContextCosts`: :meth:`set_context_costs`)."""

    CONTEXT_BUCKET = 128  # tokens: contexts this close share a table (a 33-token block: ~1% of T apart)

    def __init__(self, curve: CostCurve | ObservedCurve, n_max: int,
                 on_drift: Callable[[str, CostCurve | None], None] | None = None) -> None:
        self.curve = curve
        self.on_drift = on_drift
        self._n_max = n_max
        self._tables: dict[int, np.ndarray] = {}  # context bucket -> T[0..n_max]; emptied by an observation

    def install(self, curve: CostCurve | ObservedCurve,
                on_drift: Callable[[str, CostCurve | None], None] | None) -> None:
        """Plan with ``curve`` from the next step on, every fork alike, and report drift from it
        to on_drift: a curve measured between a server's requests replacing the one it served
        with meanwhile (:mod:`.calibration`). Called on the thread that steps. Context costs
        already known stay."""
        if isinstance(curve, ObservedCurve) and curve.context is None:
            curve.context = self.context_costs
        self.curve = curve
        self.on_drift = on_drift
        self._tables = {}

    @property
    def context_costs(self) -> Any:
        """The :class:`.context_costs.ContextCosts` planned with, or None."""
        return getattr(self.curve, "context", None)

    def context_note(self) -> str:
        """What the statistics say of the context costs planned with ("" for none)."""
        return self.context_costs.note() if self.context_costs is not None else ""

    def set_context_costs(self, costs: Any) -> None:
        """Plan each step at its context from now on (a curve not learned from live steps keeps
        one table)."""
        if isinstance(self.curve, ObservedCurve):
            self.curve.context = costs if costs is not None and costs.measured else None
            self._tables = {}

    @property
    def table(self) -> np.ndarray:
        """T(0..n_max) as now planned with, after a short context."""
        return self.table_at(0)

    def table_at(self, context: int) -> np.ndarray:
        """T(0..n_max) as now planned with after ``context`` cached tokens."""
        b = context // self.CONTEXT_BUCKET * self.CONTEXT_BUCKET if self.context_costs is not None else 0
        t = self._tables.get(b)
        if t is None:
            T = self.curve
            t = self._tables[b] = T.table(self._n_max, b) if isinstance(T, ObservedCurve) else \
                curve_table(T, self._n_max)
        return t

    def upto(self, n: int, context: int = 0) -> np.ndarray:
        """T(0..>=n) (T(0) := T(1)) after ``context`` cached tokens."""
        if self._n_max < n:
            self._n_max, self._tables = max(n, 2 * self._n_max), {}
        return self.table_at(context)

    def at(self, context: int) -> "CostsAt":
        """These costs as one generation plans with them, at its context."""
        return CostsAt(self, context)

    def observe(self, n: int, seconds: float, bounds: tuple[float, float], min_samples: int,
                context: int = 0) -> None:
        """A step verified n tokens after ``context`` cached tokens in ``seconds``."""
        T = self.curve
        if not isinstance(T, ObservedCurve):
            return
        T.observe(n, seconds, context)
        self._tables = {}
        if self.on_drift is None or T.samples < min_samples or T.samples % DRIFT_CHECK_EVERY:
            return
        lo, hi = bounds
        all_ratios, trusted = T.ratios(), T.trusted()
        ratios = all_ratios[trusted]
        off = [T.base.ns[j] for j in np.flatnonzero(trusted) if not lo <= all_ratios[j] <= hi]
        if not lo <= T.drift <= hi or off:
            grounded = T.grounded()
            if not grounded and T.samples < DRIFT_GROUNDING_SAMPLES * min_samples:
                return  # the live curve may yet be observed at both ends: wait for it
            where = f" (at n = {', '.join(map(str, off))})" if off else ""
            self.on_drift(f"observed step times are {T.drift:.2f}x the measured curve overall, "
                          f"{ratios.min():.2f}-{ratios.max():.2f}x at the observed sizes{where}, "
                          f"after {T.samples} steps", T.live_curve() if grounded else None)
            self.on_drift = None


class CostsAt(NamedTuple):
    """:class:`SharedCosts` at one generation's context (what a tree's shaping and a batch's
    offer read): ``table``, ``upto(n)``; ``upto(n, context)`` at another (a batch's mean)."""

    shared: SharedCosts
    context: int

    @property
    def table(self) -> np.ndarray:
        return self.shared.table_at(self.context)

    def upto(self, n: int, context: int | None = None) -> np.ndarray:
        return self.shared.upto(n, self.context if context is None else context)


@dataclass
class Source:
    """One drafter the controller may use, with its cost per drafted token (seconds): the
    measured value to start with, then an exponential average of what proposals cost; for a
    draft model (an IncrementalDrafter) the slope of the line its proposals are fitted to
    (:class:`.costmodel.DraftStepCost`), and ``step_cost`` the line's fixed part, paid by every
    drafting step.

    estimator: its acceptance, by default one rate (Eq. 1), or for a drafter with
    ``acceptance_priors`` (first, then) a :class:`TwoRateEstimator` from those priors: a draft
    whose first token is the uncertain one is planned with the positional form, so that steps
    of one drafted token (all a one-rate estimate at a middling acceptance pays for) do not
    hide that later tokens are accepted more often."""

    drafter: Drafter
    draft_cost: float
    estimator: AcceptanceEstimator | TwoRateEstimator = None  # type: ignore[assignment]  # set in __post_init__
    probe_gap: int = 0  # plain steps before the next probe; set by the controller
    prefill_cost: float = 0.0  # seconds per token for a draft model to catch up on skipped text
    step_cost: float = 0.0  # seconds every drafting step costs besides draft_cost per token
    # For a LookupDrafter (prompt lookup, suffix): one
    # acceptance estimate per kind of match, (band index, unique), used instead of ``estimator``,
    # and the logistic model that conditions it on the step's features (``model``).
    bands: dict[tuple[int, bool], TwoRateEstimator] | None = None
    model: LogisticAcceptance | None = None
    tree_calibration: TreeCalibration = field(default_factory=TreeCalibration)  # a tree drafter's probabilities
    cost_fit: DraftStepCost | None = None  # a draft model's step cost line, fitted as it drafts
    rates: dict[tuple[float, float], TwoRateEstimator] = field(default_factory=dict)  # by priors: per method

    def __post_init__(self) -> None:
        if self.cost_fit is None and isinstance(self.drafter, IncrementalDrafter):
            self.cost_fit = DraftStepCost(self.draft_cost, self.step_cost)
        if self.estimator is None:
            priors = getattr(self.drafter, "acceptance_priors", None)
            self.estimator = TwoRateEstimator(*priors) if priors else AcceptanceEstimator()
        if self.bands is None and isinstance(self.drafter, LookupDrafter):
            self.bands = {(i, u): TwoRateEstimator(a1, a)
                          for u, priors in (getattr(self.drafter, "match_priors", None) or MATCH_PRIORS).items()
                          for i, (a1, a) in enumerate(priors)}
        if self.bands is not None and self.model is None:
            self.model = LogisticAcceptance()

    def estimator_for(self, context: Sequence[int], known: StepFeatures | Callable[[], StepFeatures] | None = None,
                      ) -> tuple[AcceptanceEstimator | FeatureEstimator | None, int]:
        """The acceptance estimate that applies after ``context`` and the most tokens this
        drafter can propose there: (None, 0) when a lookup drafter finds no match. For a
        lookup drafter the estimate is its match kind's rates conditioned on the step's
        features: the match, and what the controller knows (``known``: previous draft fully
        accepted, run of accepted drafts, the target's confidence; or a function giving them,
        called only when there is a match)."""
        if self.bands is None:
            return self.estimator, 1 << 30
        match = self.drafter.lookup(context)
        if match.length == 0:
            return None, 0
        k = (known() if callable(known) else known) or StepFeatures()
        features = StepFeatures(match.length, match.unique, k.prev_full, k.run, k.confidence)
        return (FeatureEstimator(self.bands[match_band(match.length), match.unique], self.model, features),
                self.drafter.available(context))

    def follow_priors(self) -> None:
        """At a generation's start: a drafter whose ``acceptance_priors`` follow the generation (a
        draft model across tokenizers runs SLEM for greedy generations, TLI for sampled ones) is
        planned with that method's own estimate, kept apart from the other's."""
        priors = getattr(self.drafter, "acceptance_priors", None)
        est = self.estimator
        if not priors or not isinstance(est, TwoRateEstimator) or (est.prior_first, est.prior_then) == tuple(priors):
            return
        self.rates[(est.prior_first, est.prior_then)] = est
        self.estimator = self.rates.get(tuple(priors)) or TwoRateEstimator(*priors)

    def observe_draft(self, levels: int, seconds: float) -> None:
        """A proposal drafted ``levels`` tokens (a tree: its depth) in ``seconds``: the cost per
        token follows it (an exponential average; a draft model's line, refitted)."""
        if self.cost_fit is None:
            self.draft_cost += COST_EMA * (seconds / max(levels, 1) - self.draft_cost)
        else:
            self.cost_fit.observe(max(levels, 1), seconds)
            self.draft_cost, self.step_cost = self.cost_fit.per_token, self.cost_fit.step

    def continuation_rule(self, table: Callable[[], np.ndarray]) -> ContinuationRule:
        """A draft model's rule (its ``keep_drafting``): draft token i+1 only while its chance
        of being accepted (the product of the draft model's own top probabilities so far) times
        the time one plain step takes exceeds what drafting it and verifying one more position
        cost. table(): the target's T[0..n] as now planned with."""
        def keep(i: int, p_cum: float) -> bool:
            T = table()
            marginal = self.draft_cost + T[min(i + 2, len(T) - 1)] - T[i + 1]
            return p_cum * T[1] >= marginal

        return keep

    def behind(self, context: Sequence[int]) -> int:
        """Tokens of ``context`` this drafter must feed before it can draft after it (a draft
        model: every committed token it has not seen; 0 for any other drafter)."""
        return self.drafter.pending(context) if isinstance(self.drafter, IncrementalDrafter) else 0

    def catch_up(self, tokens: int, slowdown: float = 1.0) -> float:
        """Seconds feeding ``tokens`` (:meth:`behind`) costs: at ``prefill_cost``, times
        ``slowdown``, what the context the catch-up reads at adds to a forward (the target's,
        from its context costs: a model's prompt tokens cost more the more they attend to)."""
        return tokens * self.prefill_cost * slowdown

    def observe_catch_up(self, tokens: int, seconds: float, slowdown: float = 1.0) -> None:
        """A proposal first fed ``tokens`` committed tokens, in ``seconds`` beside its drafting:
        prefill_cost follows what a token really cost (issue 61: on a 7,260-token agent prompt a
        draft model's first catch-up took most of 87.5 s of drafting, far above its price)."""
        if tokens > 0 and seconds > 0:
            self.prefill_cost += CATCH_UP_EMA * (seconds / (tokens * max(slowdown, 1.0)) - self.prefill_cost)

    @property
    def name(self) -> str:
        return self.drafter.name

    @property
    def label(self) -> str:
        """How explanations name this drafter: "ngram", "draft model <name>", or the drafter's
        own ``label`` where it has one (a draft model across tokenizers says its method)."""
        own = getattr(self.drafter, "label", None)
        if isinstance(own, str):
            return own
        models = self.drafter.draft_backends()
        return f"draft model {models[0].name}" if models else self.drafter.name


class Plan(NamedTuple):
    """One source's option for the next step: draft k tokens (0: a plain step) for an
    expected ``rate`` of committed tokens per second, or a ``probe`` (a short draft that
    refreshes its estimate); ``estimator``: the acceptance estimate it was planned with;
    ``cap``: the most it could draft there."""

    rate: float
    source: Source
    k: int
    probe: bool
    estimator: Any
    cap: int = 0


class SourceSet:
    """A controller's sources and which of them the current generation may draft with: all,
    planned (the default), or those its request named (:meth:`restrict`), at a fixed K when
    the request set K. :meth:`configure` is the controller's side of the drafter contract's
    one door: the request's choice and its request-fed inputs."""

    def __init__(self, sources: Sequence[Source]) -> None:
        self.all = list(sources)
        self.allowed: set[int] | None = None  # ids of the sources named, None: all
        self.fixed = False

    def allows(self, source: Source) -> bool:
        return self.allowed is None or id(source) in self.allowed

    def restrict(self, names: Sequence[str] | None, fixed: bool = False) -> None:
        """Draft only with the sources named (their kind's name, or a draft model's name);
        fixed: the request's K each step, from the first that has a draft, without planning.
        None: all, planned. Raises SpecDecodeError (param draft) for a name it does not hold."""
        if names is None:
            self.allowed, self.fixed = None, False
            return
        known = {n: s for s in self.all for n in (s.name, *s.drafter.names())}
        missing = [n for n in names if n not in known]
        if missing:
            raise SpecDecodeError(f"no loaded drafter is named {missing[0]!r}: loaded are {', '.join(sorted(known))}",
                                  param="draft")
        self.allowed, self.fixed = {id(known[n]) for n in names}, fixed

    def configure(self, request: DraftingRequest) -> None:
        """The request's choice (:meth:`restrict`), and each request-fed input handed to the
        allowed sources that follow its field. Raises SpecDecodeError naming ``draft`` or the
        input's field. An input that none of the engine's own drafters follows (the request
        named no drafter) is ignored, as plain decoding ignores it: a client sends a
        ``prediction`` whatever the server drafts with (issue 61)."""
        self.restrict([request.draft] if request.draft is not None else None, fixed=request.fixed)
        allowed = [s for s in self.all if self.allows(s)]
        for name, ids in request.inputs.items():
            takers = [s for s in allowed if name in s.drafter.request_fields]
            if not takers and request.draft is None:
                continue
            if not takers:
                raise SpecDecodeError(f"a {name} needs a drafter that follows one (draft 'auto' or the kind that reads "
                                      f"it); this one drafts with {', '.join(s.name for s in allowed)}", param=name)
            for s in takers:
                s.drafter.configure(DraftingRequest(inputs={name: ids}, token_bytes=request.token_bytes))

    def names(self) -> list[str]:
        """The names a request may choose a source by: each source's, and its draft models'."""
        return list(dict.fromkeys(n for s in self.all for n in (s.name, *s.drafter.names())))

    def input_counts(self) -> tuple[int, int] | None:
        """(accepted, rejected) drafted tokens from request-fed inputs, summed over the sources
        that held one this generation; None when none did."""
        held = [c for s in self.all if (c := s.drafter.input_counts()) is not None]
        return (sum(a for a, _ in held), sum(r for _, r in held)) if held else None
