"""Vocabulary compatibility and fingerprints, with fake backends (no model files)."""

from __future__ import annotations

import pytest

from specdecode.backends.base import BackendBase
from specdecode.errors import IncompatibleVocabularyError
from specdecode.backends.vocab import (MAX_VOCAB_SIZE_DIFFERENCE, check_vocab_compatible, fingerprint_serves, padding_tail,
                              vocab_fingerprint)


class FakeVocab(BackendBase):
    """token_text as given; control tokens (<s>, </s>, <|...|>) and padding ([PAD...]) render
    as no bytes, as llama.cpp renders them; </s> ends generation."""

    def __init__(self, texts: list[bytes], name: str = "fake"):
        self.texts = texts
        self.name = name

    @property
    def n_vocab(self) -> int:
        return len(self.texts)

    @property
    def eog_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in enumerate(self.texts) if t == b"</s>")

    def token_text(self, i: int) -> bytes:
        return self.texts[i]

    def token_bytes(self, i: int) -> bytes:
        t = self.texts[i]
        return b"" if t in (b"<s>", b"</s>") or t.startswith((b"[PAD", b"<|")) else t


BASE = [b"<s>", b"a", b"b", b"ab", b" the", b"\xe2\x82", b"</s>"]


def pads(start: int, n: int) -> list[bytes]:
    return [f"[PAD{i}]".encode() for i in range(start, start + n)]


def old_fingerprint(vocab) -> str:
    """The fingerprint as the registry's values were computed (size, then each id's text)."""
    import hashlib

    h = hashlib.sha256(str(vocab.n_vocab).encode())
    for i in range(vocab.n_vocab):
        h.update(len(vocab.token_text(i)).to_bytes(4, "little"))
        h.update(vocab.token_text(i))
    return h.hexdigest()[:32]


def test_same_vocabulary_is_accepted_and_has_the_same_fingerprint():
    check_vocab_compatible(FakeVocab(list(BASE), "draft"), FakeVocab(list(BASE), "target"))
    assert vocab_fingerprint(FakeVocab(list(BASE))) == vocab_fingerprint(FakeVocab(list(BASE)))


