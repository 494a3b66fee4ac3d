"""The oracle of lookup drafting: how fast the target's greedy output could have been
committed by a controller that knows, before each step, how much of every draft the
target will accept.

Replayed offline over fixed greedy outputs with the measured target cost curve T(n)
(:class:`specdecode.control.costmodel.CostCurve`, seconds for a forward of n tokens); no model
runs. At output position i every drafter proposes after ``prompt + output[:i]`` (at most
``kmax`` tokens, and at most the tokens left but one: the last token of a step is the
target's own); n of the proposal agree with the output. The oracle takes the step
(drafter, K <= len(proposal)) that maximises the tokens committed per second,
(min(n, K) + 1) / T(K + 1) (K = 0 is a plain step, T(1)), and advances min(n, K) + 1.
Ties go to the smaller K, then to the earlier drafter. Oracle time is the sum of the step
costs; plain time is len(output) * T(1); oracle speedup = plain time / oracle time >= 1.
With context costs (:class:`specdecode.control.context_costs.ContextCosts`), every step is
priced at its context: T(n) + extra(n, c) with c the tokens before it, plain steps alike
("the oracle at its context").

Only drafters without model cost fit this definition (lookups: prompt lookup, suffix
drafting): a draft model's proposals and cost are not known offline.

Units: seconds; token counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..control.costmodel import CostCurve
from ..drafters.base import Drafter, DraftingRequest
from ..drafters.kinds import DraftRequest, auto_kinds, resolve
from ..limits import MAX_NUM_SPECULATIVE_TOKENS
from ..sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class OracleStep:
    """One step of the oracle: it starts at output index ``position``, drafts ``k`` tokens
    with drafter number ``drafter`` (None: a plain step, k = 0), of which ``matched`` tokens
    of that drafter's whole proposal agree with the output; it commits ``min(matched, k) + 1``."""

    position: int
    drafter: int | None
    k: int
    matched: int

    @property
    def advanced(self) -> int:
        return min(self.matched, self.k) + 1


@dataclass(frozen=True)
class OracleResult:
    """time_s: the oracle's seconds; plain_s: len(output) * T(1); steps: the steps taken."""

    time_s: float
    plain_s: float
    steps: tuple[OracleStep, ...]

    @property
    def speedup(self) -> float:
        """plain_s / time_s (1.0 for an empty output)."""
        return self.plain_s / self.time_s if self.time_s > 0 else 1.0


def matched_prefix(proposal: Sequence[int], output: Sequence[int], i: int) -> int:
    """How many leading tokens of proposal equal output[i:]."""
    n = 0
    while n < len(proposal) and i + n < len(output) and proposal[n] == output[i + n]:
        n += 1
    return n


def oracle_replay(prompt: Sequence[int], output: Sequence[int], cost: CostCurve, drafters: Sequence[Drafter],
                  kmax: int = MAX_NUM_SPECULATIVE_TOKENS, prediction: Sequence[int] | None = None,
                  context_costs=None) -> OracleResult:
    """The oracle over one request (see the module docstring).

    prompt, output: token ids (output: the target's greedy completion). cost: T(n).
    drafters: lookup drafters (``propose(context, k)``), used as they are and kept: each
    is started with the prompt and, at the end, told ``finish(prompt + output)``, so a
    drafter that learns across requests (suffix drafting) has seen this one before the
    next. kmax: the largest K, at most MAX_NUM_SPECULATIVE_TOKENS. prediction: the request's
    predicted output (token ids), handed to the drafters that follow one. context_costs: what a
    step costs more at its context (None: every step at the curve's).
    """
    if not 0 <= kmax <= MAX_NUM_SPECULATIVE_TOKENS:
        raise ValueError(f"kmax = {kmax} outside 0..{MAX_NUM_SPECULATIVE_TOKENS}")
    prompt, output = [int(t) for t in prompt], [int(t) for t in output]
    t0 = np.array([cost(1)] + [cost(n) for n in range(1, kmax + 2)])  # t0[n] = T(n)
    priced = context_costs is not None and context_costs.measured
    plain_s, time_s = 0.0, 0.0
    sampler = Sampler(SamplingParams())  # greedy; lookups ignore it
    for d in drafters:
        d.start(prompt, sampler)
        if prediction and d.follows("prediction"):
            d.configure(DraftingRequest(inputs={"prediction": tuple(prediction)}))
    steps, i = [], 0
    while i < len(output):
        cap = min(kmax, len(output) - i - 1)
        ctx = prompt + output[:i]
        t = t0 + context_costs.row(kmax + 1, len(ctx)) if priced else t0  # T(n) at this step's context
        best, best_rate = OracleStep(i, None, 0, 0), 1.0 / t[1]
        if cap > 0:
            for j, d in enumerate(drafters):
                prop = list(d.propose(ctx, cap).token_ids[:cap])
                n = matched_prefix(prop, output, i)
                for k in range(1, len(prop) + 1):
                    rate = (min(n, k) + 1) / t[k + 1]
                    if rate > best_rate or (rate == best_rate and k < best.k):
                        best, best_rate = OracleStep(i, j, k, n), rate
        steps.append(best)
        if priced:
            time_s += float(t[best.k + 1])
            plain_s += float(sum(t0[1] + context_costs(1, len(prompt) + j) for j in range(i, i + best.advanced)))
        i += best.advanced
    for d in drafters:
        d.finish(prompt + output)
    if not priced:  # summed per K, so that an all-plain replay costs exactly len(output) * T(1)
        time_s = sum(c * float(t0[k + 1]) for k, c in sorted(Counter(s.k for s in steps).items()))
        plain_s = len(output) * float(t0[1])
    return OracleResult(time_s, plain_s, tuple(steps))


def oracle_speedup(results: Sequence[OracleResult]) -> float | None:
    """Sum of plain times / sum of oracle times over several requests (None for none)."""
    if not results:
        return None
    time_s = sum(r.time_s for r in results)
    return sum(r.plain_s for r in results) / time_s if time_s > 0 else 1.0


def lookup_drafters(draft: str) -> list[Drafter] | None:
    """Fresh lookup drafters that a configuration's ``draft`` could draft with at no model
    cost, for :func:`oracle_replay`: the kinds table's free lookups ("auto": all of them;
    "ngram", "suffix": that one); "none" no drafter (the oracle is plain decoding). None for
    a drafter with a model or weights, where the oracle is not defined."""
    names = resolve(draft, "auto").names
    kinds = [k for k in auto_kinds() if k.name in names]
    if len(kinds) < len(names):
        return None
    return [k.build(DraftRequest(None, "", _no_model)) for k in kinds]  # lookups read no target


def _no_model(name: str):
    raise AssertionError("a lookup drafter loads no model")
