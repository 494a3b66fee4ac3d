"""Prompt lookup decoding: drafts copied from earlier in the text.

Sources: Saxena 2023 (prompt lookup decoding); transformers' ``prompt_lookup_num_tokens``;
vLLM's ``v1/spec_decode/ngram_proposer.py``.

Dimension letters: K = drafted tokens, L = context length.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

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

    def fork(self, seq: int) -> "NgramDrafter":
        """The same lookup for another generation (it only reads that generation's context)."""
        return NgramDrafter(self.max_ngram, self.min_ngram, self.max_match)

    def start(self, prompt_ids: Sequence[int], sampler) -> None:
        self.last_match_len = 0
        self._memo.clear()

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
