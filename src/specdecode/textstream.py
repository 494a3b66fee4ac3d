"""Committed token bytes -> streamed text: whole UTF-8 characters, stop strings, exact cuts.

The engine feeds the bytes of each newly committed token. The assembler
- finds the earliest occurrence of any stop string in the text generated so far,
  including one that straddles tokens or steps;
- holds back a suffix that could still become a stop string, and the bytes of an
  incomplete UTF-8 character, so that no streamed text is ever retracted;
- cuts text and tokens at the same point when a stop string is found: the text ends
  just before the stop string, and the tokens kept are those that contribute at least
  one byte before it (a token whose bytes start at or after the stop string's first
  byte is dropped).

Deltas concatenate exactly to :attr:`TextAssembler.text` at the end.

Stop strings are matched by an Aho-Corasick automaton over their bytes (Aho, Corasick,
"Efficient string matching", CACM 1975), fed each new byte once: the cost per generated
byte does not grow with the number of stop strings, and the automaton's state is also the
longest suffix of the text that could still become a stop string (what is held back).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence


def _utf8_safe_end(buf: bytes | bytearray, start: int, end: int) -> int:
    """Largest e in [start, end] such that buf[start:e] does not end inside a UTF-8 character."""
    i = end - 1
    # Walk back over at most 3 continuation bytes to the lead byte of the last character.
    while i >= start and i > end - 4 and (buf[i] & 0xC0) == 0x80:
        i -= 1
    if i < start:
        return end  # only continuation bytes (invalid text): nothing to wait for
    lead = buf[i]
    if lead < 0x80:
        need = 1
    elif lead >= 0xF0:
        need = 4
    elif lead >= 0xE0:
        need = 3
    elif lead >= 0xC0:
        need = 2
    else:
        return end
    return end if end - i >= need else i


class StopMatcher:
    """Aho-Corasick automaton over stop strings (bytes, non-empty).

    :meth:`feed` reads bytes and returns the earliest start offset of a stop string that
    ends within them (None if none); :attr:`pending` is the length of the longest suffix of
    everything fed that is a prefix of some stop string.
    """

    def __init__(self, stops: Sequence[bytes]) -> None:
        self._goto: list[dict[int, int]] = [{}]
        self._depth = [0]
        terminal = [False]
        for s in stops:
            state = 0
            for b in s:
                nxt = self._goto[state].get(b)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[state][b] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[state] + 1)
                    terminal.append(False)
                state = nxt
            terminal[state] = True
        # fail[s]: the state of the longest proper suffix of s's string that is in the trie;
        # match[s]: the deepest terminal state on s's fail chain (itself included), or -1.
        self._fail = [0] * len(self._goto)
        self._match = [0 if terminal[0] else -1] + [-1] * (len(self._goto) - 1)
        queue = deque(self._goto[0].values())
        for child in queue:
            self._match[child] = child if terminal[child] else -1
        while queue:
            state = queue.popleft()
            for b, child in self._goto[state].items():
                f = self._fail[state]
                while f and b not in self._goto[f]:
                    f = self._fail[f]
                self._fail[child] = self._goto[f].get(b, 0) if self._goto[f].get(b, 0) != child else 0
                self._match[child] = child if terminal[child] else self._match[self._fail[child]]
                queue.append(child)
        self._state = 0
        self._fed = 0

    @property
    def pending(self) -> int:
        return self._depth[self._state]

    def feed(self, data: bytes | bytearray) -> int | None:
        goto, fail, match, depth = self._goto, self._fail, self._match, self._depth
        state, earliest = self._state, None
        for i, b in enumerate(data):
            while state and b not in goto[state]:
                state = fail[state]
            state = goto[state].get(b, 0)
            m = match[state]
            if m >= 0:
                start = self._fed + i + 1 - depth[m]
                earliest = start if earliest is None else min(earliest, start)
        self._state = state
        self._fed += len(data)
        return earliest


class TextAssembler:
    """Accumulates committed token bytes and yields safe-to-stream text deltas.

    stop: stop strings (non-empty). After :meth:`add` reports a stop, ``num_tokens``
    and ``text`` are final and further calls are an error.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        stops = [s.encode("utf-8") for s in stop if s]
        self._matcher = StopMatcher(stops) if stops else None
        self._buf = bytearray()
        self._token_starts: list[int] = []  # byte offset where each token's bytes start
        self._emitted = 0  # bytes already streamed
        self._cut: int | None = None  # byte offset of the stop string found
        self._deltas: list[str] = []
        self.stopped = False

    @property
    def num_tokens(self) -> int:
        """Tokens kept so far (after a stop: those that contribute bytes before it)."""
        if self._cut is None:
            return len(self._token_starts)
        return sum(1 for s in self._token_starts if s < self._cut)

    @property
    def text(self) -> str:
        """All text streamed so far; the final text once stopped or finished."""
        return "".join(self._deltas)

    def add(self, pieces: Sequence[bytes]) -> tuple[str, bool]:
        """Append the bytes of newly committed tokens; returns (delta text, stopped).

        When a stop string is found the delta covers the text up to it, and the caller
        must stop generating.
        """
        if self.stopped:
            raise RuntimeError("TextAssembler already stopped")
        start = len(self._buf)
        for piece in pieces:
            self._token_starts.append(len(self._buf))
            self._buf += piece
        if self._matcher is None:
            return self._flush(len(self._buf), final=False), False
        hit = self._matcher.feed(memoryview(self._buf)[start:])
        if hit is not None:
            self._cut = hit
            self.stopped = True
            return self._flush(self._cut, final=True), True
        return self._flush(len(self._buf) - self._matcher.pending, final=False), False

    def finish(self) -> str:
        """End of generation without a stop string: the rest of the text."""
        end = len(self._buf) if self._cut is None else self._cut
        return self._flush(end, final=True)

    def _flush(self, end: int, final: bool) -> str:
        end = max(end, self._emitted)
        if not final:
            end = _utf8_safe_end(self._buf, self._emitted, end)
        delta = bytes(self._buf[self._emitted : end]).decode("utf-8", errors="replace")
        self._emitted = end
        if delta:
            self._deltas.append(delta)
        return delta
