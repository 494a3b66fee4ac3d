"""Suffix drafting across requests: continue the context the way earlier text continued.

Source: Oliaro et al., "SuffixDecoding: A Model-Free Approach to Speeding Up Large-Language
Model Inference" (2024, arXiv:2411.04975). The paper keeps suffix trees over earlier
outputs and over the current request, matches the longest suffix of the context, grows a
speculation tree from the matched node by the frequency of each continuation, scores a path
by the product of its empirical probabilities, and scales the draft size with the match length.

What is simplified here:

- One path instead of a speculation tree: the engine verifies a single draft, so at each
  step the most frequent next token is taken (ties: the most recently stored occurrence).
- No suffix tree: the statistics are computed on demand from the set of occurrences of the
  matched text, found in a sorted n-gram index (see :class:`SuffixDrafter`). They are the
  counts a suffix tree node would hold: how often each next token followed the matched
  text, over all its occurrences (at most ``max_candidates`` of them).
- Prompts are stored with outputs (the paper's global tree holds outputs): a request that
  repeats an earlier prompt, or quotes it, is drafted from it.

Dimension letters: K = drafted tokens, L = context length, N = stored history tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import SpecDecodeError
from ..limits import MAX_NUM_SPECULATIVE_TOKENS
from .base import ContextMemo, Draft, LookupDrafter, Match, StepOutcome
from .suffix_store import BITS, CLIP, SuffixStore

BLOCK = 16  # tokens compared per numpy call when extending a match or walking a continuation
MANY = 256  # above this many occurrences, extend token by token (a [C, BLOCK] gather would cost more)
SUPPORT_MAX = 64  # history occurrences remembered per proposal, to mark their sequences used
# The default history cap: 1 M tokens is 16 MB (4 B per token in the buffer, 12 B in the
# index), a finish() at the cap costs a few ms (O(N) numpy copies), and a proposal does
# not depend on N (binary search, then work on the occurrences found). It holds a few
# thousand typical requests, prompts included.
DEFAULT_HISTORY_TOKENS = 1_000_000
# The default confidence floor: a draft token's share is the empirical chance that the
# target continues that way, so drafting it is worth about (product of the shares) tokens,
# and costs one more verified position: on a GPU (memory-bound) a few percent of a step,
# on a compute-bound CPU over half of one. The controller passes its own rule from the
# measured costs and per-kind acceptance (it picks K); this floor serves a fixed K, which
# is chosen where verification is cheap. 0.1 drops ambiguous guesses, keeps 2-to-1 majorities for a
# few tokens (0.67, 0.44, 0.30, 0.20, 0.13), and every unanimous one (1.0).
DEFAULT_MIN_CONFIDENCE = 0.1


class _Plan(NamedTuple):
    """What a lookup found: the match, the continuation (tokens [K'] with the confidence
    after each, the product of the shares so far) and history occurrences behind it."""

    match: Match
    tokens: list[int]
    confs: list[float]
    support: np.ndarray | None


_NONE = _Plan(Match(0, -1, False), [], [], None)


class SuffixDrafter(LookupDrafter):
    """Drafts from the current request and from earlier requests seen by this instance.

    Storage: the history is a :class:`SuffixStore` (earlier requests in one buffer, a sorted
    n-gram index, eviction least recently used first under ``max_history_tokens``); the
    current request's context follows it in the same buffer (the *live* region, mirrored
    from the committed list at each lookup), its keys unsorted [L] and scanned (one
    comparison per token, ~10 us at L = 4k).

    Lookup: the occurrences of the context's last 3 (else 2, else 1) tokens in both, at
    most ``max_candidates`` of each (the most recent); each is extended backwards while it
    agrees with the context, up to ``max_depth`` tokens, 16 tokens per numpy call; the
    occurrences that agree furthest are the matched text's (match length m). From them
    the continuation is walked forward: where all agree, 16 tokens per call; else the most
    frequent next token (its share = count / occurrences with a known next token) is taken
    and the occurrences narrowed to those it followed. The walk stops at k tokens, at
    ``max_spec_factor`` * m tokens (the paper's adaptive bound: a short match predicts a
    short draft), at the end of every occurrence, or when the confidence (product of the
    shares) would fall below ``min_confidence``.

    Units: tokens for every length; the proposal's cost is reported by the controller.
    Drafts are deterministic, so probs is None (one-hot); any sampler is served.
    """

    name = "suffix"

    def __init__(self, max_depth: int = 64, max_history_tokens: int = DEFAULT_HISTORY_TOKENS,
                 min_confidence: float = DEFAULT_MIN_CONFIDENCE, max_spec_factor: float = 1.0,
                 max_draft: int = MAX_NUM_SPECULATIVE_TOKENS, max_candidates: int = 4096) -> None:
        if max_depth < 1 or max_history_tokens < 1 or max_draft < 1 or max_candidates < 1:
            raise SpecDecodeError(
                f"suffix drafter sizes must be >= 1: max_depth = {max_depth}, max_history_tokens = "
                f"{max_history_tokens}, max_draft = {max_draft}, max_candidates = {max_candidates}")
        if not 0.0 <= min_confidence <= 1.0 or max_spec_factor <= 0:
            raise SpecDecodeError(f"min_confidence = {min_confidence} must be in [0, 1] and max_spec_factor = "
                                  f"{max_spec_factor} > 0")
        self.max_depth = max_depth
        self.max_history_tokens = max_history_tokens
        self.min_confidence = min_confidence
        self.max_spec_factor = max_spec_factor
        self.max_draft = max_draft
        self.max_candidates = max_candidates
        self.last_match_len = 0
        self.store = SuffixStore(max_history_tokens)  # the history; the live request follows it in store.buf
        self._live_keys = np.zeros(1 << 12, dtype=np.int64)
        self._live_ctx: Sequence[int] | None = None
        self._live_len = 0
        self._memo = ContextMemo(self._compute)  # the last _Plan, per context
        self._support: np.ndarray | None = None  # history positions behind the last proposal

    # -- the Drafter protocol --------------------------------------------------------

    def fork(self, seq: int) -> "SuffixDrafter":
        """A suffix drafter with the same settings and its own history, for another
        concurrent generation (one history buffer cannot hold two live requests): each
        slot learns from the requests it served; a slot is chosen by the longest cached
        prefix, so repeats of a prompt tend to meet their history."""
        return SuffixDrafter(self.max_depth, self.max_history_tokens, self.min_confidence, self.max_spec_factor,
                             self.max_draft, self.max_candidates)

    def start(self, prompt_ids: Sequence[int], sampler) -> None:
        self._reset_live()

    def lookup(self, context: Sequence[int]) -> Match:
        """The longest suffix of context [L] (up to max_depth tokens) found in this request
        or the history: Match(length, start, unique), start being the index in context of
        the first token to propose when an occurrence in this request supports it, -1 when
        only the history does. Match(0, -1, False) when no token of the suffix recurs. A
        repeated call for the same context object and length reuses the answer."""
        return self._plan(context).match

    def available(self, context: Sequence[int]) -> int:
        """How many tokens a proposal after context can hold at most (0: nothing to say)."""
        return len(self._plan(context).tokens)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return Draft([])
        plan = self._plan(context)
        self.last_match_len = plan.match.length
        # No token-by-token cost rule here: the controller already chose k from this kind
        # of match's measured acceptance and the whole T(n) curve, and a myopic rule
        # (T(i+2) - T(i+1) against one plain step) cuts long blocks where the curve bends.
        tokens = plan.tokens[:k]
        self._support = plan.support if tokens else None
        return Draft(list(tokens))

    def observe(self, outcome: StepOutcome) -> None:
        support, self._support = self._support, None
        if outcome.num_accepted > 0 and support is not None and len(support):
            self.store.touch(support)

    def finish(self, committed: Sequence[int]) -> None:
        """Store committed [L] (the request's prompt and emitted output, nothing else) as
        the most recently used sequence, then evict down to the cap."""
        self._reset_live()
        self.store.add(committed)

    def history_state(self) -> tuple:
        """The stored history, as an opaque value for :meth:`set_history_state` (a copy: later
        requests do not change it). The bench runs a prompt a second time (with its prediction)
        from the history as it was before the first run, so that the second does not find the
        answer the first just stored."""
        return self.store.state()

    def set_history_state(self, state: tuple) -> None:
        """Put back a history taken by :meth:`history_state` (the live request is dropped)."""
        self.store.set_state(state)
        self._live_len = 0
        self._reset_live()

    # -- inspection ------------------------------------------------------------------

    @property
    def stored_tokens(self) -> int:
        """Tokens held in the history (the cap's unit)."""
        return self.store.stored

    def history(self) -> list[list[int]]:
        """The stored sequences, least recently used first."""
        return self.store.history()

    # -- the live request ------------------------------------------------------------

    def _reset_live(self) -> None:
        self.store.buf[self.store.used:self.store.used + self._live_len] = -1
        self._live_ctx, self._live_len = None, 0
        self._memo.clear()
        self._support = None
        self.last_match_len = 0

    def _sync(self, context: Sequence[int]) -> None:
        """Mirror context into the live region: only the new tokens when context is the
        object seen last, grown (the engine's committed list only grows)."""
        L, n, ls = len(context), self._live_len, self.store.used
        if not (context is self._live_ctx and n <= L and (n == 0 or self.store.buf[ls + n - 1] == context[n - 1])):
            self.store.buf[ls:ls + n] = -1
            n = 0
        if L > n:
            self.store.grow(ls + L + 1)
            self.store.buf[ls + n:ls + L] = np.asarray(context[n:], dtype=np.int64)
            if len(self._live_keys) < L:
                keys = np.zeros(max(L, 2 * len(self._live_keys)), dtype=np.int64)
                keys[:n] = self._live_keys[:n]
                self._live_keys = keys
            self._live_keys[n:L] = self.store.keys_at(ls + n, ls + L)
        self._live_ctx, self._live_len = context, L

    # -- lookup ----------------------------------------------------------------------

    def _plan(self, context: Sequence[int]) -> _Plan:
        return self._memo(context)

    def _compute(self, context: Sequence[int]) -> _Plan:
        self._sync(context)
        L, ls, buf = len(context), self.store.used, self.store.buf
        if L == 0:
            return _NONE
        end = ls + L - 1  # the context's last token in the buffer
        qkey = int(self._live_keys[L - 1])
        live_keys = self._live_keys[: L - 1]  # live positions followed by a token
        for n in range(min(3, L), 0, -1):
            shift = BITS * (3 - n)
            prefix = qkey >> shift
            hi = int(np.searchsorted(self.store.keys, ((prefix + 1) << shift) - 1, side="right"))  # <= 2^63 - 1
            lo = max(int(np.searchsorted(self.store.keys, prefix << shift)), hi - self.max_candidates)
            live = np.flatnonzero((live_keys >> shift if shift else live_keys) == prefix)[-self.max_candidates:]
            if hi <= lo and not len(live):
                continue
            P = np.concatenate([self.store.pos[lo:hi].astype(np.int64), live + ls])  # [C] end positions
            if buf[end - n + 1:end + 1].max() >= CLIP - 1:  # clipped ids share a key component
                for j in range(n):
                    P = P[buf[P - j] == buf[end - j]]
                if not len(P):
                    continue
            P, m = self._extend(P, n, end, min(self.max_depth, L))
            return self._walk(P, m, ls)
        return _NONE

    def _extend(self, P: np.ndarray, j: int, end: int, depth: int) -> tuple[np.ndarray, int]:
        """Keep the occurrences P [C] (each agreeing with the context's last j tokens) that
        agree furthest back, up to depth tokens; returns them and that length."""
        buf = self.store.buf
        while j < depth:
            if len(P) > MANY:
                ok = buf.take(P - j, mode="clip") == buf[end - j]
                if not ok.any():
                    break
                P, j = P[ok], j + 1
                continue
            offs = np.arange(j, min(j + BLOCK, depth))
            eq = buf.take(P[:, None] - offs, mode="clip") == buf[end - offs]  # [C, b]
            full = eq.all(axis=1)
            if full.any():
                P, j = P[full], j + len(offs)
                continue
            agree = eq.argmin(axis=1)  # tokens agreeing before the first difference
            best = int(agree.max())
            return P[agree == best], j + best
        return P, j

    def _walk(self, S: np.ndarray, m: int, ls: int) -> _Plan:
        """The continuation from the occurrences S [C] of the matched text (m tokens)."""
        buf = self.store.buf
        kmax = min(self.max_draft, max(1, math.ceil(self.max_spec_factor * m)))
        tokens: list[int] = []
        confs: list[float] = []
        conf, i = 1.0, 1  # i: offset of the next token after each occurrence
        unique: bool | None = None
        first: np.ndarray | None = None  # occurrences that supported the first token
        while len(tokens) < kmax:
            r = kmax - len(tokens)
            if len(S) == 1:
                seg = buf[int(S[0]) + i:int(S[0]) + i + r]
                stop = np.flatnonzero(seg < 0)
                seg = seg[: stop[0]] if len(stop) else seg
                tokens += seg.tolist()
                confs += [conf] * len(seg)
                if unique is None:
                    unique, first = len(seg) > 0, S
                break
            W = buf.take(S[:, None] + (i + np.arange(min(BLOCK, r))), mode="clip")  # [C, b]
            agree = (W == W[0]).all(axis=0) & (W[0] >= 0)
            na = len(agree) if agree.all() else int(agree.argmin())
            if na:
                tokens += W[0, :na].tolist()
                confs += [conf] * na
                i += na
                if unique is None:
                    unique, first = True, S
                if na == len(agree):
                    continue
            nxt = W[:, na]  # [C] the token after each occurrence (-1: none known)
            known = nxt[nxt >= 0]
            if not len(known):
                break
            vals, counts = np.unique(known, return_counts=True)
            top = counts.max()
            if unique is None:
                unique = len(vals) == 1
            tied = vals[counts == top]
            tok = int(tied[0]) if len(tied) == 1 else int(nxt[np.flatnonzero(np.isin(nxt, tied))[-1]])
            share = float(top) / len(known)
            if conf * share < self.min_confidence:
                break
            conf *= share
            S = S[nxt == tok]
            tokens.append(tok)
            confs.append(conf)
            i += 1
            if first is None:
                first = S
        if not tokens:
            return _Plan(Match(m, -1, bool(unique)), [], [], None)
        live = first[first >= ls]
        start = int(live[-1]) - ls + 1 if len(live) else -1
        hist = first[first < ls][-SUPPORT_MAX:]
        return _Plan(Match(m, start, bool(unique)), tokens, confs, hist)
