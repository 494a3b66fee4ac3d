"""Prompt lookup decoding: drafts copied from earlier in the text.

Sources: Saxena 2023 (prompt lookup decoding); transformers' ``prompt_lookup_num_tokens``;
vLLM's ``v1/spec_decode/ngram_proposer.py``.

Dimension letters: K = drafted tokens, L = context length.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import SpecDecodeError
from .base import ContextMemo, Draft, LookupDrafter, Match
from .tree import TreeDrafting


class NgramDrafter(LookupDrafter, TreeDrafting):
    """Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``).

    Find earlier occurrences (prompt and generated text) of the last n tokens of the
    context, n from max_ngram down to min_ngram; propose the up to k tokens that followed
    the occurrence whose match extends furthest back (its *match length*, counted up to
    ``max_match`` tokens; ties go to the most recent). A long match means the text is being
    copied, so its continuation is likely right: :meth:`lookup` exposes the match length,
    and the cost-aware controller keeps an acceptance estimate per match length.
    Drafts are deterministic, so probs is None (one-hot). With a tree budget
    (:class:`specdecode.drafters.tree.TreeDrafting`) an ambiguous match of a greedy generation drafts a tree
    instead: the trie of the ``tree_width`` best occurrences' continuations (longest match,
    then most recent), each node's probability the share of the occurrences through it, the
    r-th best weighing 1 / r (so the first path is the chain's draft).
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
        self._sampler = None
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
        self._sampler = sampler
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
        if not match.unique and self._sampler is not None and self.drafts_tree(self._sampler):
            return self._tree(context, k)
        return Draft([int(t) for t in context[match.start : match.start + k]])

    def _tree(self, context: Sequence[int], k: int) -> Draft:
        """The trie of the continuations (k tokens each) of the best tree_width occurrences of
        the longest recurring suffix, node probability = weight of the occurrences through it
        / their total weight (the r-th best weighs 1 / r)."""
        L = len(context)
        n = next(n for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1)
                 if self._index[n].get(tuple(context[L - n:])))
        ends = self._index[n][tuple(context[L - n:])]
        def length(e: int) -> int:  # noqa: E306
            m, i, j = n, e - n, L - 1 - n
            while m < self.max_match and i >= 0 and context[i] == context[j]:
                m, i, j = m + 1, i - 1, j - 1
            return m
        best = sorted(ends, key=lambda e: (length(e), e), reverse=True)[:self.tree_width]
        weights = [1.0 / (r + 1) for r in range(len(best))]  # the best occurrence outweighs the rest together
        nodes: dict[tuple, list] = {}  # path -> [weight, parent path]
        for e, w in zip(best, weights):
            cont = tuple(int(t) for t in context[e + 1:e + 1 + k])
            for d in range(1, len(cont) + 1):
                nodes.setdefault(cont[:d], [0.0, cont[:d - 1]])[0] += w
        order = sorted(nodes, key=lambda path: (-nodes[path][0], len(path)))[:self.tree_nodes]
        index = {path: i for i, path in enumerate(order)}
        return Draft([path[-1] for path in order], None, [index.get(nodes[path][1], -1) for path in order],
                     [nodes[path][0] / sum(weights) for path in order])
