"""Logprobs in each endpoint's OpenAI shape, built on the worker thread (:mod:`.worker`)."""

from __future__ import annotations

import codecs
from typing import Callable


class LogprobsFormat:
    """TokenLogprob entries in the endpoint's OpenAI shape (built on the worker thread: the
    backend is only touched from it).

    A token need not hold whole characters: byte-level vocabularies split a multi-byte
    character over several tokens. Chat gives each token its UTF-8 ``bytes`` (a client
    joins them), and as ``token`` its text, with the bytes of an incomplete character
    escaped (``"\\xe6\\x97"``), never U+FFFD. Completions (legacy) write such a token
    as OpenAI does, ``"bytes:\\xe6\\x97"`` (every byte of the token escaped), and its
    text_offset counts the characters of the choice's text completed before the token's
    first byte (continuing across the chunks of a stream): a token inside a split
    character gets that character's offset, and no offset passes the text's end."""

    def __init__(self, kind: str, token_bytes: Callable[[int], bytes]) -> None:
        self.kind = kind
        self.token_bytes = token_bytes
        self.offset = 0  # characters completed so far
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        data = self.token_bytes(token_id)
        return {"token": data.decode("utf-8", errors="backslashreplace"), "logprob": logprob, "bytes": list(data)}

    def _legacy_token(self, token_id: int) -> str:
        data = self.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def format(self, entries: list) -> dict:
        """The logprobs object of these entries (the next ones of the choice)."""
        if self.kind == "chat":
            return {"content": [
                {**self._chat_entry(lp.token_id, lp.logprob),
                 "top_logprobs": [self._chat_entry(i, v) for i, _, v in lp.top_logprobs]}
                for lp in entries
            ], "refusal": None}
        offsets = []
        for lp in entries:
            offsets.append(self.offset)
            self.offset += len(self._decoder.decode(self.token_bytes(lp.token_id)))
        return {
            "tokens": [self._legacy_token(lp.token_id) for lp in entries],
            "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": [{self._legacy_token(i): v for i, _, v in lp.top_logprobs} for lp in entries],
            "text_offset": offsets,
        }
