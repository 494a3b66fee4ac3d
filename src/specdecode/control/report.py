"""What the cost-aware controller says about a generation (the statistics' ``controller:``
line): which drafter drafted in how many steps and at which K, and why one that did not
draft was not used (no match in the text, a cost that cannot pay even if every draft is
accepted, or an estimated acceptance too low for this machine's T(n))."""

from __future__ import annotations

from collections import Counter
from typing import Callable

from .estimators import TwoRateEstimator
from .sources import Source, SourceSet


class GenerationBooks:
    """One generation's books: steps proposed, steps drafted by each source and the K they
    drafted, and (lookup drafters) steps where they had a match."""

    def __init__(self) -> None:
        self.steps = 0
        self.used: Counter = Counter()
        self.ks: dict[str, list[int]] = {}
        self.matched: Counter = Counter()

    def clear(self) -> None:
        self.steps = 0
        self.used.clear()
        self.ks.clear()
        self.matched.clear()

    def drafted(self, name: str, k: int) -> None:
        """The source named drafted k tokens this step."""
        self.used[name] += 1
        self.ks.setdefault(name, []).append(k)

    def explain(self, sources: list[Source], choice: SourceSet, step_cost_s: float,
                pays_if_all_accepted: Callable[[Source], bool], notes: list[str]) -> str:
        """One line: what each source did and why an unused one was not used, then notes (the
        guard's, the measurement's). step_cost_s: T(1), seconds; pays_if_all_accepted(source):
        whether any K > 0 pays for it at acceptance 1."""
        parts = []
        for s in sources:
            if ((s.drafter.request_fields and s.drafter.input_counts() is None) or not choice.allows(s)) \
                    and not self.used[s.name]:
                continue  # its request field was not given, or the request chose other drafters: nothing to say
            n = self.used[s.name]
            if n:
                ks = self.ks[s.name]
                span = f"K {min(ks)}-{max(ks)}" if min(ks) != max(ks) else f"K {ks[0]}"
                parts.append(f"{s.label} drafted in {n} of {self.steps} steps ({span})")
            elif s.bands is not None:
                m = self.matched[s.name]
                parts.append(f"{s.label}: no match in the text" if not m else
                             f"{s.label}: matches at {m} steps, none likely enough to pay here")
            else:
                ratio = s.draft_cost / step_cost_s
                if not pays_if_all_accepted(s):
                    parts.append(f"{s.label} not used: it costs {ratio:.2f} of a target step on this machine, "
                                 "so it cannot pay even if every draft is accepted")
                else:
                    est = s.estimator
                    rates = f"{est.alpha:.2f}" + (f" (first token; {est.then.alpha:.2f} each later one)"
                                                  if isinstance(est, TwoRateEstimator) else "")
                    step = f" and {s.step_cost / step_cost_s:.2f} a drafting step" if s.step_cost else ""
                    parts.append(f"{s.label} not used: at its estimated acceptance {rates} it does "
                                 f"not pay (it costs {ratio:.2f} of a target step a token{step})")
        return "; ".join(parts + [p for p in notes if p])
