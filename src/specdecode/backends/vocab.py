"""Tokenizer identity: whether a draft model can draft for a target.

A draft is compatible when it has the target's tokenizer: the ids both vocabularies have
(0..min(sizes)-1) carry the same token text, and the sizes are equal or differ only by
padding. Checkpoints of one tokenizer often pad the embedding matrix to a round size:
Qwen2.5 7B and up have 152,064 ids, 0.5B-3B 151,936, the same tokenizer (151,665 real
tokens; every id beyond is a ``[PAD<id>]`` token of type UNUSED in the GGUF). So one side
may have up to MAX_VOCAB_SIZE_DIFFERENCE more ids, each of them padding (:func:`is_padding`).
Drafts then only use ids the target has (``ModelDrafter`` masks the others), and the
target's own distribution is verified whole, so decoding stays lossless.

:func:`vocab_fingerprint` condenses a vocabulary into one string, so that a registry entry
can record which tokenizer its model has, and :func:`fingerprint_serves` tells whether a
draft with a recorded fingerprint serves a target (``--draft auto``) without loading it.
"""

from __future__ import annotations

import hashlib

from .base import Backend
from ..errors import IncompatibleVocabularyError

# Most ids one vocabulary may have beyond the other's (all padding). llama.cpp's
# speculative example allows 128 (SPEC_VOCAB_MAX_SIZE_DIFFERENCE): exactly Qwen2.5's
# padding (152,064 - 151,936), but llama.cpp checks only the shared ids. Here every extra
# id must also be padding, which is what makes the pair safe; the bound only keeps out a
# vocabulary that merely starts like the other. 1024 admits the paddings real model
# families use: Megatron-trained checkpoints pad to a multiple of 128 x tensor-parallel
# size (Pythia: 50,304 ids up to 2.8B, 50,432 at 6.9B, 50,688 at 12B, a difference of 384
# over the same 50,254-token tokenizer), and two vocabularies each padded up to a multiple
# of at most 1024 differ by less than 1024.
MAX_VOCAB_SIZE_DIFFERENCE = 1024


def is_padding(backend: Backend, token_id: int) -> bool:
    """Whether a token can never be part of a text: it renders as no bytes (padding, an
    unused or a control token: llama.cpp's UNUSED, CONTROL and UNKNOWN types; ids past a
    Hugging Face tokenizer) and does not end generation."""
    return backend.token_bytes(token_id) == b"" and token_id not in backend.eog_ids


def _texts_blob(backend: Backend, n: int) -> tuple[bytes, list[int]]:
    """Ids 0..n-1 as the fingerprint hashes them (4-byte length, then the token text, in id
    order), and the offset where each id's entry starts (offsets [n+1])."""
    parts, offsets, off = [], [0], 0
    for i in range(n):
        text = backend.token_text(i)
        parts.append(len(text).to_bytes(4, "little"))
        parts.append(text)
        off += 4 + len(text)
        offsets.append(off)
    return b"".join(parts), offsets


def _digest(n: int, blob: memoryview | bytes) -> str:
    h = hashlib.sha256(str(n).encode())
    h.update(blob)
    return h.hexdigest()[:32]


def vocab_fingerprint(backend: Backend, n_vocab: int | None = None) -> str:
    """SHA-256 (hex, 32 characters) of the vocabulary: its size and each id's token text
    (:meth:`Backend.token_text`, control and padding tokens included), in id order.

    n_vocab: fingerprint only ids 0..n_vocab-1, as if the vocabulary ended there (default:
    all of it). Two models have the same fingerprint exactly when their vocabularies are
    identical (same size, same text for every id); :func:`fingerprint_serves` also
    recognises a target that is the fingerprinted vocabulary plus padding.
    """
    n = backend.n_vocab if n_vocab is None else n_vocab
    if not 0 <= n <= backend.n_vocab:
        raise ValueError(f"n_vocab = {n} outside 0..{backend.n_vocab}")
    blob, _ = _texts_blob(backend, n)
    return _digest(n, blob)


def padding_tail(backend: Backend, limit: int = MAX_VOCAB_SIZE_DIFFERENCE) -> int:
    """How many of the last ids are padding (:func:`is_padding`), counting back at most ``limit``."""
    n = backend.n_vocab
    count = 0
    while count < min(limit, n - 1) and is_padding(backend, n - 1 - count):
        count += 1
    return count


