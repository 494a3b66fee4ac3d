"""Drafters: cheap guesses of the next K tokens.

Every drafter has one signature, ``propose(context, k) -> Draft``, and a feedback hook
``observe(num_accepted)``. ``start(prompt_ids, sampler)`` is called once per generation
with the sampler whose transforms and random generator the drafter must use, so that
``Draft.probs`` is the distribution each drafted token was actually drawn from.

Dimension letters: K = drafted tokens, V = vocabulary size, L = context length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from .backends.base import Backend
from .errors import IncompatibleVocabularyError, SpecDecodeError
from .sampling import Sampler


def common_prefix_len(cached: Sequence[int], tokens: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of two token lists, at most ``limit``: how much of
    a KV cache holding ``cached`` can be kept for ``tokens``."""
    n, end = 0, min(len(cached), len(tokens), len(tokens) if limit is None else limit)
    while n < end and cached[n] == tokens[n]:
        n += 1
    return n


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
    None when each was chosen deterministically (greedy drafts, n-gram lookup): one-hot."""

    token_ids: list[int]
    probs: np.ndarray | None = None


class Drafter(Protocol):
    name: str

    def start(self, prompt_ids: Sequence[int], sampler: Sampler) -> None: ...

    def propose(self, context: Sequence[int], k: int) -> Draft: ...

    def observe(self, num_accepted: int) -> None: ...

    def finish(self, committed: Sequence[int]) -> None: ...


class NoDrafter:
    """No drafts: every step is one plain autoregressive target forward (the baseline)."""

    name = "none"

    def start(self, prompt_ids: Sequence[int], sampler: Sampler) -> None:
        pass

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return Draft([])

    def observe(self, num_accepted: int) -> None:
        pass

    def finish(self, committed: Sequence[int]) -> None:
        pass


class NgramDrafter:
    """Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``).

    Find earlier occurrences (prompt and generated text) of the last n tokens of the
    context, n from max_ngram down to min_ngram; propose the up to k tokens that followed
    the occurrence whose match extends furthest back (its *match length*, counted up to
    ``max_match`` tokens; ties go to the most recent). A long match means the text is being
    copied, so its continuation is likely right: :meth:`lookup` exposes the match length,
    and the cost-aware controller keeps an acceptance estimate per match length.
    Drafts are deterministic, so probs is None (one-hot).
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_match: int = 64) -> None:
        if not (1 <= min_ngram <= max_ngram):
            raise SpecDecodeError(f"ngram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_match < max_ngram:
            raise SpecDecodeError(f"max_match = {max_match} must be >= max_ngram = {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_match = max_match
        self.last_match_len = 0  # match length behind the latest proposal (0: none)
        self._memo: tuple | None = None  # (context object, its length, Match) of the last lookup

    def start(self, prompt_ids: Sequence[int], sampler: Sampler) -> None:
        self.last_match_len = 0
        self._memo = None

    def lookup(self, context: Sequence[int]) -> Match:
        """The best earlier occurrence of the context's suffix (see Match).

        Its length is at least min_ngram and at most max_match; Match(0, -1, False) when no
        suffix of min_ngram tokens recurs. An ambiguous match (the n-gram was followed by
        different tokens at different places) is a much weaker guess than a unique one.
        A repeated call for the same context (the controller's plan, then propose) reuses
        the last answer: the engine's committed list only grows, so the same object at the
        same length is the same text.
        """
        memo = self._memo
        if memo is not None and memo[0] is context and memo[1] == len(context):
            return memo[2]
        match = self._lookup(context)
        self._memo = (context, len(context), match)
        return match

    def _lookup(self, context: Sequence[int]) -> Match:
        ctx = np.asarray(context, dtype=np.int64)  # [L]
        L = len(ctx)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            # Candidate occurrences end at e = n-1 .. L-2 (followed by at least one token).
            windows = np.lib.stride_tricks.sliding_window_view(ctx[: L - 1], n)  # [L-n, n]
            hits = np.flatnonzero((windows == ctx[L - n:]).all(axis=1))  # window starts
            if not len(hits):
                continue
            # Extend each hit backwards while it keeps agreeing with the context.
            lengths = np.full(len(hits), n)
            alive = np.ones(len(hits), dtype=bool)
            for j in range(n, min(self.max_match, L - 1)):
                pos = hits - (j - n) - 1  # the token j before the suffix's end, for each hit
                ok = alive & (pos >= 0)
                ok[ok] = ctx[pos[ok]] == ctx[L - 1 - j]
                if not ok.any():
                    break
                lengths[ok] += 1
                alive = ok
            best = int(np.flatnonzero(lengths == lengths.max())[-1])  # longest, then most recent
            following = ctx[hits + n]
            return Match(int(lengths[best]), int(hits[best]) + n, bool((following == following[0]).all()))
        return Match(0, -1, False)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return Draft([])
        match = self.lookup(context)
        self.last_match_len = match.length
        if match.length == 0:
            return Draft([])
        return Draft([int(t) for t in context[match.start : match.start + k]])

    def observe(self, num_accepted: int) -> None:
        pass

    def finish(self, committed: Sequence[int]) -> None:
        pass


class ModelDrafter:
    """A smaller model on any backend drafts K tokens autoregressively.

    Greedy generations draft greedily (probs None); sampled ones draw each draft from the
    draft model's distribution shaped by the same Sampler and return it as probs [K, V].
    The draft's KV cache keeps the tokens it has seen; each proposal rolls it back to the
    longest prefix shared with the new context and feeds only the rest.

    vocab_subset: when > 0, the draft model computes logits only for token ids below it
    plus the prompt's tokens and the end-of-generation ids (FR-Spec, Zhao et al. 2025:
    the output projection over a large vocabulary is a large share of a small draft
    model's cost; BPE ids are roughly in merge order, so low ids are the frequent
    tokens). Drafts stay lossless: the target verifies every token against its full
    distribution, and a sampled draft's probs are exactly the restricted distribution it
    was drawn from. Needs a backend with ``set_output_subset`` (the torch backend).

    Raises IncompatibleVocabularyError at construction when the vocabularies differ
    (size, or the text of any token id), showing the first mismatches; SpecDecodeError
    when vocab_subset is negative or the backend cannot restrict its output.
    """

    name = "model"

    def __init__(self, backend: Backend, target: Backend | None = None, vocab_subset: int = 0) -> None:
        self.backend = backend
        if vocab_subset < 0:
            raise SpecDecodeError(f"draft vocabulary subset {vocab_subset} is out of range: expected >= 0 (0 = all)")
        if vocab_subset and not (hasattr(backend, "set_output_subset") and backend.supports_output_subset()):
            raise SpecDecodeError(
                f"a draft vocabulary subset needs a draft model on the torch backend (--draft-backend torch) "
                f"with a plain output head; {backend.name} on {type(backend).__name__} cannot restrict its output"
            )
        self.vocab_subset = vocab_subset
        if target is not None:
            check_vocab_compatible(backend, target)
        self._cached: list[int] = []
        self._sampler: Sampler | None = None
        # keep_drafting(i, p_cum) -> bool: asked before drafting token i+1 (i >= 1 drafted
        # so far) with p_cum the product of the draft model's top probabilities; set by the
        # cost-aware controller to stop drafting when further tokens will not pay.
        self.keep_drafting: Callable[[int, float], bool] | None = None

    def start(self, prompt_ids: Sequence[int], sampler: Sampler) -> None:
        self._sampler = sampler
        if self.vocab_subset:
            ids = set(range(min(self.vocab_subset, self.backend.n_vocab)))
            ids.update(int(t) for t in prompt_ids)
            ids.update(self.backend.eog_ids)
            self.backend.set_output_subset(ids)

    def pending(self, context: Sequence[int]) -> int:
        """Tokens of context this drafter would have to feed before drafting (not cached)."""
        return len(context) - common_prefix_len(self._cached, context)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        sampler = self._sampler
        assert sampler is not None, "start() must be called before propose()"
        k = min(k, self.backend.n_ctx - len(context))
        if k <= 0:
            return Draft([])
        keep = common_prefix_len(self._cached, context, len(context) - 1)  # feed at least one token
        self.backend.rollback(keep)
        self._cached = list(context[:keep])
        assert self.backend.kv_len == len(self._cached), "draft KV length must equal its cached tokens"

        if (sampler.params.greedy and not sampler.params.has_penalties and self.keep_drafting is None
                and hasattr(self.backend, "greedy_draft")):
            # The whole greedy draft on the device (torch): one host sync, not one per token.
            drafts = self.backend.greedy_draft(context[keep:], k)
            self._cached.extend(list(context[keep:]) + drafts[:-1])
            return Draft(drafts)
        history = list(context) if sampler.params.has_penalties else []
        drafts: list[int] = []
        rows: list[np.ndarray] = []
        logits = self.backend.forward(context[keep:], logits_for=[len(context) - keep - 1])[0]
        self._cached.extend(context[keep:])
        p_cum = 1.0
        for i in range(k):
            if sampler.params.greedy:
                tok = sampler.argmax(logits, history)
                if self.keep_drafting is not None:
                    z = logits - logits.max()
                    p_cum *= float(1.0 / np.exp(z).sum())
            else:
                q = sampler.probs(logits, history)
                tok = sampler.sample(q)
                rows.append(q)
                p_cum *= float(q.max())
            drafts.append(tok)
            if sampler.params.has_penalties:
                history.append(tok)
            if i + 1 < k and self.keep_drafting is not None and not self.keep_drafting(i + 1, p_cum):
                break
            if i + 1 < k:
                logits = self.backend.forward([tok], logits_for=[0])[0]
                self._cached.append(tok)
        probs = np.stack(rows) if rows else None
        return Draft(drafts, probs)

    def observe(self, num_accepted: int) -> None:
        pass

    def finish(self, committed: Sequence[int]) -> None:
        """End of a generation: drop cached tokens that are not part of the committed output."""
        keep = common_prefix_len(self._cached, committed)
        self.backend.rollback(keep)
        del self._cached[keep:]


def check_vocab_compatible(draft: Backend, target: Backend, show: int = 5) -> None:
    """Raise IncompatibleVocabularyError unless draft and target share the vocabulary.

    Same size, and the same token text for every id. The message names both models and
    shows up to ``show`` mismatching ids.
    """
    if draft.n_vocab != target.n_vocab:
        raise IncompatibleVocabularyError(
            f"draft vocabulary {draft.n_vocab} != target vocabulary {target.n_vocab} "
            f"(draft {draft.name}, target {target.name}): the draft model must share the target's tokenizer"
        )
    mismatches = []
    for i in range(target.n_vocab):
        if draft.token_text(i) != target.token_text(i):
            mismatches.append(i)
            if len(mismatches) >= show:
                break
    if mismatches:
        shown = ", ".join(f"id {i}: draft {draft.token_text(i)!r} vs target {target.token_text(i)!r}" for i in mismatches)
        raise IncompatibleVocabularyError(
            f"draft {draft.name} and target {target.name} have the same vocabulary size ({target.n_vocab}) "
            f"but different tokens: {shown}"
        )
