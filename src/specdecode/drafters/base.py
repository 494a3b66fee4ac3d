"""The drafter contract: cheap guesses of the next K tokens.

Every drafter has one signature, ``propose(context, k) -> Draft``, and one feedback door,
``observe(outcome)``, within a small lifecycle (as llama.cpp's ``common/speculative.h``: init /
begin / draft / accept / free):

    start(prompt_ids, sampler)   once per generation, before any proposal (and the prefill)
    propose(context, k)          the next up-to-k tokens after context
    observe(outcome)             what the step did: a StepOutcome (accepted, drafted, the
                                 target's rows, the forward's timing, hidden states), once
                                 per step after it committed, and once after the prefill
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

from dataclasses import dataclass, field, replace
import copy
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

from ..errors import SpecDecodeError

if TYPE_CHECKING:
    from ..backends.base import Backend, HiddenRows
    from ..sampling import Sampler

# keep_drafting(i, p_cum) -> bool: asked before drafting token i+1 (i >= 1 drafted so far),
# p_cum the product of the draft model's top probabilities so far.
ContinuationRule = Callable[[int, float], bool]


class Match(NamedTuple):
    """Where prompt lookup found the context's suffix (NgramDrafter.lookup).

    length: tokens the chosen occurrence agrees with the end of the context (0: none).
    start: index of the token that followed it (the first to propose; -1: none).
    unique: every earlier occurrence of the matched n-gram was followed by the same token.
    """

    length: int
    start: int
    unique: bool


@dataclass
class Draft:
    """token_ids: [K] drafted ids. probs: [K, V] the distribution each was drawn from, or
    None when each was chosen deterministically (greedy drafts, n-gram lookup): one-hot.
    parents: None for a chain; for a tree of candidates, [K] each node's parent (-1: a child
    of the last committed token; else an earlier node, :mod:`specdecode.verify`), with
    deterministic drafts only (probs None) and distinct siblings."""

    token_ids: list[int]
    probs: np.ndarray | None = None
    parents: list[int] | None = None
    node_probs: list[float] | None = None  # a tree's nodes: the drafter's chance each is on the accepted path

    def chain(self) -> "Draft":
        """The tree's first path (each node's first child, from the root), as a chain; a
        chain is itself."""
        if self.parents is None:
            return self
        ids, at = [], -1
        for i, p in enumerate(self.parents):
            if p == at:
                ids.append(self.token_ids[i])
                at = i
        return Draft(ids)


@dataclass(frozen=True)
class StepOutcome:
    """What one step tells a generation's drafter, through its one feedback door
    (:meth:`Drafter.observe`), after the step committed: gpt-fast's step returns its tokens
    and the caller keeps the books; llama.cpp hands the verified batch to its speculator in
    one call. The prefill's outcome drafted nothing and may carry hidden states.

    num_accepted: drafted tokens the target accepted (a tree: the nodes of its accepted path).
    num_drafted: drafted tokens verified for this generation (0: a plain step, the prefill).
    target_logits: [A+1, V] the target's verification logits of the committed positions (A =
        num_accepted; row A gave the recovered or bonus token), None for the prefill.
    verified_tokens, seconds, timed: the step's target forward over the whole batch: its
        tokens (each generation's last committed token and drafts), the seconds of forward and
        verification, and whether that is a sample of T(verified_tokens) as the cost curve
        times one (False in batch-invariant mode, or a step split into several forwards). The
        batch's timing is handed to its first generation only (forks share one curve); 0 for
        the others and the prefill.
    hidden: the target's final hidden states of this generation's verified rows (or the
        prefill's last row), for a :class:`HiddenStateDrafter`; None otherwise.
    """

    num_accepted: int = 0
    num_drafted: int = 0
    target_logits: np.ndarray | None = None
    verified_tokens: int = 0
    seconds: float = 0.0
    timed: bool = False
    hidden: "HiddenRows | None" = None

    def top1_probability(self) -> float:
        """The target's top-1 probability at the position of its own token (the last row of
        target_logits): near 1 through a copy. One float32 softmax row (0.2 ms at V = 152k),
        so a drafter calls it only when it needs it."""
        z = np.asarray(self.target_logits[-1])
        return float(1.0 / np.exp(z - z.max()).sum(dtype=np.float64))


@dataclass(frozen=True)
class DraftingRequest:
    """What one generation asks of its drafter, handed over once after ``start`` through the
    one door :meth:`Drafter.configure` (resolved from the request's options by
    :func:`specdecode.drafters.kinds.resolve_request`).

    draft: None (the drafter's own choice: every source of a controller, planned), or the
        name of one drafter it holds (a kind such as "ngram", or a loaded draft model's name).
    fixed: the request set K: draft that many tokens each step, without planning.
    planned: the request asked for "auto": only a drafter that plans K may serve it.
    inputs: the request-fed inputs by request field, each as target token ids [P]
        (OpenAI's predicted output: ``{"prediction": ids}``); a drafter takes those named in
        its ``request_fields``.
    token_bytes: a token's text (for drafters that read line ends), or None.
    """

    draft: str | None = None
    fixed: bool = False
    planned: bool = False
    inputs: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    token_bytes: Callable[[int], bytes] | None = None


class Drafter(Protocol):
    """The drafter contract: the lifecycle the engine drives (see the module docstring).

    What only the cost-aware controller needs is a declared extension, by subclassing:
    :class:`LookupDrafter` (lookups that can say what they would match before proposing),
    :class:`IncrementalDrafter` (a model that reads the text and drafts token by token), and
    :class:`HiddenStateDrafter` (drafts from the target's hidden states of the verifying
    forward); the controller itself is :class:`specdecode.control.planner.PlannedDrafter`.
    """

    name: str

    def start(self, prompt_ids: Sequence[int], sampler: "Sampler") -> None:
        """A generation begins: prompt_ids [L] is its prompt; sampler shapes and draws
        sampled drafts (the same one the target's verification uses)."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to k tokens to follow context [L] (committed tokens: prompt and output).
        May return fewer, or none."""

    def observe(self, outcome: "StepOutcome") -> None:
        """What the last step did (after it committed; the prefill's outcome drafted nothing)."""

    def finish(self, committed: Sequence[int]) -> None:
        """The generation ended with committed [L]: nothing past it may stay cached."""

    def close(self) -> None:
        """Free the models this drafter owns (idempotent)."""

    def fork(self, seq: int) -> "Drafter":
        """A drafter of the same kind for another concurrent generation, drafting on KV
        sequence seq of the shared draft models; it shares models and measured costs, not
        per-generation state. Raises SpecDecodeError when the drafter cannot be shared."""

    def draft_backends(self) -> list["Backend"]:
        """The model backends this drafter drafts with and frees on close (none for lookups)."""

    # The request fields this drafter drafts from (its kind row's request_field): () for none.
    request_fields: tuple[str, ...]
    plans_k: bool  # it chooses K itself from measured costs (the controller): it may serve "auto"
    confirmed: bool  # its drafts have been right so far: the controller may let it draft long blocks
    tree_nodes: int  # the node budget of its trees of drafts this generation (0: chains)

    def configure(self, request: DraftingRequest) -> None:
        """This generation's choice and request-fed inputs (after :meth:`start`). Raises
        SpecDecodeError naming the field (``draft``, or the input's field) for what it cannot
        serve: a drafter it does not hold, "auto" without planning, an input it does not follow."""

    def names(self) -> list[str]:
        """The names a request may choose it (or, for a controller, its sources) by: kinds
        and the names of loaded draft models."""

    @property
    def last_source(self) -> str | None:
        """The name of the drafter whose proposal the last step verified (None: none)."""

    def members(self) -> list["Drafter"]:
        """The drafters it chooses among (a controller's sources; none for one drafter)."""

    def input_counts(self) -> tuple[int, int] | None:
        """(accepted, rejected) drafted tokens from request-fed inputs this generation, or
        None when it held none."""

    def explain(self) -> str:
        """One line on what it did in the last generation and why ("" when nothing to say)."""


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


class DrafterBase(ABC):
    """Defaults of the lifecycle: no state to free, no models; ``fork`` gives an independent
    copy (``copy.deepcopy``), right for a drafter whose state is its own. A drafter that
    shares models or large structures across generations overrides ``fork``; one that can
    serve only one generation says so in its row of :data:`specdecode.drafters.kinds.KINDS`
    (``parallel=False``), so that ``--parallel > 1`` refuses it by name."""

    name = "base"

    @abstractmethod
    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to k tokens to follow context [L]."""

    def start(self, prompt_ids: Sequence[int], sampler: "Sampler") -> None:
        pass

    def observe(self, outcome: "StepOutcome") -> None:
        pass

    def finish(self, committed: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass

    def fork(self, seq: int) -> "Drafter":
        return copy.deepcopy(self)

    def draft_backends(self) -> list["Backend"]:
        return []

    request_fields: tuple[str, ...] = ()
    plans_k = False
    confirmed = False
    tree_nodes = 0

    def configure(self, request: DraftingRequest) -> None:
        """Refuses what one drafter cannot serve (an input it does not follow, where the request
        named it; where the request named none, such an input is ignored, as plain decoding
        ignores it); a drafter with ``request_fields`` takes its inputs in :meth:`take_inputs`."""
        if request.planned and not self.plans_k:
            raise SpecDecodeError(f"draft 'auto' needs the cost-aware controller (-k auto); this engine drafts with "
                                  f"{self.name!r} at a fixed K", param="draft")
        if request.draft is not None and request.draft not in self.names():
            raise SpecDecodeError(f"draft {request.draft!r} is not loaded: this engine drafts with "
                                  f"{', '.join(map(repr, self.names()))} only (a request chooses among the drafters "
                                  f"its Decoder loaded)", param="draft")
        for name in request.inputs:
            if name not in self.request_fields and request.draft is not None:
                raise SpecDecodeError(f"a {name} needs a drafter that follows one (draft 'auto' or the kind that "
                                      f"reads it); this one drafts with {', '.join(self.names())}", param=name)
        inputs = {k: v for k, v in request.inputs.items() if k in self.request_fields}
        if inputs:
            self.take_inputs(replace(request, inputs=inputs))

    def take_inputs(self, request: DraftingRequest) -> None:
        """This generation's request-fed inputs (``request.inputs``, only fields of its
        ``request_fields``); the default has none to take."""

    def names(self) -> list[str]:
        return [self.name] + [b.name for b in self.draft_backends() if b.name != self.name]

    @property
    def last_source(self) -> str | None:
        return self.name

    def members(self) -> list["Drafter"]:
        return []

    def input_counts(self) -> tuple[int, int] | None:
        return None

    def explain(self) -> str:
        return ""

    def follows(self, request_field: str) -> bool:
        """Whether it, or one of its members, drafts from this request field."""
        return request_field in self.request_fields or any(m.follows(request_field) for m in self.members())


class LookupDrafter(DrafterBase):
    """Extension: a lookup in the text that can say, before proposing, what kind of match it
    would draft from (the controller keeps one acceptance estimate per kind of match, and
    skips a drafter with nothing to say)."""

    @abstractmethod
    def lookup(self, context: Sequence[int]) -> Match:
        """The match this drafter would draft from after context [L] (length 0: none)."""

    @abstractmethod
    def available(self, context: Sequence[int]) -> int:
        """The most tokens it could propose after context [L] (0 for none)."""


class IncrementalDrafter(DrafterBase):
    """Extension: a model that must read the committed text before it drafts and drafts
    token by token (a draft model): the controller prices its catch-up and may stop it
    early."""

    @abstractmethod
    def pending(self, context: Sequence[int]) -> int:
        """Tokens of context [L] the drafter must read before it can draft."""

    @abstractmethod
    def set_continuation_rule(self, rule: ContinuationRule | None) -> None:
        """Ask ``rule`` before each further drafted token and stop when it says no."""


class HiddenStateDrafter(DrafterBase):
    """Extension: drafts from the target's final hidden states, handed over in each step's
    outcome (``StepOutcome.hidden``: the verifying forward's rows of this generation, or the
    prefill's last row), as llama.cpp's ``common_speculative_process`` hands the verifying
    batch to its speculator. The engine asks the target for them only in a step where a
    running generation's drafter is one of these."""


class NoDrafter(DrafterBase):
    """No drafts: every step is one plain autoregressive target forward (the baseline)."""

    name = "none"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return Draft([])

    def fork(self, seq: int) -> "NoDrafter":
        return self  # no state