def fingerprint_serves(target: Backend, fingerprint: str | None) -> bool:
    """Whether a draft whose :func:`vocab_fingerprint` is ``fingerprint`` passes
    :func:`check_vocab_compatible` against ``target``, as far as a fingerprint can tell.

    True when the target has that vocabulary, or when the vocabulary is the target's first
    n ids and the target's ids n.. are padding, at most MAX_VOCAB_SIZE_DIFFERENCE of them
    (a padded target: Qwen2.5 7B's 152,064 ids over the 0.5B draft's 151,936). Every such
    n is tried (each costs one hash of the vocabulary's text, about a millisecond for
    150k ids). A draft larger than the target is not recognised from a fingerprint: its
    extra ids' text is not recorded.
    """
    if fingerprint is None:
        return False
    n = target.n_vocab
    tail = padding_tail(target)
    if not tail:
        return vocab_fingerprint(target) == fingerprint
    blob, offsets = _texts_blob(target, n)
    view = memoryview(blob)
    return any(_digest(m, view[: offsets[m]]) == fingerprint for m in range(n, n - tail - 1, -1))


def _shown(draft: Backend, target: Backend, ids: list[int]) -> str:
    return ", ".join(f"id {i}: draft {draft.token_text(i)!r} vs target {target.token_text(i)!r}" for i in ids)


def check_vocab_compatible(draft: Backend, target: Backend, show: int = 5) -> None:
    """Raise IncompatibleVocabularyError unless the draft can draft for the target.

    Accepted: the same token text for every id both have (0..min(sizes)-1), and, when the
    sizes differ, at most MAX_VOCAB_SIZE_DIFFERENCE extra ids on the larger side, every one
    of them padding (:func:`is_padding`): a draft's extra ids would be ids the target
    cannot verify (ModelDrafter masks them), a target's extra ids ones the draft cannot
    read. Either way a padding id never occurs in a text.

    The message names both models and both sizes, and shows up to ``show`` offending ids
    (the first differing shared ids, or the first extra ids that are not padding).
    """
    nd, nt = draft.n_vocab, target.n_vocab
    if not (draft.has_text and target.has_text):
        _check_codebooks(draft, target)
        return
    sizes = f"draft vocabulary {nd} != target vocabulary {nt} (draft {draft.name}, target {target.name})"
    if abs(nd - nt) > MAX_VOCAB_SIZE_DIFFERENCE:
        raise IncompatibleVocabularyError(
            f"{sizes}: the draft model must share the target's tokenizer "
            f"(sizes may differ by at most {MAX_VOCAB_SIZE_DIFFERENCE} padding ids)"
        )
    shared = min(nd, nt)
    mismatches = []
    for i in range(shared):
        if draft.token_text(i) != target.token_text(i):
            mismatches.append(i)
            if len(mismatches) >= show:
                break
    if mismatches:
        if nd == nt:
            raise IncompatibleVocabularyError(
                f"draft {draft.name} and target {target.name} have the same vocabulary size ({nt}) "
                f"but different tokens: {_shown(draft, target, mismatches)}"
            )
        raise IncompatibleVocabularyError(
            f"{sizes}, and the ids both have (0..{shared - 1}) differ: {_shown(draft, target, mismatches)}: "
            f"the draft model must share the target's tokenizer"
        )
    if nd == nt:
        return
    larger, side = (draft, "draft") if nd > nt else (target, "target")
    text = [i for i in range(shared, larger.n_vocab) if not is_padding(larger, i)][:show]
    if text:
        shown = ", ".join(f"id {i}: {larger.token_text(i)!r}" for i in text)
        raise IncompatibleVocabularyError(
            f"{sizes}: the {side}'s ids {shared}..{larger.n_vocab - 1} must be padding (tokens that never "
            f"occur in a text), but some are tokens of their own: {shown}: the draft model must share "
            f"the target's tokenizer"
        )


def _check_codebooks(draft: Backend, target: Backend) -> None:
    """Models over codes (no text, :class:`specdecode.backends.module.ModuleBackend`): the
    draft must have the target's codebook, by name and size (codes carry no text to compare,
    and no padding)."""
    names = [getattr(b, "codebook", "text") if not b.has_text else "a text vocabulary"
             for b in (draft, target)]
    if names[0] != names[1] or draft.n_vocab != target.n_vocab:
        raise IncompatibleVocabularyError(
            f"draft {draft.name} (codebook {names[0]!r}, {draft.n_vocab} codes) cannot draft for target "
            f"{target.name} (codebook {names[1]!r}, {target.n_vocab} codes): a draft model needs the target's "
            f"codebook, the same name and size")
