"""Two vocabularies matched by their text, for a draft model whose tokenizer is not the
target's (Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding
Algorithms for Heterogeneous Vocabularies", ICML 2025: Section 3's string-level exact match
re-reads text between the two tokenizers; Section 4's token-level intersection drafts only
the tokens both vocabularies have).

A token's text is what it renders as (:func:`render`): its bytes (``token_bytes``: GPT-2's
``Ġ`` and SentencePiece's ``▁`` word-start markers are already spaces there), or for a control
token (which renders as no bytes) its marker (``<|im_end|>``). Two ids are the same token when
they render the same non-empty text; padding and unused ids render as nothing and match
nothing.

Dimension letters: Vd = draft vocabulary size, Vt = target vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .base import Backend


def render(backend: Backend, token_id: int) -> bytes:
    """The text a token stands for in a context: its bytes, or a control token's marker
    (b"" for padding and unused ids, which stand for nothing)."""
    piece = backend.token_bytes(token_id)
    if piece:
        return piece
    if token_id in backend.eog_ids or _is_marker(backend, token_id):
        return backend.token_text(token_id)
    return b""


def _is_marker(backend: Backend, token_id: int) -> bool:
    """A control token whose text the tokenizer reads back as that token (``<|im_start|>``),
    as opposed to padding (``[PAD151700]``)."""
    text = backend.token_text(token_id)
    try:
        return text.decode("utf-8") in backend.special_texts
    except UnicodeDecodeError:
        return False


def _texts(backend: Backend) -> list[bytes]:
    return [render(backend, i) for i in range(backend.n_vocab)]


@dataclass
class VocabMap:
    """Which draft ids are target ids with the same text.

    d2t: [Vd] int64, the target id of each draft id with the same text, -1 where the target
        has none. t2d: [Vt] int64, the converse. shared: ids both have (the intersection).
    draft_eog_to_target: a draft end-of-generation id -> the target's id of the same marker
        (``<|im_end|>`` in both ChatML vocabularies), where the target has it and it ends
        the target's generation too.
    """

    draft_name: str
    target_name: str
    d2t: np.ndarray
    t2d: np.ndarray
    draft_eog_to_target: dict[int, int] = field(default_factory=dict)

    @property
    def shared(self) -> int:
        return int((self.d2t >= 0).sum())

    @property
    def draft_size(self) -> int:
        return len(self.d2t)

    @property
    def target_size(self) -> int:
        return len(self.t2d)

    def overlap_note(self) -> str:
        """One line: how many ids the vocabularies share."""
        return (f"{self.shared:,} token texts shared ({100 * self.shared / max(1, self.draft_size):.0f}% of draft "
                f"{self.draft_name}'s {self.draft_size:,} ids, {100 * self.shared / max(1, self.target_size):.0f}% of "
                f"target {self.target_name}'s {self.target_size:,})")


def build_vocab_map(draft: Backend, target: Backend) -> VocabMap:
    """Match the two vocabularies by text (about a second for 150k + 50k ids on llama.cpp).

    Where one text has several target ids (a byte also has a byte-fallback token), the lowest
    id whose stored text is the text itself wins, else the lowest id."""
    by_text: dict[bytes, int] = {}
    for i, text in enumerate(_texts(target)):
        if not text:
            continue
        old = by_text.get(text)
        if old is None or target.token_text(old) != text and target.token_text(i) == text:
            by_text[text] = i
    d2t = np.full(draft.n_vocab, -1, dtype=np.int64)
    t2d = np.full(target.n_vocab, -1, dtype=np.int64)
    for i, text in enumerate(_texts(draft)):
        t = by_text.get(text, -1) if text else -1
        if t >= 0 and t2d[t] < 0:
            d2t[i], t2d[t] = t, i
    eog = {int(d): int(d2t[d]) for d in draft.eog_ids if 0 <= d < len(d2t) and d2t[d] in target.eog_ids}
    return VocabMap(draft.name, target.name, d2t, t2d, eog)
