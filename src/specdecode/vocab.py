"""Tokenizer identity: whether a draft model can draft for a target.

A draft is compatible when it has the target's vocabulary: the same size and the same
token text for every id. :func:`vocab_fingerprint` condenses that into one string, so
that a registry entry can record which tokenizer its model has and ``--draft auto`` can
tell whether the default draft model serves a target without loading it.
"""

from __future__ import annotations

import hashlib

from .backends.base import Backend
from .errors import IncompatibleVocabularyError


def vocab_fingerprint(backend: Backend) -> str:
    """SHA-256 (hex, 32 characters) of the vocabulary: its size and each id's token text
    (:meth:`Backend.token_text`, control tokens included), in id order. Two models have
    the same fingerprint exactly when :func:`check_vocab_compatible` accepts them."""
    h = hashlib.sha256(str(backend.n_vocab).encode())
    for i in range(backend.n_vocab):
        text = backend.token_text(i)
        h.update(len(text).to_bytes(4, "little"))
        h.update(text)
    return h.hexdigest()[:32]


def check_vocab_compatible(draft: Backend, target: Backend, show: int = 5) -> None:
    """Raise IncompatibleVocabularyError unless draft and target share the vocabulary.

    Same size, and the same token text for every id. The message names both models and
    shows up to ``show`` mismatching ids.
    """
    if draft.n_vocab != target.n_vocab:
        raise IncompatibleVocabularyError(
            f"draft vocabulary {draft.n_vocab} != target vocabulary {target.n_vocab} "
            f"(draft {draft.name}, target {target.name}): the draft model must share the target's tokenizer"
        )
    mismatches = []
    for i in range(target.n_vocab):
        if draft.token_text(i) != target.token_text(i):
            mismatches.append(i)
            if len(mismatches) >= show:
                break
    if mismatches:
        shown = ", ".join(f"id {i}: draft {draft.token_text(i)!r} vs target {target.token_text(i)!r}" for i in mismatches)
        raise IncompatibleVocabularyError(
            f"draft {draft.name} and target {target.name} have the same vocabulary size ({target.n_vocab}) "
            f"but different tokens: {shown}"
        )
