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
from collections import OrderedDict
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import SpecDecodeError
from ..limits import MAX_NUM_SPECULATIVE_TOKENS
from .base import ContextMemo, Draft, LookupDrafter, Match, StepOutcome

# An index key packs the last 3 tokens ending at a position, newest in the high bits:
# c(t[p]) << 42 | c(t[p-1]) << 21 | c(t[p-2]), c(t) = t + 1 (0 before a sequence's start).
# Sorted, the keys of one 1-, 2- or 3-token suffix form one contiguous range. Ids from
# CLIP - 1 up share one component (vocabularies are far below 2^21 ids); matches there are
# checked token by token.
BITS = 21
CLIP = (1 << BITS) - 1
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


def _comp(t: np.ndarray) -> np.ndarray:
    return np.minimum(t.astype(np.int64) + 1, CLIP)


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

    Storage: one int32 token buffer [2 sentinels, seq 1, -1, seq 2, -1, ..., live request,
    -1 ...]: finished requests (prompt and output, as committed) in the order stored,
    then the current request's context (the *live* region, mirrored from the committed
    list at each lookup). A -1 between sequences stops every comparison, so no match or
    continuation crosses two requests.

    Index: the history's n-gram keys (see BITS), sorted, with their end positions (int64
    keys [N], int32 positions [N]; positions with a following token only). A new
    sequence is merged in at finish (np.searchsorted + np.insert). The live region keeps
    its keys unsorted [L] and is scanned (one comparison per token, ~10 us at L = 4k).

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

    Memory: ``max_history_tokens`` caps the stored history (tokens; the live request is
    not counted). Past it, whole sequences are evicted least recently used first; a
    sequence is used when it is stored and when it supplies a draft the target accepts
    (in part). A finished request longer than the cap keeps its last tokens. Evicted
    space is reclaimed (the buffer compacted) once it exceeds the stored tokens.

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
        self._buf = np.full(1 << 16, -1, dtype=np.int32)
        self._used = 2  # buffer slots taken by the history, sentinels included
        self._keys = np.zeros(0, dtype=np.int64)  # [N'] sorted
        self._pos = np.zeros(0, dtype=np.int32)  # [N'] end position of each key
        self._seqs: OrderedDict[int, tuple[int, int]] = OrderedDict()  # id -> (start, end), least recent first
        self._starts = np.zeros(0, dtype=np.int64)  # sequence starts in buffer order
        self._ids = np.zeros(0, dtype=np.int64)  # their ids
        self._next_id = 0
        self._stored = 0
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
            seq = np.searchsorted(self._starts, support, side="right") - 1
            for sid in np.unique(self._ids[seq]).tolist():
                self._seqs.move_to_end(sid)

    def finish(self, committed: Sequence[int]) -> None:
        """Store committed [L] (the request's prompt and emitted output, nothing else) as
        the most recently used sequence, then evict down to the cap."""
        self._reset_live()
        tokens = np.asarray(committed, dtype=np.int64)[-self.max_history_tokens:]
        n = len(tokens)
        if n < 2:
            return
        s = self._used
        self._grow(s + n + 2)
        self._buf[s:s + n] = tokens
        self._used = s + n + 1  # buf[s + n] stays -1
        keys = self._keys_at(s, s + n - 1)  # positions followed by a token
        order = np.argsort(keys, kind="stable")
        at = np.searchsorted(self._keys, keys[order], side="right")  # after equal keys: positions ascend
        self._keys = np.insert(self._keys, at, keys[order])
        self._pos = np.insert(self._pos, at, (s + order).astype(np.int32))
        sid, self._next_id = self._next_id, self._next_id + 1
        self._seqs[sid] = (s, s + n)
        self._starts = np.append(self._starts, s)
        self._ids = np.append(self._ids, sid)
        self._stored += n
        self._evict()

    def history_state(self) -> tuple:
        """The stored history, as an opaque value for :meth:`set_history_state` (a copy: later
        requests do not change it). The bench runs a prompt a second time (with its prediction)
        from the history as it was before the first run, so that the second does not find the
        answer the first just stored."""
        return (self._buf[:self._used].copy(), self._used, self._keys.copy(), self._pos.copy(), OrderedDict(self._seqs),
                self._starts.copy(), self._ids.copy(), self._next_id, self._stored)

    def set_history_state(self, state: tuple) -> None:
        """Put back a history taken by :meth:`history_state` (the live request is dropped)."""
        buf, used, keys, pos, seqs, starts, ids, next_id, stored = state
        self._buf = np.full(max(1 << 16, 2 * used), -1, dtype=np.int32)
        self._buf[:used] = buf
        self._used, self._keys, self._pos, self._seqs = used, keys.copy(), pos.copy(), OrderedDict(seqs)
        self._starts, self._ids, self._next_id, self._stored = starts.copy(), ids.copy(), next_id, stored
        self._live_len = 0
        self._reset_live()

    # -- inspection ------------------------------------------------------------------

    @property
    def stored_tokens(self) -> int:
        """Tokens held in the history (the cap's unit)."""
        return self._stored

    def history(self) -> list[list[int]]:
        """The stored sequences, least recently used first."""
        return [self._buf[s:e].tolist() for s, e in self._seqs.values()]

    # -- storage ---------------------------------------------------------------------

    def _grow(self, size: int) -> None:
        if len(self._buf) < size:
            buf = np.full(max(size, 2 * len(self._buf)), -1, dtype=np.int32)
            buf[: len(self._buf)] = self._buf
            self._buf = buf

    def _keys_at(self, a: int, b: int) -> np.ndarray:
        """Index keys [b - a] of the buffer positions a .. b-1 (a >= 2)."""
        buf = self._buf
        return (_comp(buf[a:b]) << (2 * BITS)) | (_comp(buf[a - 1:b - 1]) << BITS) | _comp(buf[a - 2:b - 2])

    def _reset_live(self) -> None:
        self._buf[self._used:self._used + self._live_len] = -1
        self._live_ctx, self._live_len = None, 0
        self._memo.clear()
        self._support = None
        self.last_match_len = 0

    def _sync(self, context: Sequence[int]) -> None:
        """Mirror context into the live region: only the new tokens when context is the
        object seen last, grown (the engine's committed list only grows)."""
        L, n, ls = len(context), self._live_len, self._used
        if not (context is self._live_ctx and n <= L and (n == 0 or self._buf[ls + n - 1] == context[n - 1])):
            self._buf[ls:ls + n] = -1
            n = 0
        if L > n:
            self._grow(ls + L + 1)
            self._buf[ls + n:ls + L] = np.asarray(context[n:], dtype=np.int64)
            if len(self._live_keys) < L:
                keys = np.zeros(max(L, 2 * len(self._live_keys)), dtype=np.int64)
                keys[:n] = self._live_keys[:n]
                self._live_keys = keys
            self._live_keys[n:L] = self._keys_at(ls + n, ls + L)
        self._live_ctx, self._live_len = context, L

    def _evict(self) -> None:
        if self._stored <= self.max_history_tokens:
            return
        gone = []
        while self._stored > self.max_history_tokens:
            sid, (s, e) = self._seqs.popitem(last=False)
            self._buf[s:e] = -1
            self._stored -= e - s
            gone.append(sid)
        keep_seq = ~np.isin(self._ids, gone)
        keep = keep_seq[np.searchsorted(self._starts, self._pos, side="right") - 1]
        self._keys, self._pos = self._keys[keep], self._pos[keep]
        self._starts, self._ids = self._starts[keep_seq], self._ids[keep_seq]
        dead = self._used - 2 - self._stored - len(self._ids)
        if dead > max(self._stored, 1024):
            self._compact()

    def _compact(self) -> None:
        """Move the stored sequences together (same order), remapping the index."""
        bounds = [self._seqs[sid] for sid in self._ids.tolist()]
        lens = np.array([e - s for s, e in bounds], dtype=np.int64)
        new_starts = 2 + np.concatenate([[0], np.cumsum(lens + 1)[:-1]]).astype(np.int64)
        buf = np.full(max(1 << 16, 2 * (self._stored + len(lens) + 2)), -1, dtype=np.int32)
        for (s, e), ns in zip(bounds, new_starts.tolist()):
            buf[ns:ns + e - s] = self._buf[s:e]
        seq = np.searchsorted(self._starts, self._pos, side="right") - 1
        self._pos = (self._pos - self._starts[seq] + new_starts[seq]).astype(np.int32)
        for sid, ns, n in zip(self._ids.tolist(), new_starts.tolist(), lens.tolist()):
            self._seqs[sid] = (ns, ns + n)  # updating a key keeps its LRU place
        self._buf, self._starts = buf, new_starts
        self._used = int(new_starts[-1] + lens[-1] + 1) if len(lens) else 2

    # -- lookup ----------------------------------------------------------------------

    def _plan(self, context: Sequence[int]) -> _Plan:
        return self._memo(context)

    def _compute(self, context: Sequence[int]) -> _Plan:
        self._sync(context)
        L, ls, buf = len(context), self._used, self._buf
        if L == 0:
            return _NONE
        end = ls + L - 1  # the context's last token in the buffer
        qkey = int(self._live_keys[L - 1])
        live_keys = self._live_keys[: L - 1]  # live positions followed by a token
        for n in range(min(3, L), 0, -1):
            shift = BITS * (3 - n)
            prefix = qkey >> shift
            hi = int(np.searchsorted(self._keys, ((prefix + 1) << shift) - 1, side="right"))  # <= 2^63 - 1
            lo = max(int(np.searchsorted(self._keys, prefix << shift)), hi - self.max_candidates)
            live = np.flatnonzero((live_keys >> shift if shift else live_keys) == prefix)[-self.max_candidates:]
            if hi <= lo and not len(live):
                continue
            P = np.concatenate([self._pos[lo:hi].astype(np.int64), live + ls])  # [C] end positions
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
        buf = self._buf
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
        buf = self._buf
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
