"""Backend conformance on llama.cpp (the same properties any backend must have)."""

from __future__ import annotations

import numpy as np
import pytest

from specdecode.backends.base import Backend
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.errors import ContextOverflowError, ModelFileError

from backend_conformance import check_forward_rollback_forward, check_logits_only_where_asked


def test_is_a_backend(smollm):
    assert isinstance(smollm, Backend)
    assert smollm.n_vocab == 49152
    assert smollm.eog_ids and all(0 <= t < smollm.n_vocab for t in smollm.eog_ids)


def test_forward_rollback_forward_equals_fresh_forward(smollm):
    ids = smollm.tokenize("The quick brown fox jumps over the lazy dog because")
    # llama.cpp's batched and one-token kernels differ slightly (docs/architecture.md).
    check_forward_rollback_forward(smollm, ids, atol=1e-3)


def test_logits_only_where_asked(smollm):
    check_logits_only_where_asked(smollm, smollm.tokenize("one two three four five six seven eight"))


def test_long_forward_is_split_into_batches(smollm_path):
    b = LlamaCppBackend(smollm_path, n_ctx=256, n_batch=16)
    ids = (b.tokenize("count: one two three four five six seven eight nine ten") * 6)[:60]
    assert len(ids) == 60
    whole = b.forward(ids, logits_for=[10, 59])
    b.rollback(0)
    b2 = LlamaCppBackend(smollm_path, n_ctx=256, n_batch=64)
    ref = b2.forward(ids, logits_for=[10, 59])
    assert (whole.argmax(-1) == ref.argmax(-1)).all()
    np.testing.assert_allclose(whole, ref, atol=0.5)
    b.close(), b2.close()


def test_context_overflow_is_an_error(smollm_path):
    b = LlamaCppBackend(smollm_path, n_ctx=256)
    n = b.n_ctx  # llama.cpp may round the context up
    with pytest.raises(ContextOverflowError, match=f"exceed the context of {n}"):
        b.forward(list(range(100, 110 + n)), logits_for=[])
    assert b.kv_len == 0
    b.close()


def test_tokenize_roundtrip(smollm):
    text = "Hello, world! 你好"
    ids = smollm.tokenize(text, add_special=False)
    assert b"".join(smollm.token_bytes(t) for t in ids).decode() == text


def test_chat_template_from_the_gguf(smollm):
    text = smollm.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_corrupt_file_is_named(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(ModelFileError, match="broken.gguf"):
        LlamaCppBackend(bad)


# --- flash attention: llama.cpp's choice by default, SPECDECODE_LLAMA_FLASH_ATTN chooses -----

def test_flash_attention_choice_reads_the_environment(monkeypatch):
    from specdecode.backends.llama_cpp.lib import flash_attention
    from specdecode.errors import SpecDecodeError

    monkeypatch.delenv("SPECDECODE_LLAMA_FLASH_ATTN", raising=False)
    assert flash_attention() == "auto"
    for value, mode in (("on", "on"), (" OFF ", "off"), ("auto", "auto"), ("", "auto"), ("  ", "auto")):  # empty: unset
        monkeypatch.setenv("SPECDECODE_LLAMA_FLASH_ATTN", value)
        assert flash_attention() == mode
    monkeypatch.setenv("SPECDECODE_LLAMA_FLASH_ATTN", "maybe")
    with pytest.raises(SpecDecodeError, match=r"SPECDECODE_LLAMA_FLASH_ATTN='maybe'.*auto, on, off"):
        flash_attention()


def test_the_context_is_created_with_the_chosen_flash_attention(smollm_path, monkeypatch):
    """The setting reaches llama.cpp's context parameters (llama_flash_attn_type: off 0, on 1,
    auto -1), and the cost curve's key tells the settings apart: a curve measured with one is
    never read for the other."""
    import llama_cpp

    from specdecode.control.costcache import machine_key

    seen = []
    create = llama_cpp.llama_init_from_model

    def spy(model, cparams):
        seen.append(cparams.flash_attn_type)
        return create(model, cparams)

    monkeypatch.setattr(llama_cpp, "llama_init_from_model", spy)
    keys = {}
    for mode, value in (("off", 0), ("on", 1), ("auto", -1)):
        monkeypatch.setenv("SPECDECODE_LLAMA_FLASH_ATTN", mode)
        b = LlamaCppBackend(smollm_path, n_ctx=256)
        try:
            assert seen[-1] == value and b.flash_attention == mode
            keys[mode] = machine_key(b)
            assert b.forward(b.tokenize("Hello there"), [1]).shape == (1, b.n_vocab)
        finally:
            b.close()
    assert len(set(keys.values())) == 3


@pytest.mark.parametrize("variable", ["SPECDECODE_LLAMA_FLASH_ATTN", "SPECDECODE_LLAMA_BUFFERS"])
def test_a_bad_setting_loads_nothing(smollm_path, monkeypatch, variable):
    import llama_cpp

    from specdecode.errors import SpecDecodeError

    loads = []
    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", lambda *a: loads.append(a))
    monkeypatch.setenv(variable, "fast")
    with pytest.raises(SpecDecodeError, match=f"{variable}='fast' is not a choice"):
        LlamaCppBackend(smollm_path, n_ctx=256)
    assert loads == []
