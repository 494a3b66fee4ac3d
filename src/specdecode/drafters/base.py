"""The drafter contract: cheap guesses of the next K tokens.

Every drafter has one signature, ``propose(context, k) -> Draft``, and a feedback hook
``observe(num_accepted)``, within a small lifecycle (as llama.cpp's
``common/speculative.h``: init / begin / draft / accept / free):

    start(prompt_ids, sampler)   once per generation, before any proposal
    propose(context, k)          the next up-to-k tokens after context
    observe(num_accepted)        how many of the last proposal the target accepted
    finish(committed)            end of the generation: drop state past the committed text
    close()                      free what the drafter owns (draft models)
    fork(seq)                    a drafter for another concurrent generation (KV sequence seq)

Concurrent generations (continuous batching, :mod:`specdecode.engine`) each have their own
drafter, forked from one: forks share the models (each on its own KV sequence) and the
measured costs, and keep their own per-generation state and acceptance estimates. Before
a batched step's proposals the engine asks each drafter for a :class:`DraftOffer` (what
drafting K = 0..cap tokens is expected to commit), plans every generation's K together,
and hands each its quota (``set_quota``); a drafter without offers drafts as it would alone.

``start`` hands over the sampler whose transforms and random generator the drafter must
use, so that ``Draft.probs`` is the distribution each drafted token was actually drawn from.

Dimension letters: K = drafted tokens, V = vocabulary size, L = context length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..sampling import Sampler

# keep_drafting(i, p_cum) -> bool: asked before drafting token i+1 (i >= 1 drafted so far),
# p_cum the product of the draft model's top probabilities so far.
ContinuationRule = Callable[[int, float], bool]


@dataclass
class Draft:
    """token_ids: [K] drafted ids. probs: [K, V] the distribution each was drawn from, or
    None when each was chosen deterministically (greedy drafts, n-gram lookup): one-hot."""

    token_ids: list[int]
    probs: np.ndarray | None = None


@dataclass
class DraftOffer:
    """What a cost-aware drafter expects of drafting after a context, for the batch planner.

    expected: [K+1] expected committed tokens of a step drafting k = 0..K (expected[0] = 1;
    non-decreasing, with non-increasing increments). cost_s: seconds per drafted token.
    costs: the target's T(n) table source (``upto(n)`` -> T[0..>=n], seconds).
    """

    expected: np.ndarray
    cost_s: float
    costs: Any


class Drafter(Protocol):
    """What the engine and the controller need from a drafter.

    has_lookup: the drafter answers ``lookup(context) -> Match`` (the kind of match it
    would draft from) and ``available(context) -> int`` (the most tokens it could propose
    there, 0 for none) before proposing, so that the controller can keep one acceptance
    estimate per kind of match and skip a drafter with nothing to say.
    """

    name: str
    has_lookup: bool

    def start(self, prompt_ids: Sequence[int], sampler: "Sampler") -> None:
        """A generation begins: prompt_ids [L] is its prompt; sampler shapes and draws
        sampled drafts (the same one the target's verification uses)."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to k tokens to follow context [L] (committed tokens: prompt and output).
        May return fewer, or none."""

    def observe(self, num_accepted: int) -> None:
        """The target accepted the first num_accepted tokens of the last proposal."""

    def finish(self, committed: Sequence[int]) -> None:
        """The generation ended with committed [L]: nothing past it may stay cached."""

    def close(self) -> None:
        """Free the models this drafter owns (idempotent)."""

    def pending(self, context: Sequence[int]) -> int:
        """Tokens of context the drafter must read before it can draft (0 for lookups)."""

    def draft_backends(self) -> list["Backend"]:
        """The model backends this drafter drafts with (none for lookups)."""

    def set_continuation_rule(self, rule: ContinuationRule | None) -> None:
        """A drafter that drafts token by token asks ``rule`` before each further token and
        stops when it says no (the controller's cost rule); others ignore it."""

    def observe_verification(self, n: int, seconds: float) -> None:
        """The target verified n tokens (last committed + drafts) in ``seconds`` (its
        forward and the acceptance rule): a free sample of T(n) for a cost-aware drafter."""

    def explain(self) -> str:
        """One line on what this drafter did in the last generation and why ("" if nothing
        to say): the statistics block shows it."""

    def fork(self, seq: int) -> "Drafter":
        """A drafter of the same kind for another concurrent generation, drafting on KV
        sequence seq of the shared draft models; it shares models and measured costs, not
        per-generation state. Raises SpecDecodeError when the drafter cannot be shared."""

    def offer(self, context: Sequence[int], k: int) -> DraftOffer | None:
        """What drafting up to k tokens after context is expected to commit (a cost-aware
        drafter), or None: the engine then lets it draft as it would alone."""

    def set_quota(self, k: int | None) -> None:
        """The batch planner's K for the next proposal (after an offer); None: alone."""


class ContextMemo:
    """The last answer of a lookup, reused for the same context: the controller asks a
    lookup drafter about a context (its plan), then to propose after it. The engine's
    committed list only grows, so the same list object at the same length is the same text.

    compute: context [L] -> answer.
    """

    def __init__(self, compute: Callable[[Sequence[int]], object]) -> None:
        self._compute = compute
        self._key: tuple | None = None  # (context object, its length)
        self._value: object = None

    def __call__(self, context: Sequence[int]):
        key = self._key
        if key is None or key[0] is not context or key[1] != len(context):
            self._value = self._compute(context)
            self._key = (context, len(context))
        return self._value

    def clear(self) -> None:
        self._key, self._value = None, None


class DrafterBase:
    """Defaults of the optional parts of the Drafter protocol: no state to free, nothing
    to catch up on, no models, token-by-token rules ignored."""

    name = "base"
    has_lookup = False

    def start(self, prompt_ids: Sequence[int], sampler: "Sampler") -> None:
        pass

    def observe(self, num_accepted: int) -> None:
        pass

    def finish(self, committed: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass

    def pending(self, context: Sequence[int]) -> int:
        return 0

    def draft_backends(self) -> list["Backend"]:
        return []

    def set_continuation_rule(self, rule: ContinuationRule | None) -> None:
        pass

    def observe_verification(self, n: int, seconds: float) -> None:
        pass

    def explain(self) -> str:
        return ""

    def fork(self, seq: int) -> "Drafter":
        from ..errors import SpecDecodeError

        raise SpecDecodeError(f"the {self.name!r} drafter serves one generation at a time: it cannot be forked "
                              f"for concurrent generations")

    def offer(self, context: Sequence[int], k: int) -> DraftOffer | None:
        return None

    def set_quota(self, k: int | None) -> None:
        pass


class NoDrafter(DrafterBase):
    """No drafts: every step is one plain autoregressive target forward (the baseline)."""

    name = "none"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return Draft([])

    def fork(self, seq: int) -> "NoDrafter":
        return self  # no state
