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
"""

from __future__ import annotations

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


class TextAssembler:
    """Accumulates committed token bytes and yields safe-to-stream text deltas.

    stop: stop strings (non-empty). After :meth:`add` reports a stop, ``num_tokens``
    and ``text`` are final and further calls are an error.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._stops = [s.encode("utf-8") for s in stop if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._buf = bytearray()
        self._token_starts: list[int] = []  # byte offset where each token's bytes start
        self._emitted = 0  # bytes already streamed
        self._scanned = 0  # stop strings cannot start before this offset - (max_stop - 1)
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
        for piece in pieces:
            self._token_starts.append(len(self._buf))
            self._buf += piece
        if self._stops:
            search_from = max(0, self._scanned - self._max_stop + 1)
            hits = [i for i in (self._buf.find(s, search_from) for s in self._stops) if i >= 0]
            self._scanned = len(self._buf)
            if hits:
                self._cut = min(hits)
                self.stopped = True
                return self._flush(self._cut, final=True), True
        return self._flush(len(self._buf) - self._holdback(), final=False), False

    def finish(self) -> str:
        """End of generation without a stop string: the rest of the text."""
        end = len(self._buf) if self._cut is None else self._cut
        return self._flush(end, final=True)

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(self._buf)), best, -1):
                if self._buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def _flush(self, end: int, final: bool) -> str:
        end = max(end, self._emitted)
        if not final:
            end = _utf8_safe_end(self._buf, self._emitted, end)
        delta = bytes(self._buf[self._emitted : end]).decode("utf-8", errors="replace")
        self._emitted = end
        if delta:
            self._deltas.append(delta)
        return delta
