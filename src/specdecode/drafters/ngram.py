"""Prompt lookup decoding: drafts copied from earlier in the text.

Sources: Saxena 2023 (prompt lookup decoding); transformers' ``prompt_lookup_num_tokens``;
vLLM's ``v1/spec_decode/ngram_proposer.py``.

Dimension letters: K = drafted tokens, L = context length.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import SpecDecodeError
from .base import ContextMemo, Draft, LookupDrafter, Match


class NgramDrafter(LookupDrafter):
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
        self._memo = ContextMemo(self._lookup)
        self._reset_index(None)

    def _reset_index(self, context: Sequence[int] | None) -> None:
        # n -> {n-gram: [end positions, ascending]} over the context read so far. A generation's
        # committed list only grows, so each step indexes only its new tokens, and a lookup
        # costs its occurrences, not a pass over the whole text.
        self._index: dict[int, dict[tuple, list[int]]] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        self._indexed = 0  # n-grams ending before this position are indexed
        self._of = context  # the list they were read from

    def fork(self, seq: int) -> "NgramDrafter":
        """The same lookup for another generation (it only reads that generation's context)."""
        return NgramDrafter(self.max_ngram, self.min_ngram, self.max_match)

    def start(self, prompt_ids: Sequence[int], sampler) -> None:
        self.last_match_len = 0
        self._memo.clear()
        self._reset_index(None)

    def lookup(self, context: Sequence[int]) -> Match:
        """The best earlier occurrence of the context's suffix (see Match).

        Its length is at least min_ngram and at most max_match; Match(0, -1, False) when no
        suffix of min_ngram tokens recurs. An ambiguous match (the n-gram was followed by
        different tokens at different places) is a much weaker guess than a unique one.
        A repeated call for the same context (the controller's plan, then propose) reuses
        the last answer: the engine's committed list only grows, so the same object at the
        same length is the same text.
        """
        return self._memo(context)

    def _lookup(self, context: Sequence[int]) -> Match:
        L = len(context)
        if context is not self._of or L < self._indexed:  # another text: read it from the start
            self._reset_index(context)
        for e in range(self._indexed, L - 1):  # an occurrence must be followed by a token: end <= L-2
            for n, table in self._index.items():
                if e >= n - 1:
                    table.setdefault(tuple(context[e - n + 1:e + 1]), []).append(e)
        self._indexed = max(self._indexed, L - 1)
        limit = min(self.max_match, L - 1)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            ends = self._index[n].get(tuple(context[L - n:]))
            if not ends:
                continue
            best_len, best_end, following = 0, -1, set()
            for e in ends:  # extend each occurrence backwards while it agrees with the text
                length, i, j = n, e - n, L - 1 - n
                while length < limit and i >= 0 and context[i] == context[j]:
                    length, i, j = length + 1, i - 1, j - 1
                if length >= best_len:  # longest, then most recent (ends ascend)
                    best_len, best_end = length, e
                following.add(context[e + 1])
            return Match(best_len, best_end + 1, len(following) == 1)
        return Match(0, -1, False)

    def available(self, context: Sequence[int]) -> int:
        """How many tokens a proposal after context can hold at most (0: no match)."""
        match = self.lookup(context)
        return len(context) - match.start if match.length else 0

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return Draft([])
        match = self.lookup(context)
        self.last_match_len = match.length
        if match.length == 0:
            return Draft([])
        return Draft([int(t) for t in context[match.start : match.start + k]])
