"""The suffix drafter's history (:class:`specdecode.drafters.suffix.SuffixDrafter`): earlier
requests' tokens in one buffer, a sorted n-gram index over them, and their eviction, least
recently used first, under a cap in tokens.

Dimension letters: N = stored history tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

# An index key packs the last 3 tokens ending at a position, newest in the high bits:
# c(t[p]) << 42 | c(t[p-1]) << 21 | c(t[p-2]), c(t) = t + 1 (0 before a sequence's start).
# Sorted, the keys of one 1-, 2- or 3-token suffix form one contiguous range. Ids from
# CLIP - 1 up share one component (vocabularies are far below 2^21 ids); matches there are
# checked token by token.
BITS = 21
CLIP = (1 << BITS) - 1


def _comp(t: np.ndarray) -> np.ndarray:
    return np.minimum(t.astype(np.int64) + 1, CLIP)


class SuffixStore:
    """Finished requests (prompt and output, as committed) in one int32 buffer [2 sentinels,
    seq 1, -1, seq 2, -1, ...] in the order stored; the drafter keeps the live request's
    tokens after ``used``. A -1 between sequences stops every comparison.

    Index: the history's n-gram keys (see BITS), sorted, with their end positions (int64
    keys [N], int32 positions [N]; positions with a following token only). A new sequence is
    merged in by :meth:`add` (np.searchsorted + np.insert).

    Memory: ``max_history_tokens`` caps the stored tokens. Past it, whole sequences are
    evicted least recently used first; a sequence is used when it is stored and when it
    supplies a draft the target accepts (:meth:`touch`). A sequence longer than the cap keeps
    its last tokens. Evicted space is reclaimed (the buffer compacted) once it exceeds the
    stored tokens.
    """

    def __init__(self, max_history_tokens: int) -> None:
        self.max_history_tokens = max_history_tokens
        self.buf = np.full(1 << 16, -1, dtype=np.int32)
        self.used = 2  # buffer slots taken by the history, sentinels included
        self.keys = np.zeros(0, dtype=np.int64)  # [N'] sorted
        self.pos = np.zeros(0, dtype=np.int32)  # [N'] end position of each key
        self.seqs: OrderedDict[int, tuple[int, int]] = OrderedDict()  # id -> (start, end), least recent first
        self.starts = np.zeros(0, dtype=np.int64)  # sequence starts in buffer order
        self.ids = np.zeros(0, dtype=np.int64)  # their ids
        self.next_id = 0
        self.stored = 0

    def grow(self, size: int) -> None:
        """Make the buffer hold at least size slots (new ones -1)."""
        if len(self.buf) < size:
            buf = np.full(max(size, 2 * len(self.buf)), -1, dtype=np.int32)
            buf[: len(self.buf)] = self.buf
            self.buf = buf

    def keys_at(self, a: int, b: int) -> np.ndarray:
        """Index keys [b - a] of the buffer positions a .. b-1 (a >= 2)."""
        buf = self.buf
        return (_comp(buf[a:b]) << (2 * BITS)) | (_comp(buf[a - 1:b - 1]) << BITS) | _comp(buf[a - 2:b - 2])

    def add(self, committed: Sequence[int]) -> None:
        """Store committed [L] as the most recently used sequence (its last
        max_history_tokens tokens), then evict down to the cap. The caller has cleared the
        live region (it is overwritten)."""
        tokens = np.asarray(committed, dtype=np.int64)[-self.max_history_tokens:]
        n = len(tokens)
        if n < 2:
            return
        s = self.used
        self.grow(s + n + 2)
        self.buf[s:s + n] = tokens
        self.used = s + n + 1  # buf[s + n] stays -1
        keys = self.keys_at(s, s + n - 1)  # positions followed by a token
        order = np.argsort(keys, kind="stable")
        at = np.searchsorted(self.keys, keys[order], side="right")  # after equal keys: positions ascend
        self.keys = np.insert(self.keys, at, keys[order])
        self.pos = np.insert(self.pos, at, (s + order).astype(np.int32))
        sid, self.next_id = self.next_id, self.next_id + 1
        self.seqs[sid] = (s, s + n)
        self.starts = np.append(self.starts, s)
        self.ids = np.append(self.ids, sid)
        self.stored += n
        self.evict()

    def touch(self, support: np.ndarray) -> None:
        """The sequences holding the buffer positions support [S] supplied an accepted draft:
        they become the most recently used."""
        seq = np.searchsorted(self.starts, support, side="right") - 1
        for sid in np.unique(self.ids[seq]).tolist():
            self.seqs.move_to_end(sid)

    def history(self) -> list[list[int]]:
        """The stored sequences, least recently used first."""
        return [self.buf[s:e].tolist() for s, e in self.seqs.values()]

    def state(self) -> tuple:
        """The stored history as an opaque copy, for :meth:`set_state`."""
        return (self.buf[:self.used].copy(), self.used, self.keys.copy(), self.pos.copy(), OrderedDict(self.seqs),
                self.starts.copy(), self.ids.copy(), self.next_id, self.stored)

    def set_state(self, state: tuple) -> None:
        """Put back a history taken by :meth:`state` (the live region is cleared)."""
        buf, used, keys, pos, seqs, starts, ids, next_id, stored = state
        self.buf = np.full(max(1 << 16, 2 * used), -1, dtype=np.int32)
        self.buf[:used] = buf
        self.used, self.keys, self.pos, self.seqs = used, keys.copy(), pos.copy(), OrderedDict(seqs)
        self.starts, self.ids, self.next_id, self.stored = starts.copy(), ids.copy(), next_id, stored

    def evict(self) -> None:
        """Drop the least recently used sequences until the cap holds."""
        if self.stored <= self.max_history_tokens:
            return
        gone = []
        while self.stored > self.max_history_tokens:
            sid, (s, e) = self.seqs.popitem(last=False)
            self.buf[s:e] = -1
            self.stored -= e - s
            gone.append(sid)
        keep_seq = ~np.isin(self.ids, gone)
        keep = keep_seq[np.searchsorted(self.starts, self.pos, side="right") - 1]
        self.keys, self.pos = self.keys[keep], self.pos[keep]
        self.starts, self.ids = self.starts[keep_seq], self.ids[keep_seq]
        dead = self.used - 2 - self.stored - len(self.ids)
        if dead > max(self.stored, 1024):
            self.compact()

    def compact(self) -> None:
        """Move the stored sequences together (same order), remapping the index."""
        bounds = [self.seqs[sid] for sid in self.ids.tolist()]
        lens = np.array([e - s for s, e in bounds], dtype=np.int64)
        new_starts = 2 + np.concatenate([[0], np.cumsum(lens + 1)[:-1]]).astype(np.int64)
        buf = np.full(max(1 << 16, 2 * (self.stored + len(lens) + 2)), -1, dtype=np.int32)
        for (s, e), ns in zip(bounds, new_starts.tolist()):
            buf[ns:ns + e - s] = self.buf[s:e]
        seq = np.searchsorted(self.starts, self.pos, side="right") - 1
        self.pos = (self.pos - self.starts[seq] + new_starts[seq]).astype(np.int32)
        for sid, ns, n in zip(self.ids.tolist(), new_starts.tolist(), lens.tolist()):
            self.seqs[sid] = (ns, ns + n)  # updating a key keeps its LRU place
        self.buf, self.starts = buf, new_starts
        self.used = int(new_starts[-1] + lens[-1] + 1) if len(lens) else 2