def test_different_sizes_name_both_sizes_and_models():
    # The target's extra id is its end-of-generation token: a token of its own, not padding.
    with pytest.raises(IncompatibleVocabularyError, match=r"draft vocabulary 6 != target vocabulary 7.*draft d.*target t"):
        check_vocab_compatible(FakeVocab(BASE[:-1], "d"), FakeVocab(list(BASE), "t"))
    far = [bytes([i % 256, i // 256]) for i in range(MAX_VOCAB_SIZE_DIFFERENCE + 8)]
    with pytest.raises(IncompatibleVocabularyError,
                       match=rf"draft vocabulary {len(far)} != target vocabulary 7 \(draft d, target t\).*at most "
                             rf"{MAX_VOCAB_SIZE_DIFFERENCE} padding ids"):
        check_vocab_compatible(FakeVocab(far, "d"), FakeVocab(list(BASE), "t"))


def test_same_size_different_tokens_names_the_first_differing_ids():
    other = list(BASE)
    other[2], other[4] = b"B", b" The"
    with pytest.raises(IncompatibleVocabularyError) as e:
        check_vocab_compatible(FakeVocab(other, "d"), FakeVocab(list(BASE), "t"))
    msg = str(e.value)
    assert "same vocabulary size (7)" in msg
    assert "id 2: draft b'B' vs target b'b'" in msg and "id 4: draft b' The' vs target b' the'" in msg
    assert vocab_fingerprint(FakeVocab(other)) != vocab_fingerprint(FakeVocab(list(BASE)))


def test_mismatches_shown_are_bounded():
    texts = [bytes([65 + i]) for i in range(20)]
    shifted = [bytes([97 + i]) for i in range(20)]
    with pytest.raises(IncompatibleVocabularyError) as e:
        check_vocab_compatible(FakeVocab(shifted), FakeVocab(texts), show=3)
    assert str(e.value).count("id ") == 3


def test_fingerprint_is_not_fooled_by_moving_bytes_between_tokens():
    # The same concatenated bytes split differently is another tokenizer.
    assert vocab_fingerprint(FakeVocab([b"ab", b"c"])) != vocab_fingerprint(FakeVocab([b"a", b"bc"]))


def test_auto_uses_the_default_draft_only_for_a_target_with_its_tokenizer(monkeypatch):
    """--draft auto decides by the tokenizer fingerprint the registry records for the default
    draft, not by a vocabulary size: a same-size vocabulary with other tokens is refused."""
    import dataclasses

    from specdecode.assembly import registry
    from specdecode.assembly.loading import default_draft_serves

    spec = registry.get_spec(registry.DEFAULT_DRAFT)
    monkeypatch.setitem(registry.REGISTRY, spec.name,
                        dataclasses.replace(spec, vocab_fingerprint=vocab_fingerprint(FakeVocab(list(BASE)))))
    assert default_draft_serves(FakeVocab(list(BASE)))
    same_size_other_tokens = list(BASE)
    same_size_other_tokens[3] = b"ba"
    assert not default_draft_serves(FakeVocab(same_size_other_tokens))


# --- vocabularies that differ by padding (Qwen2.5: 151,936 ids, 7B and up 152,064) ----------

@pytest.mark.parametrize("extra", [1, 128, MAX_VOCAB_SIZE_DIFFERENCE])
def test_padding_on_either_side_is_accepted_up_to_the_bound(extra):
    small = FakeVocab(list(BASE), "small")
    big = FakeVocab(list(BASE) + pads(len(BASE), extra), "big")
    check_vocab_compatible(small, big)  # draft smaller: the target's padding
    check_vocab_compatible(big, small)  # draft larger: the draft's padding (masked when drafting)
    # Unused control tokens past the shared ids are padding too; an end-of-generation token is not.
    check_vocab_compatible(small, FakeVocab(list(BASE) + [b"<|reserved_0|>", b"<|reserved_1|>"], "ctl"))


def test_beyond_the_bound_is_refused_naming_both_sizes():
    n = len(BASE)
    big = FakeVocab(list(BASE) + pads(n, MAX_VOCAB_SIZE_DIFFERENCE + 1), "big")
    for d, t in ((FakeVocab(list(BASE), "small"), big), (big, FakeVocab(list(BASE), "small"))):
        with pytest.raises(IncompatibleVocabularyError) as e:
            check_vocab_compatible(d, t)
        assert f"draft vocabulary {d.n_vocab} != target vocabulary {t.n_vocab}" in str(e.value)
        assert f"at most {MAX_VOCAB_SIZE_DIFFERENCE}" in str(e.value)


def test_different_sizes_with_different_shared_ids_name_sizes_and_first_differing_ids():
    other = list(BASE)
    other[2], other[4] = b"B", b" The"
    with pytest.raises(IncompatibleVocabularyError) as e:
        check_vocab_compatible(FakeVocab(other, "d"), FakeVocab(list(BASE) + pads(7, 128), "t"))
    msg = str(e.value)
    assert "draft vocabulary 7 != target vocabulary 135 (draft d, target t)" in msg
    assert "ids both have (0..6) differ" in msg
    assert "id 2: draft b'B' vs target b'b'" in msg and "id 4: draft b' The' vs target b' the'" in msg
    assert msg.index("id 2:") < msg.index("id 4:")


@pytest.mark.parametrize("side", ["draft", "target"])
def test_extra_ids_with_text_are_refused(side):
    """A larger side whose extra ids are tokens of their own (not padding) is another
    tokenizer: a draft could propose ids the target lacks, a target emit ids the draft
    cannot read."""
    small = FakeVocab(list(BASE), "small")
    big = FakeVocab(list(BASE) + pads(7, 3) + [b" dog", b"</s>"], "big")
    d, t = (big, small) if side == "draft" else (small, big)
    with pytest.raises(IncompatibleVocabularyError) as e:
        check_vocab_compatible(d, t)
    msg = str(e.value)
    assert f"draft vocabulary {d.n_vocab} != target vocabulary {t.n_vocab}" in msg
    assert f"the {side}'s ids 7..11 must be padding" in msg
    assert "id 10: b' dog'" in msg and "id 11: b'</s>'" in msg


def test_fingerprint_is_unchanged_and_covers_a_prefix():
    """The registry's recorded fingerprints stay valid: same value as before for a whole
    vocabulary; n_vocab fingerprints the vocabulary as if it ended there."""
    padded = FakeVocab(list(BASE) + pads(7, 5))
    assert vocab_fingerprint(padded) == old_fingerprint(padded)
    assert vocab_fingerprint(padded, len(BASE)) == vocab_fingerprint(FakeVocab(list(BASE))) == old_fingerprint(
        FakeVocab(list(BASE)))
    with pytest.raises(ValueError):
        vocab_fingerprint(padded, 13)


def test_fingerprint_serves_a_padded_target_not_another_tokenizer():
    fp = vocab_fingerprint(FakeVocab(list(BASE)))
    assert fingerprint_serves(FakeVocab(list(BASE)), fp)
    assert fingerprint_serves(FakeVocab(list(BASE) + pads(7, 128)), fp)  # Qwen2.5 7B's case
    assert fingerprint_serves(FakeVocab(list(BASE) + pads(7, MAX_VOCAB_SIZE_DIFFERENCE)), fp)
    assert not fingerprint_serves(FakeVocab(list(BASE) + pads(7, MAX_VOCAB_SIZE_DIFFERENCE + 1)), fp)
    assert not fingerprint_serves(FakeVocab(list(BASE) + [b" dog"] + pads(8, 3)), fp)  # text among the extras
    other = list(BASE)
    other[3] = b"ba"
    assert not fingerprint_serves(FakeVocab(other + pads(7, 128)), fp)
    assert not fingerprint_serves(FakeVocab(list(BASE[:-1])), fp)  # a smaller target: not from a fingerprint
    assert not fingerprint_serves(FakeVocab(list(BASE)), None)
    # A draft that is itself padded (Qwen2.5 0.5B: [PAD151665].. up to 151,935) under a target padded further.
    draft = FakeVocab(list(BASE) + pads(7, 4))
    assert fingerprint_serves(FakeVocab(list(BASE) + pads(7, 9)), vocab_fingerprint(draft))
    assert padding_tail(FakeVocab(list(BASE) + pads(7, 9))) == 9
    assert padding_tail(FakeVocab(list(BASE) + pads(7, 9)), limit=4) == 4


def test_auto_recognises_a_padded_target(monkeypatch):
    import dataclasses

    from specdecode.assembly import registry
    from specdecode.assembly.loading import default_draft_serves

    spec = registry.get_spec(registry.DEFAULT_DRAFT)
    monkeypatch.setitem(registry.REGISTRY, spec.name,
                        dataclasses.replace(spec, vocab_fingerprint=vocab_fingerprint(FakeVocab(list(BASE)))))
    assert default_draft_serves(FakeVocab(list(BASE) + pads(7, 128)))
    assert not default_draft_serves(FakeVocab(list(BASE) + pads(7, MAX_VOCAB_SIZE_DIFFERENCE + 1)))
