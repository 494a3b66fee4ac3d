"""Vocabulary compatibility and fingerprints, with fake backends (no model files)."""

from __future__ import annotations

import pytest

from specdecode.errors import IncompatibleVocabularyError
from specdecode.vocab import check_vocab_compatible, vocab_fingerprint


class FakeVocab:
    def __init__(self, texts: list[bytes], name: str = "fake"):
        self.texts = texts
        self.name = name

    @property
    def n_vocab(self) -> int:
        return len(self.texts)

    def token_text(self, i: int) -> bytes:
        return self.texts[i]


BASE = [b"<s>", b"a", b"b", b"ab", b" the", b"\xe2\x82", b"</s>"]


def test_same_vocabulary_is_accepted_and_has_the_same_fingerprint():
    check_vocab_compatible(FakeVocab(list(BASE), "draft"), FakeVocab(list(BASE), "target"))
    assert vocab_fingerprint(FakeVocab(list(BASE))) == vocab_fingerprint(FakeVocab(list(BASE)))


def test_different_sizes_name_both_sizes_and_models():
    with pytest.raises(IncompatibleVocabularyError, match=r"draft vocabulary 6 != target vocabulary 7.*draft d.*target t"):
        check_vocab_compatible(FakeVocab(BASE[:-1], "d"), FakeVocab(list(BASE), "t"))


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

    from specdecode import models
    from specdecode.loading import default_draft_serves

    spec = models.get_spec(models.DEFAULT_DRAFT)
    monkeypatch.setitem(models.REGISTRY, spec.name,
                        dataclasses.replace(spec, vocab_fingerprint=vocab_fingerprint(FakeVocab(list(BASE)))))
    assert default_draft_serves(FakeVocab(list(BASE)))
    same_size_other_tokens = list(BASE)
    same_size_other_tokens[3] = b"ba"
    assert not default_draft_serves(FakeVocab(same_size_other_tokens))
