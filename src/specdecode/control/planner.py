"""Planning a batched step: every running generation's K chosen together.

A cost-aware drafter (:class:`PlannedDrafter`, the controller) offers what drafting
K = 0..cap tokens after its context is expected to commit (:class:`DraftOffer`);
:func:`plan_batch` takes the offers of a step's generations, picks the K of each with
:func:`specdecode.control.costmodel.allocate_drafts` (the step's expected tokens per second
on the measured T(n), Leviathan et al. 2023, Eq. 1 summed over the batch), and hands each
its quota. Drafters without offers draft as they would alone.

Dimension letters: K = drafted tokens, B = generations in the step.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..drafters.base import Drafter, DrafterBase
from .costmodel import allocate_drafts


@dataclass
class DraftOffer:
    """What a cost-aware drafter expects of drafting after a context, for the batch planner.

    expected: [K+1] expected committed tokens of a step drafting k = 0..K (expected[0] = 1;
    non-decreasing, with non-increasing increments). cost_s: seconds per drafted token; step_s:
    seconds a drafting step costs besides (a draft model's fixed part).
    costs: the target's T(n) at this generation's context (:class:`.sources.CostsAt`: ``upto(n)`` ->
    T[0..>=n] seconds; ``upto(n, context)`` at another context).
    """

    expected: np.ndarray
    cost_s: float
    costs: Any
    step_s: float = 0.0


class PlannedDrafter(DrafterBase):
    """Extension of the drafter contract for a drafter that chooses its own K from measured
    costs (:class:`specdecode.control.controller.SpeculationController`): the engine asks it
    for offers in a batched step (its outcomes carry the verifications' timing, as every
    drafter's do, and its explanation is every drafter's ``explain``)."""

    plans_k = True

    @property
    @abstractmethod
    def target_cost(self) -> Any:
        """The target's T(n) as planned with (a CostCurve, or an ObservedCurve over one)."""

    @abstractmethod
    def offer(self, context: Sequence[int], k: int) -> DraftOffer | None:
        """What drafting up to k tokens after context [L] is expected to commit, or None."""

    @abstractmethod
    def set_quota(self, k: int | None) -> None:
        """The batch planner's K for the next proposal (after an offer); None: alone."""

    @abstractmethod
    def explain(self) -> str:
        """One line on what the drafters did in the last generation and why."""


def plan_batch(drafters: Sequence[Drafter], contexts: Sequence[Sequence[int]], caps: Sequence[int]) -> None:
    """Choose the K of every generation of a batched step together and hand each planned
    drafter its quota. drafters, contexts, caps: [B] each generation's drafter, committed
    tokens and largest K. A drafter without an offer drafts its own way (its cap counts as
    fixed tokens of the forward)."""
    offers = [d.offer(ctx, cap) if cap > 0 and d.plans_k else None
              for d, ctx, cap in zip(drafters, contexts, caps)]
    planned = [i for i, o in enumerate(offers) if o is not None]
    if not planned:
        return
    fixed = sum(1 + (caps[i] if offers[i] is None else 0) for i in range(len(drafters)))
    gains = [np.diff(offers[i].expected) for i in planned]
    context = int(np.mean([len(c) for c in contexts]))  # the rows' extra cost: as if all were at the mean context
    costs = offers[planned[0]].costs
    quotas = allocate_drafts(gains, [offers[i].cost_s for i in planned], fixed, float(len(drafters)),
                             lambda n: costs.upto(n, context), [offers[i].step_s for i in planned])
    for i, q in zip(planned, quotas):
        drafters[i].set_quota(q)
